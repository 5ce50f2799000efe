"""CPU: the pytest plugin's options, the Python API's contract (enable, phase, step), report round
trips and multi-rank merge."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from graphsan.cli.main import main
from graphsan.cli.run import report_path_for
from graphsan.report import (
    SCHEMA_VERSION,
    Finding,
    GraphInfo,
    Report,
    StaleMemoryError,
    format_finding,
    short_kernel,
)
from graphsan.report.ranks import merge_reports

pytest_plugins = ["pytester"]


def finding(rank=None, kind="unmapped", node=7):
    g = GraphInfo(3, "mamba bwd", [("train.py", 40, "capture")], (1, 0), 0)
    return Finding.of(  # of any kind: a baked one's free stack is where it changed
        kind=kind,
        graph=g,
        node=node,
        kernel="void dequant<float>(float const*, float*)",
        param=1,
        offset=8,
        address=0x7F0000001000,
        nbytes=4096,
        block_address=0x7F0000001000,
        pool="default pool",
        alloc_stack=[("quant/linear.py", 120, "_alloc_columnwise")],
        free_stack=[("train.py", 200, "evaluate"), ("quant/linear.py", 88, "clear_workspace")],
        phase="eval (no_grad)",
        step=100,
        rank=rank,
    )


def test_finding_text_reads_like_a_bug_report():
    text = format_finding(finding())
    for needle in (
        "UNMAPPED",
        "mamba bwd",
        "node 7",
        "param 1, byte offset 8",
        "0x7f0000001000",
        "4096 bytes",
        "_alloc_columnwise",
        "clear_workspace",
        "phase eval (no_grad)",
        "step 100",
        "likely cause",
    ):
        assert needle in text, needle
    err = StaleMemoryError([finding()])
    assert isinstance(err, RuntimeError) and "replay stopped before launch" in str(err)


def test_short_kernel_drops_templates_and_arguments():
    assert short_kernel("void at::native::k<4, F<float> >(int, F<float>)") == "at::native::k<>"


# two names from the H200 runs, as demangled
MUL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, "
    "float, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int, "
    "at::native::AUnaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float>"
    " >, std::array<char*, 2ul>)"
)
WHERE = (
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
    "(anonymous namespace)::where_kernel_impl(at::TensorIterator&)::{lambda()#1}::operator()() "
    "const::{lambda()#5}::operator()() const::{lambda(bool, unsigned char, unsigned char)#1}>("
    "at::TensorIteratorBase&, at::native::(anonymous namespace)::where_kernel_impl(at::"
    "TensorIterator&)::{lambda()#1}::operator()() const)::{lambda(int)#1}>(int, at::native::"
    "gpu_kernel_impl_nocast<at::native::(anonymous namespace)::where_kernel_impl(at::"
    "TensorIterator&)::{lambda()#1}::operator()() const>(at::TensorIteratorBase&)::{lambda(int)#1})"
)


def test_short_kernel_keeps_what_the_kernel_computes():
    assert short_kernel(MUL, limit=100) == (
        "at::native::vectorized_elementwise_kernel<> [AUnaryFunctor, MulFunctor]"
    )
    assert short_kernel(WHERE, limit=100) == "at::native::elementwise_kernel<> [where_kernel_impl]"


def test_report_round_trip_and_version_check(tmp_path):
    rep = Report([finding(rank=0)], [{"id": 3, "nodes": 12}], rank=0, policy="record")
    path = tmp_path / "r.json"
    rep.save(str(path))
    back = Report.load(str(path))
    assert back.findings == rep.findings and back.rank == 0
    data = json.loads(path.read_text())
    assert data["version"] == SCHEMA_VERSION
    v1 = dict(data, version=1, findings=[dict(data["findings"][0])])
    del v1["findings"][0]["also_used_by"]  # written before version 2 added it
    path.write_text(json.dumps(v1))
    assert Report.load(str(path)).findings == rep.findings
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 99 is not supported"):
        Report.load(str(path))


def test_report_path_per_rank():
    assert report_path_for("out.json", None) == "out.json"
    assert report_path_for("dir/out.json", 3) == "dir/out.rank3.json"


def test_three_ranks_merge(tmp_path, capsys, monkeypatch):
    """Each rank saves its report as under torchrun (RANK, WORLD_SIZE); one summary merges them."""
    from graphsan.command_line import rank_from_env

    paths = [str(tmp_path / f"out.rank{r}.json") for r in range(3)]
    monkeypatch.setenv("WORLD_SIZE", "3")
    for r, path in enumerate(paths):
        monkeypatch.setenv("RANK", str(r))
        rank = rank_from_env()
        Report([finding(rank=rank)] if r != 1 else [], [], rank=rank).save(path)
    assert main(["report", *paths]) == 0
    out = capsys.readouterr().out
    assert "3 report(s)" in out and "1 distinct" in out
    assert "seen on rank 0, rank 2" in out and "no findings on rank 1" in out


def test_merge_keeps_different_bugs_apart():
    a = Report([finding(rank=0)], [], rank=0)
    b = Report([finding(rank=1, kind="freed", node=2)], [], rank=1)
    text = merge_reports([a, b])
    assert "2 distinct" in text and "seen on rank 0:" in text and "seen on rank 1:" in text


def test_enable_without_cuda_says_it_is_idle(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    import graphsan

    san = graphsan.enable("raise")
    assert not san.active and san.disabled_reason == "CUDA is not available"
    assert "no CUDA graphs to watch" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown policy 'loud'"):
        graphsan.enable("loud")
    with graphsan.phase("eval", step=5):
        assert graphsan._context.current() == ("eval", 5)
    graphsan.disable()


def test_enable_is_idempotent_until_disable(capsys):
    import graphsan

    san = graphsan.enable("raise")
    capsys.readouterr()
    assert graphsan.enable("warn") is san and san.policy == "warn"
    assert graphsan.current() is san
    assert capsys.readouterr().err == ""  # said once, by the first call
    with graphsan.watch("record") as inner:
        assert inner is san and san.policy == "record"
    assert san.policy == "warn" and graphsan.enable("warn") is san  # watch left it on
    graphsan.disable()
    again = graphsan.enable("raise")
    assert again is not san
    graphsan.disable()


def test_a_phase_object_is_reusable_and_nests():
    import graphsan

    ctx = graphsan._context
    before = ctx.current()
    evaluation = graphsan.phase("eval", step=7)
    for _ in range(2):
        with evaluation as entered:
            assert entered is evaluation and ctx.current() == ("eval", 7)
            with graphsan.phase("save"), evaluation:
                assert ctx.current() == ("eval", 7)
            assert ctx.current() == ("eval", 7)
        assert ctx.current() == before

    @graphsan.phase("checkpoint", step=3)
    def save():
        return ctx.current()

    assert save() == ("checkpoint", 3) and save() == ("checkpoint", 3)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda g: g.step(-5), ValueError, "graphsan.step: count must be an integer >= 0, got -5"),
        (lambda g: g.step(1.5), TypeError, "graphsan.step: count must be an integer >= 0, got 1.5"),
        (lambda g: g.step("2"), TypeError, "graphsan.step: count must be an integer >= 0"),
        (lambda g: g.step(True), TypeError, "graphsan.step: count must be an integer >= 0"),
        (
            lambda g: g.phase("eval", step="ten"),
            TypeError,
            "graphsan.phase: step must be None or an integer >= 0, got 'ten'",
        ),
        (lambda g: g.phase("eval", step=-1), ValueError, "step must be None or an integer >= 0"),
        (lambda g: g.phase("eval", step=2.0), TypeError, "step must be None or an integer >= 0"),
        (lambda g: g.phase(""), ValueError, "graphsan.phase: name must be a non-empty string"),
        (lambda g: g.phase(3), TypeError, "graphsan.phase: name must be a string, got 3"),
    ],
)
def test_bad_steps_and_phases_are_refused_naming_the_argument(call, error, message):
    import graphsan

    steps = graphsan._context.steps
    with pytest.raises(error) as info:
        call(graphsan)
    assert message in str(info.value)
    assert graphsan._context.steps == steps


def test_step_counts_and_returns_the_step():
    import numpy as np

    import graphsan

    start = graphsan._context.steps
    assert graphsan.step() == start + 1
    assert graphsan.step(np.int64(2)) == start + 3
    assert graphsan.step(0) == start + 3


def test_a_session_with_the_plugin_turns_off_what_it_turned_on(pytester):
    """An in-process pytest session (pytest's own runs of pytest) leaves the process as it
    found it: graphsan off again, or still on where the process had turned it on."""
    import graphsan

    pytester.makepyfile("def test_ok():\n    assert True\n")
    assert pytester.runpytest("--graphsan=record").ret == 0
    assert not graphsan._enabled
    san = graphsan.enable("warn")
    try:
        assert pytester.runpytest("--graphsan=record").ret == 0
        assert graphsan._enabled and graphsan.current() is san
    finally:
        graphsan.disable()


def test_pytest_plugin_option(pytester):
    pytester.makepyfile("def test_ok():\n    assert True\n")
    result = pytester.runpytest("--graphsan=record")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["graphsan:*"])
    bad = pytester.runpytest("--graphsan=loud")
    assert bad.ret != 0
    bad.stderr.fnmatch_lines(["*unknown policy 'loud'*"])


def test_pytest_plugin_option_does_not_swallow_a_test_path(pytester):
    pytester.makepyfile(test_x="def test_x():\n    pass\n", test_y="def test_y():\n    pass\n")
    sub = pytester.mkdir("sub")
    (sub / "test_z.py").write_text("def test_z():\n    pass\n")
    for argv in (
        ["--graphsan", "test_x.py"],
        ["--graphsan", "sub/test_z.py::test_z"],
        ["--graphsan", "record", "test_x.py"],
    ):
        result = pytester.runpytest(*argv)
        result.assert_outcomes(passed=1)
        policy = "record" if "record" in argv else "raise"
        result.stdout.fnmatch_lines([f"graphsan: *policy {policy}"])
    bad = pytester.runpytest("--graphsan", "loud", "test_x.py")
    assert bad.ret != 0
    bad.stderr.fnmatch_lines(["*unknown policy 'loud'*"])


def test_pytest_plugin_help_names_every_policy(pytester):
    from graphsan.runtime.sanitizer import POLICIES

    help_text = " ".join(pytester.runpytest("--help").outlines)
    start = help_text.index("--graphsan=[POLICY]")
    for policy in POLICIES:
        assert policy in help_text[start : start + 300], policy


# what the plugin's module answers in every pytest session of the environment: its options,
# the command line's words, and whether to set the sanitizer up and take it down
MODULE_HOOKS = {
    "pytest_addoption",
    "pytest_load_initial_conftests",
    "pytest_configure",
    "pytest_unconfigure",
}


def _graphsan_hooks(pm) -> dict[str, list]:
    """Each hook that something of graphsan's implements in this plugin manager: its objects."""
    found: dict[str, list] = {}
    for name in dir(pm.hook):
        caller = getattr(pm.hook, name)
        for impl in caller.get_hookimpls() if hasattr(caller, "get_hookimpls") else ():
            plugin = impl.plugin
            module = (
                plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
            )
            if module.split(".")[0] == "graphsan":
                found.setdefault(name, []).append(plugin)
    return found


class _Look:
    """A plugin of the inner session's: what graphsan has registered as the session starts."""

    def pytest_sessionstart(self, session):
        self.config = session.config
        self.hooks = _graphsan_hooks(session.config.pluginmanager)
        self.named = session.config.pluginmanager.list_name_plugin()


def test_only_a_session_with_graphsan_registers_its_plugin_and_its_end_removes_it(pytester):
    """The plugin's module loads with every pytest session of the environment; its per-test
    hooks must not run in one that did not ask for graphsan."""
    pytester.makepyfile("def test_ok():\n    pass\n")
    look = _Look()
    pytester.inline_run("-p", "no:cacheprovider", plugins=[look]).assertoutcome(passed=1)
    assert set(look.hooks) <= MODULE_HOOKS, sorted(set(look.hooks) - MODULE_HOOKS)

    from graphsan.cli.pytest_plugin import PLUGIN_NAME, GraphsanPlugin, plugin_of

    look = _Look()
    result = pytester.inline_run("--graphsan=record", "-p", "no:cacheprovider", plugins=[look])
    result.assertoutcome(passed=1)
    plugins = [(name, p) for name, p in look.named if isinstance(p, GraphsanPlugin)]
    assert len(plugins) == 1 and plugins[0][0] == PLUGIN_NAME
    plugin = plugins[0][1]
    for hook in ("pytest_runtest_call", "pytest_sessionfinish", "pytest_terminal_summary"):
        assert look.hooks[hook] == [plugin], hook
    # the session has ended: its plugin is gone from the manager and from the stash
    pm = look.config.pluginmanager
    assert pm.get_plugin(PLUGIN_NAME) is None and not pm.is_registered(plugin)
    assert plugin_of(look.config) is None
    assert set(_graphsan_hooks(pm)) <= MODULE_HOOKS


def test_a_long_kernel_name_prints_short_and_stays_whole_in_json():
    f = dataclasses.replace(finding(), kernel=WHERE)
    text = format_finding(f)
    assert (
        f"  node 7: at::native::elementwise_kernel<> [where_kernel_impl] ({len(WHERE)}-character "
        "name in the JSON report)" in text
    )
    assert Report([f]).to_dict()["findings"][0]["kernel"] == WHERE
    f = dataclasses.replace(f, kernel="void dequant<float>(float const*, float*)")
    assert "  node 7: void dequant<float>(float const*, float*)\n" in format_finding(f)


def test_pytest_plugin_summary_counts_real_graph_records():
    """The terminal summary reads the sanitizer's GraphStats records (dataclasses, not the
    report's dicts): a suite that captured graphs once ended in an AttributeError here."""
    from types import SimpleNamespace

    from graphsan.cli.pytest_plugin import GraphsanPlugin
    from graphsan.core.records import GraphStats, ReferenceCounts, WalkStats

    stats = {
        gid: GraphStats(
            gid,
            f"g{gid}",
            (),
            (1, gid),
            WalkStats(nodes=n, kernels=n),
            ReferenceCounts(),
            3,
            None,
            {},
        )
        for gid, n in ((1, 5), (2, 7))
    }
    from graphsan.runtime.sanitizer import Sanitizer

    san = Sanitizer("record")  # not started: nothing of torch's is patched
    san.graph_stats, san.findings = stats, [finding()]
    lines = []
    reporter = SimpleNamespace(write_line=lines.append)
    GraphsanPlugin(san).pytest_terminal_summary(reporter)
    assert lines == ["graphsan: 2 graph(s), 12 node(s) watched, 1 finding(s), policy record"]

"""State a graph baked at capture beside addresses (core.baked, cuda.baked), through the fake
graphs of tests/fake_cuda.py and both attachments: a module switched between train and eval, an
optimizer hyperparameter taken by value and changed since, an entry re-pointed at another tensor
while the old one lives on; and the correct twins of each, which stay quiet. The capture runs a
real CPU forward and optimizer step between `capture_begin` and `capture_end`, as a program does
under `torch.cuda.graph`."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from graphsan.core.kinds import Kind
from graphsan.core.memory_map import MemoryMap
from graphsan.report import StaleMemoryError
from tests import fake_cuda

POOL = (1, 3)


class Net(nn.Module):
    """Linear -> dropout -> LayerNorm; `p` 0 makes nothing in it depend on the mode."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(p)
        self.norm = nn.LayerNorm(4)
        self.act = nn.GELU()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.act(self.norm(self.drop(self.lin(x)))) * self.scale


class Branchy(nn.Module):
    """A forward that reads `training` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * (2.0 if self.training else 1.0)


def segments_at(tensors) -> MemoryMap:
    """An allocator view with one segment per tensor, at the tensor's own (CPU) address: the
    graph's kernel reads them, so they are the graph's watched blocks."""
    segments = []
    for t in tensors:
        addr, size = t.data_ptr(), t.untyped_storage().nbytes()
        block = {"address": addr, "size": size, "state": "active_allocated"}
        segments.append(
            {"address": addr, "total_size": size, "segment_pool_id": (0, 0), "blocks": [block]}
        )
    return MemoryMap.from_snapshot({"segments": segments})


@pytest.fixture(params=("raise", "warn"))
def san(request, monkeypatch, attach, fake_sanitizer):
    env = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    cls = fake_cuda.graph_class(monkeypatch, POOL, attach)
    s = fake_sanitizer(env, request.param)
    s.context.start()
    s.recorder.start()

    def capture(run, reads=()):
        """A graph whose capture runs `run()` and whose one kernel reads `reads` (tensors)."""
        reads = list(reads)
        if reads:
            env["map"] = segments_at(reads)
            env["nodes"] = [fake_cuda.kernel(0, *(t.data_ptr() for t in reads))]
        g = cls()
        g.capture_begin(POOL)
        run()
        g.capture_end()
        return g

    s.test_capture = capture
    yield s
    s.recorder.stop()
    s.context.stop()


def replay(san, g) -> list:
    """The findings of one replay of `g`, whatever the policy does with them."""
    before = len(san.findings)
    try:
        g.replay()
    except StaleMemoryError as err:
        assert san.policy.stops_replay
        return list(err.findings)
    return san.findings[before:]


def this_line_minus(n: int) -> int:
    return sys._getframe(1).f_lineno - n


# -- mode ---------------------------------------------------------------------------------------
def test_a_model_switched_to_eval_is_named_with_where_it_switched(san):
    model, x = Net(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    g.replay()
    model.eval()
    line = this_line_minus(1)
    launched = g.launched
    (f,) = replay(san, g)
    assert f.kind is Kind.MODE
    assert f.baked.modules == ("Net.drop",)  # the Linear, LayerNorm and GELU replay alike in both
    assert (f.baked.captured, f.baked.current) == ("train", "eval")
    changed = f.baked.changed_at
    assert changed[-1][0].endswith("test_baked.py") and changed[-1][1] == line
    assert f.free_stack == () and f.order is None  # nothing was freed
    assert "1 module(s) captured in train mode are in eval mode now (Net.drop)" in f.now
    if san.policy.stops_replay:
        assert g.launched == launched
        model.train()  # switched back: the replay goes ahead
        assert replay(san, g) == [] and g.launched == launched + 1


def test_a_mode_finding_reads_as_one_wherever_it_is_written(san):
    """The selftest's verdict line and a generated suppression name the switched module and
    the modes, never an argument the finding has not (`node -1 param +0 -> 0x0`)."""
    from graphsan.report import suppressions
    from graphsan.report.json_report import finding_to_dict
    from graphsan.selftest.runner import _one_line

    model, x = Net(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    model.eval()
    (f,) = replay(san, g)
    line = _one_line(finding_to_dict(f))
    assert line.startswith(f"mode: {f.graph.label} Net.drop: train at capture, eval now"), line
    assert "node -1" not in line and "0x0" not in line
    generated = suppressions.generate([f])
    assert f'name: "mode in {f.graph.label}: Net.drop"' in generated, generated
    assert "node -1" not in generated


def test_a_submodule_switched_on_its_own_is_caught(san):
    model, x = Net(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    model.drop.eval()
    (f,) = replay(san, g)
    assert (f.kind, f.baked.modules) == (Kind.MODE, ("Net.drop",))


def test_a_forward_that_reads_training_depends_on_the_mode(san):
    model, x = Branchy(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    model.eval()
    (f,) = replay(san, g)
    assert (f.kind, f.baked.modules) == (Kind.MODE, ("Branchy",))


def test_batch_norm_depends_on_the_mode_only_with_running_statistics(san):
    tracked, untracked = nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False)
    x = torch.randn(3, 4)
    g = san.test_capture(lambda: (tracked(x), untracked(x)))
    tracked.eval(), untracked.eval()
    (f,) = replay(san, g)
    assert f.baked.modules == ("BatchNorm1d",)


def test_many_switched_modules_are_named_a_few_and_counted(san):
    model, x = nn.Sequential(*[nn.Dropout(0.1) for _ in range(6)]), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    model.eval()
    (f,) = replay(san, g)
    assert len(f.baked.modules) == 4 and "6 module(s)" in f.now and "and 2 more" in f.now


def test_an_eager_validation_between_replays_is_quiet(san):
    model, x = Net(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    assert replay(san, g) == []
    assert san.findings == []


class Unhashable(Net):
    """A module that defines `__eq__` and so no hash (as an `eq=True` dataclass does)."""

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return self is other


def test_a_module_without_a_hash_is_watched_like_any_other(san):
    model, x = Unhashable(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x), reads=[model.lin.weight])
    model.eval()
    (f,) = replay(san, g)
    assert (f.kind, f.baked.modules) == (Kind.MODE, ("Unhashable.drop",))
    assert f.baked.changed_at, "where it switched"
    model.train()
    model.scale = torch.ones(4)  # a buffer of the unhashable module re-registered: not read
    assert replay(san, g) == [] and san.active


def test_a_model_without_mode_dependent_modules_is_quiet_in_eval(san):
    model, x = Net(p=0.0), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))
    model.eval()
    assert replay(san, g) == []


def test_a_graph_per_mode_each_replayed_in_its_own_is_quiet(san):
    model, x = Net(), torch.randn(2, 4)
    train_g = san.test_capture(lambda: model(x))
    model.eval()
    eval_g = san.test_capture(lambda: model(x))
    for _ in range(2):
        assert replay(san, eval_g) == []
        model.train()
        assert replay(san, train_g) == []
        model.eval()
    assert san.findings == []


def test_a_graph_per_mode_is_quiet_whichever_the_module_is_in(san):
    """The program picks the mode by the graph it replays (selftest's transformer-layer: its
    inference graph replayed after `train()`), so neither graph is stale while both live; once
    the training graph is gone, the inference graph replayed in train mode is."""
    model, x = Net(), torch.randn(2, 4)
    train_g = san.test_capture(lambda: model(x))
    model.eval()
    eval_g = san.test_capture(lambda: model(x))
    model.train()
    assert replay(san, eval_g) == []
    model.eval()
    assert replay(san, train_g) == []
    model.train()
    train_g.reset()
    (f,) = replay(san, eval_g)
    assert f.kind == "mode" and (f.baked.captured, f.baked.current) == ("eval", "train")


def test_capture_hooks_live_only_while_a_capture_runs(san):
    from torch.nn.modules import module
    from torch.optim import optimizer

    before = (len(module._global_forward_pre_hooks), len(optimizer._global_optimizer_pre_hooks))
    seen = []

    def run():
        seen.append(len(module._global_forward_pre_hooks))

    san.test_capture(run)
    assert seen == [before[0] + 1]
    after = (len(module._global_forward_pre_hooks), len(optimizer._global_optimizer_pre_hooks))
    assert after == before


# -- baked-value ----------------------------------------------------------------------------------
def stepped(opt_cls, lr, **kw):
    w = nn.Parameter(torch.randn(4))
    opt = opt_cls([w], lr=lr, **kw)

    def step():
        opt.zero_grad(set_to_none=False)
        (w * w).sum().backward()
        opt.step()

    w.grad = torch.zeros_like(w)
    return w, opt, step


def test_a_scheduler_changing_a_float_lr_is_a_baked_value(san):
    w, opt, step = stepped(torch.optim.Adam, 1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = san.test_capture(step)
    g.replay()
    sched.step()
    (f,) = replay(san, g)
    assert f.kind is Kind.BAKED_VALUE
    assert f.baked.entry == "Adam.param_groups[0]['lr']"
    assert (f.baked.captured, f.baked.current) == ("0.001", "0.0005")
    assert "pass it as a tensor" in f.kind.cause


def test_betas_taken_by_value_are_watched_too(san):
    w, opt, step = stepped(torch.optim.AdamW, 1e-3)
    g = san.test_capture(step)
    opt.param_groups[0]["betas"] = (0.8, 0.99)
    (f,) = replay(san, g)
    assert f.baked.entry == "AdamW.param_groups[0]['betas']"
    assert (f.baked.captured, f.baked.current) == ("(0.9, 0.999)", "(0.8, 0.99)")


def test_a_value_changed_and_set_back_before_the_replay_is_quiet(san):
    w, opt, step = stepped(torch.optim.SGD, 0.1, momentum=0.9)
    g = san.test_capture(step)
    opt.param_groups[0]["lr"] = 0.05
    opt.param_groups[0]["lr"] = 0.1
    assert replay(san, g) == []


def test_a_scheduler_over_a_tensor_lr_is_quiet(san):
    lr = torch.tensor(0.01)
    w, opt, step = stepped(torch.optim.Adam, lr)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    g = san.test_capture(step, reads=[w, lr])
    for _ in range(3):
        sched.step()
        assert replay(san, g) == []
    assert opt.param_groups[0]["lr"] is lr and san.findings == []


def test_keys_the_optimizer_does_not_define_are_not_baked(san):
    w, opt, step = stepped(torch.optim.SGD, 0.1)
    opt.param_groups[0]["lr_mult"] = 1.0  # a program's own key (Megatron has several)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)  # adds initial_lr
    g = san.test_capture(step)
    opt.param_groups[0]["lr_mult"] = 0.5
    opt.param_groups[0]["initial_lr"] = 0.3
    sched.step()  # the lambda keeps lr at 0.1
    assert replay(san, g) == []


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax"])
def test_every_optimizer_steps_through_the_recorded_entry(san, name):
    w, opt, step = stepped(getattr(torch.optim, name), 0.01)
    g = san.test_capture(step)
    opt.param_groups[0]["lr"] = 0.02
    (f,) = replay(san, g)
    assert f.baked.entry == f"{name}.param_groups[0]['lr']"


# -- superseded -----------------------------------------------------------------------------------
def test_a_parameter_re_pointed_while_the_old_lives_on(san):
    model, x = Net(p=0.0), torch.randn(2, 4)
    old = model.lin.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # holds the old weight
    g = san.test_capture(lambda: model(x), reads=[old, x])
    model.lin.weight = nn.Parameter(torch.randn(4, 4))
    line = this_line_minus(1)
    (f,) = replay(san, g)
    assert f.kind is Kind.SUPERSEDED
    assert f.baked.entry == "Net.lin.weight"
    assert f.block_address == old.data_ptr() and f"{old.data_ptr():#x}" in f.baked.captured
    assert f.baked.changed_at[-1][1] == line and f.free_stack == ()
    assert opt.param_groups[0]["params"][0] is old


def test_a_buffer_registered_again(san):
    model, x = Net(p=0.0), torch.randn(2, 4)
    old = model.scale
    g = san.test_capture(lambda: model(x), reads=[old])
    model.register_buffer("scale", torch.ones(4))
    (f,) = replay(san, g)
    assert (f.kind, f.baked.entry) == (Kind.SUPERSEDED, "Net.scale")


def test_a_tensor_lr_replaced_while_the_defaults_keep_the_old(san):
    lr = torch.tensor(0.01)
    w, opt, step = stepped(torch.optim.Adam, lr)
    g = san.test_capture(step, reads=[w, lr])
    opt.param_groups[0]["lr"] = torch.tensor(0.02)
    assert opt.defaults["lr"] is lr
    (f,) = replay(san, g)
    assert (f.kind, f.baked.entry) == (Kind.SUPERSEDED, "Adam.param_groups[0]['lr']")


def test_load_state_dict_copying_into_the_same_tensors_is_quiet(san):
    model, x = Net(p=0.0), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x), reads=[model.lin.weight, model.scale])
    model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    assert replay(san, g) == []


def test_an_entry_the_graph_does_not_read_is_not_watched(san):
    model, x = Net(p=0.0), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))  # the kernel reads none of the model's tensors
    keep = model.lin.weight
    model.lin.weight = nn.Parameter(torch.randn(4, 4))
    assert replay(san, g) == [] and keep is not None


# -- any sequence ---------------------------------------------------------------------------------
STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("mode"), st.sampled_from(["model", "drop", "lin"]), st.booleans()),
        st.tuples(st.just("lr"), st.sampled_from([0.1, 0.2]), st.none()),
        st.tuples(st.just("weight"), st.sampled_from(["new", "old"]), st.none()),
        st.tuples(st.just("replay"), st.none(), st.none()),
    ),
    max_size=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS)
def test_any_sequence_is_judged_against_what_the_graph_reads(monkeypatch, steps):
    """Mode switches, value changes and re-pointings in any order: a replay is stopped exactly
    when the model of what the graph baked says it differs now, naming the kinds that do."""
    with monkeypatch.context() as mp:
        env = fake_cuda.install(mp, "void k(float*)", stream=1)
        cls = fake_cuda.graph_class(mp, POOL, "wrapped")
        s = fake_cuda.started(env, "raise")
        s.context.start()
        s.recorder.start()
        try:
            model, x = Net(), torch.randn(2, 4)
            old = model.lin.weight
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            env["map"] = segments_at([old])
            env["nodes"] = [fake_cuda.kernel(0, old.data_ptr())]
            g = cls()
            g.capture_begin(POOL)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            g.capture_end()
            for what, arg, mode in steps:
                if what == "mode":
                    target = model if arg == "model" else getattr(model, arg)
                    target.train(mode)
                elif what == "lr":
                    opt.param_groups[0]["lr"] = arg
                elif what == "weight":
                    model.lin.weight = old if arg == "old" else nn.Parameter(torch.randn(4, 4))
                else:
                    expected = set()
                    if not model.drop.training:
                        expected.add(Kind.MODE)
                    if opt.param_groups[0]["lr"] != 0.1:
                        expected.add(Kind.BAKED_VALUE)
                    if model.lin.weight is not old:
                        expected.add(Kind.SUPERSEDED)
                    try:
                        g.replay()
                        got = set()
                    except StaleMemoryError as err:
                        got = {f.kind for f in err.findings}
                        assert got, "a stopped replay names what differs"
                    assert got == expected
        finally:
            s.hooks.uninstall()
            s.recorder.stop()
            s.context.stop()


def test_the_identity_map_forgets_a_collected_object_and_keeps_a_new_one_at_its_id():
    import gc

    from graphsan.cuda.baked import ByIdentity

    seen = ByIdentity()
    a = Unhashable()
    assert seen.setdefault(a, {1}) == {1} and seen.setdefault(a, {2}) == {1}
    del a
    gc.collect()
    assert not seen and seen.items() == []
    b = Unhashable()
    seen.setdefault(b, "b")
    assert seen.get(b) == "b" and seen.get(Unhashable(), "none") == "none"
    assert [v for _, v in seen.items()] == ["b"]
    seen.pop(b)
    assert not seen


def test_a_failure_ending_the_recording_disables_graphsan_not_the_capture(san, monkeypatch):
    def broken(gid):
        raise RuntimeError("recorder broke")

    monkeypatch.setattr(san.recorder, "end", broken)
    model, x = Net(), torch.randn(2, 4)
    g = san.test_capture(lambda: model(x))  # capture_end returns as without graphsan
    assert not san.active
    g.replay()

"""CPU: `pytest --graphsan` under pytest-xdist, and the plugin's options without `--graphsan`.

The inner suite runs in a pytest of its own (`-n 2`, a subprocess): each of its two tests makes
one finding in its worker's sanitizer through the faked CUDA side (tests/fake_cuda.py), under a
graph label naming the worker. The controller must count both and write both to the report.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from graphsan.core.records import OrderEvidence
from graphsan.report import GraphInfo, Report
from graphsan.report.ranks import combine
from tests.test_plugin_and_ranks import finding

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

# each test: a graph labelled with its worker's id ("main" without xdist) captured over the faked
# allocator view, its input freed in eval, the replay judged under the plugin's sanitizer
SUITE = """
import os

import graphsan
from graphsan.core.records import FreeEvent
from graphsan.cuda import hooks
from tests import fake_cuda


class FakeGraph:
    def pool(self):
        return (1, 3)


def stale_replay(monkeypatch):
    env = fake_cuda.install(monkeypatch, "void scale(float*)", stream=1)
    san = graphsan.current()
    monkeypatch.setattr(san, "active", True)  # start() needs CUDA; the listeners do not
    fake_cuda.answer_from(env, san.memory, monkeypatch)  # the plugin made its memory watch
    g = FakeGraph()
    san.push_label(os.environ.get("PYTEST_XDIST_WORKER", "main"))
    san.capture_begin(g, None)
    san.after_capture_end(g, san.before_capture_end(g))
    san.pop_label()
    event = FreeEvent([("train.py", 7, "evaluate")], "eval", 5)
    assert san.tracker.on_free(fake_cuda.SEG, lambda: event)
    env["map"] = fake_cuda.one_segment([(8192, "inactive")])
    san.before_replay(g, hooks.graph_state(g))


def test_one(monkeypatch):
    stale_replay(monkeypatch)


def test_two(monkeypatch):
    stale_replay(monkeypatch)
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    """The inner suite, with this checkout's `tests` package importable in its processes."""
    pytester.makepyfile(test_inner=SUITE)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    return pytester


@pytest.mark.slow
def test_xdist_workers_findings_reach_the_summary_and_the_report(suite, tmp_path):
    out = tmp_path / "run.json"
    result = suite.runpytest_subprocess(
        "-n", "2", "-p", "no:cacheprovider", "--graphsan=record", "--graphsan-report", str(out)
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            f"graphsan: report written to {out}",
            "graphsan: 2 xdist worker(s), 2 graph(s), 2 node(s) watched, 2 finding(s), "
            "policy record",
        ]
    )
    rep = Report.load(str(out))
    # two tests on two workers: xdist deals fewer tests than twice its workers round robin
    assert sorted(f.graph.label for f in rep.findings) == ["gw0", "gw1"]
    assert sorted(f.graph.id for f in rep.findings) == [1, 2]  # apart, though both were 1
    assert sorted((g["id"], g["label"]) for g in rep.graphs) == [(1, "gw0"), (2, "gw1")]
    assert not list(tmp_path.glob("run*.json.*"))  # no worker file left beside the report


SWALLOWED = """

def test_swallowed(monkeypatch):
    try:
        stale_replay(monkeypatch)
    except graphsan.StaleMemoryError:
        pass  # the test swallows the stop: under raise the plugin still fails it
"""


@pytest.mark.parametrize("policy", ["raise", "record"])
def test_a_test_that_swallows_a_stop_fails_under_raise_and_keeps_its_outcome_under_record(
    suite, policy
):
    suite.makepyfile(test_inner=SUITE + SWALLOWED)
    result = suite.runpytest(f"--graphsan={policy}", "-rA", "-p", "no:cacheprovider")
    if policy == "raise":
        result.assert_outcomes(failed=3)  # two stopped replays, and the swallowed one
        result.stdout.fnmatch_lines(["FAILED *test_swallowed - Failed: graphsan: 1 finding(s)*"])
    else:
        result.assert_outcomes(passed=3)
    assert result.stdout.str().count("Captured graphsan call") == 3
    result.stdout.fnmatch_lines(
        [f"graphsan: 3 graph(s), 3 node(s) watched, 3 finding(s), policy {policy}"]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "option, value",
    [
        ("--graphsan-report", "run.json"),
        ("--graphsan-suppressions", "known.yaml"),
        ("--graphsan-source-root", "."),
    ],
)
def test_an_option_of_the_plugin_without_graphsan_is_one_usage_error(pytester, option, value):
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest_subprocess(option, value, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if "graphsan" in line]
    assert errors == [
        f"ERROR: {option} needs --graphsan, which turns the sanitizer on; expected "
        "--graphsan[=POLICY] as well"
    ]
    assert not (pytester.path / "run.json").exists()


def test_a_source_root_that_is_not_a_folder_is_one_usage_error(pytester):
    pytester.makepyfile("def test_ok():\n    pass\n")
    result = pytester.runpytest("--graphsan=record", "--graphsan-source-root", "nowhere")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --graphsan-source-root nowhere: does not exist; expected the project's root*"]
    )


def test_a_deeply_nested_suppression_file_is_one_usage_error(pytester):
    pytester.makepyfile("def test_ok():\n    pass\n")
    (pytester.path / "deep.yaml").write_text("[" * 100_000 + "]" * 100_000)
    result = pytester.runpytest("--graphsan=record", "--graphsan-suppressions", "deep.yaml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --graphsan-suppressions deep.yaml: nested deeper than the YAML reader "
            "follows; expected a list of suppressions (- name: ...)"
        ]
    )


def test_combine_keeps_every_process_and_renumbers_graph_ids():
    a = Report([finding()], [{"id": 3, "nodes": 12}], events=[{"t": 2.0, "graph": 3}])
    second = GraphInfo(1, "other", [("train.py", 9, "capture")], (1, 0), 0)
    order = OrderEvidence(written_by=1, carved_by=2)
    b = Report(
        [dataclasses.replace(finding(kind="replay-order"), graph=second, order=order)],
        [{"id": 1, "nodes": 5}],
        events=[{"t": 1.0, "graph": 1}, {"t": 3.0, "kind": "phase"}],
        events_dropped=4,
        pinned={"blocks": 1, "bytes": 64, "by_site": {"x": {"blocks": 1, "bytes": 64}}},
        suppressed=[("known", finding())],
    )
    both = combine([a, b])
    assert [f.graph.id for f in both.findings] == [3, 4]
    assert both.findings[1].order == OrderEvidence(written_by=4, carved_by=5)
    assert both.findings[1].graph.label == "other"
    assert [g["id"] for g in both.graphs] == [3, 4]
    assert [e.get("graph") for e in both.events] == [4, 3, None]  # in time order
    assert both.events_dropped == 4 and both.pinned["by_site"]["x"]["bytes"] == 64
    assert [f.graph.id for _, f in both.suppressed] == [6]  # b's graph 3, past a's 3
    assert combine([a]).to_dict() == a.to_dict()
    json.dumps(both.to_dict())  # still a report that saves


def test_combine_watched_where_any_process_watched_and_says_why_one_did_not():
    idle = Report(watched=False, disabled_reason="CUDA is not available")
    watched = Report([finding()], [{"id": 1, "nodes": 2}], watched=True)
    assert combine([idle, idle]).idle and combine([idle]).disabled_reason == (
        "CUDA is not available"
    )
    both = combine([idle, watched])
    assert both.watched is True and both.disabled_reason == "CUDA is not available"
    assert combine([Report(), Report()]).watched is None, "reports that do not say"


def test_a_report_path_holding_something_else_is_refused_before_the_tests_run(pytester):
    pytester.makepyfile("def test_ok():\n    pass\n")
    (pytester.path / "notes.txt").write_text("a week of notes\n")
    result = pytester.runpytest("--graphsan=record", "--graphsan-report", "notes.txt")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --graphsan-report notes.txt: the file exists and is not*"])
    assert (pytester.path / "notes.txt").read_text() == "a week of notes\n"

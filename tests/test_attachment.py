"""CPU: a report says how graphsan attached (report schema v9, `graphsan.runtime.attachment`):
torch's hooks or the wrapper and which seams of torch, the allocator backend, and the tracker
the allocator's events came from. `graphsan report` prints it on its first lines (once for
merged reports that agree), the page under the report's graphs, `graphsan selftest` in its
header, and a selftest run that attached otherwise is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphsan.cli.main import main
from graphsan.report import Report
from graphsan.report.pages.report_page import render_report
from graphsan.runtime import attachment, sanitizer
from graphsan.selftest import runner
from tests import fake_cuda
from tests.test_report_watch import PROVENANCE, saved

HOOKS = ["capture-end hook", "per-graph replay hooks", "retain_object"]
ATTACHED = {"attach": "hooks", "hooks": HOOKS, "allocator": "native", "tracker": "compiled"}
HOOKS_LINE = (
    "attached through torch's hooks (capture-end hook, per-graph replay hooks, retain_object); "
    "allocator backend native; tracker compiled"
)


def attached_report(**fields) -> Report:
    return Report(watched=True, provenance=PROVENANCE | ATTACHED | fields)


@pytest.fixture
def started(monkeypatch, attach, fake_sanitizer):
    """A sanitizer attached to faked graphs as start() attaches it, on a native allocator."""
    env = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native", raising=False)
    san = fake_sanitizer(env, "record")
    san.watched = True
    return san


@pytest.mark.parametrize(
    ("log", "reason", "tracker"),
    [(object(), None, "compiled"), (None, "GRAPHSAN_TRACELOG=0", "snapshots")],
)
def test_the_report_records_the_attachment_backend_and_tracker(
    started, attach, tmp_path, log, reason, tracker
):
    started.memory.tracelog, started.memory.tracelog_reason = log, reason
    rep = started.report()
    if attach == "torch hooks":
        assert rep.provenance["attach"] == "hooks" and rep.provenance["hooks"] == HOOKS
    else:  # a torch without graph hooks: its methods are wrapped, and it has no retain_object
        assert rep.provenance["attach"] == "wrapper" and rep.provenance["hooks"] == []
    assert rep.provenance["allocator"] == "native" and rep.provenance["tracker"] == tracker
    path = saved(tmp_path, rep)
    data = json.loads(Path(path).read_text())
    assert data["version"] == 10 and data["provenance"]["tracker"] == tracker
    assert Report.load(path).provenance == rep.provenance


def test_a_backend_without_a_block_map_is_the_driver(monkeypatch):
    from graphsan.cuda import driverwatch

    monkeypatch.setattr(
        torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync", raising=False
    )
    san = sanitizer.Sanitizer("record")
    assert isinstance(san.memory, driverwatch.DriverWatch)
    san.watched = True
    got = san.attachment()
    assert got["allocator"] == "cudaMallocAsync" and got["tracker"] == "driver"


def test_an_idle_sanitizer_never_attached(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rep = sanitizer.Sanitizer("raise").start().report()
    assert rep.provenance["attach"] is None and rep.provenance["tracker"] is None
    assert rep.provenance["hooks"] is None and "allocator" in rep.provenance
    assert rep.header()[-1].startswith("attached: no (graphsan stayed idle); allocator backend")


# ----------------------------------------------------------------------------- graphsan report
def test_report_prints_how_graphsan_attached_on_its_first_lines(tmp_path, capsys):
    assert main(["report", saved(tmp_path, attached_report())]) == 0
    head = capsys.readouterr().out.splitlines()
    assert head[0].startswith("graphsan report: 0 graph(s)")
    assert head[1].startswith("recorded with graphsan 0.1.0") and head[2] == HOOKS_LINE


@pytest.mark.parametrize(
    ("fields", "log", "line"),
    [
        (
            {"attach": "wrapper", "hooks": [], "tracker": "snapshots"},
            "snapshot (GRAPHSAN_TRACELOG=0)",
            "attached by wrapping CUDAGraph's capture and replay; allocator backend native; "
            "tracker snapshots (GRAPHSAN_TRACELOG=0)",
        ),
        (
            {"attach": "wrapper", "hooks": ["retain_object"], "tracker": "compiled"},
            "tracker, GPU trace: PyTorch's (another interpreter)",
            "attached by wrapping CUDAGraph's capture and replay (with retain_object); allocator "
            "backend native; tracker compiled, GPU trace: PyTorch's (another interpreter)",
        ),
        (
            {"allocator": "cudaMallocAsync", "tracker": "driver"},
            "driver (the cudaMallocAsync allocator backend keeps no block map)",
            "attached through torch's hooks (capture-end hook, per-graph replay hooks, "
            "retain_object); allocator backend cudaMallocAsync; no tracker: the driver is asked "
            "before each replay (the cudaMallocAsync allocator backend keeps no block map)",
        ),
    ],
    ids=["wrapper, snapshots", "wrapper, PyTorch's trace", "driver"],
)
def test_a_fallback_says_why(tmp_path, capsys, fields, log, line):
    rep = attached_report(**fields)
    rep.allocator_log = log
    assert main(["report", saved(tmp_path, rep)]) == 0
    assert capsys.readouterr().out.splitlines()[2] == line


def test_a_report_from_before_v9_says_the_attachment_was_not_recorded(tmp_path):
    path = tmp_path / "v8.json"
    path.write_text(json.dumps(dict(Report(provenance=dict(PROVENANCE)).to_dict(), version=8)))
    rep = Report.load(str(path))
    assert rep.header()[-1] == "attached: not recorded (report schema v8 predates it)"


def test_an_attachment_the_schema_does_not_know_is_one_line(tmp_path, capsys):
    path = tmp_path / "r.json"
    data = attached_report().to_dict()
    data["provenance"]["attach"] = "sideways"
    path.write_text(json.dumps(data))
    assert main(["report", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert 'provenance.attach is \'sideways\'; expected "hooks", "wrapper" or null' in line


def test_merged_reports_say_the_attachment_once_when_alike_else_per_rank(tmp_path, capsys):
    same = [attached_report(), attached_report()]
    for i, rep in enumerate(same):
        rep.rank = i
    paths = [saved(tmp_path, rep, f"r{i}.json") for i, rep in enumerate(same)]
    assert main(["report", *paths]) == 0
    assert capsys.readouterr().out.splitlines().count(HOOKS_LINE) == 1
    same[1].provenance["tracker"] = "snapshots"
    paths = [saved(tmp_path, rep, f"s{i}.json") for i, rep in enumerate(same)]
    assert main(["report", *paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"rank 0: {HOOKS_LINE}" in out
    assert any(x.startswith("rank 1: attached through") and "snapshots" in x for x in out)


def test_the_page_says_how_graphsan_attached():
    html = render_report([attached_report()], ["r.json"])
    assert HOOKS_LINE.replace("'", "&#39;") in html


# ----------------------------------------------------------------------------- graphsan selftest
def test_selftest_says_how_graphsan_attaches_in_its_header(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(attachment, "here", lambda: (dict(ATTACHED), "tracker"))
    other = dict(ATTACHED, tracker="snapshots")
    done = [
        runner.Verdict("a", runner.CORRECT, runner.OK, result={"attachment": dict(ATTACHED)}),
        runner.Verdict("b", runner.BUG, runner.CAUGHT, result={"attachment": other}),
    ]
    monkeypatch.setattr(runner, "run_corpus", lambda *a: done)
    assert runner.run_and_report([("a", "correct"), ("b", "bug")], 1, 10.0, None, None) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[1] == f"graphsan selftest: {HOOKS_LINE}"
    assert "  1 run(s) attached otherwise, b first: attached through" in captured.out


def test_what_a_sanitizer_here_would_attach_with(monkeypatch):
    from graphsan.cuda import tracelog
    from graphsan.cuda.hooks import Seams

    monkeypatch.setattr(Seams, "detect", classmethod(lambda cls: cls(retain_object=True)))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native", raising=False)
    monkeypatch.setattr(tracelog, "open_log", lambda: (None, "GRAPHSAN_TRACELOG=0"))
    fields, log = attachment.here()
    assert fields == {
        "attach": "wrapper",
        "hooks": ["retain_object"],
        "allocator": "native",
        "tracker": "snapshots",
    }
    assert log == "snapshot (GRAPHSAN_TRACELOG=0)"

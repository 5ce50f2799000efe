"""The report pages from a real run (H200): `graphsan run --report` on a graph whose input is
freed in an eval phase and released by empty_cache, then `graphsan report --html --trace`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from graphsan.report.json_report import SCHEMA_VERSION
from tests.gpu_programs import ROOT

pytestmark = pytest.mark.gpu

PROGRAM = """
import torch
import graphsan
s = torch.cuda.Stream()
x = torch.randn(1 << 20, device="cuda")
g = torch.cuda.CUDAGraph()
with graphsan.label("scale"), torch.cuda.graph(g, stream=s):
    y = x * 2
g.replay()
with graphsan.phase("eval", step=7):
    del x
    torch.cuda.empty_cache()
g.replay()
"""


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "graphsan.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def test_a_real_run_has_the_times_the_pages_draw(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    report, html, trace = tmp_path / "out.json", tmp_path / "out.html", tmp_path / "trace.json"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    run = _cli("run", "--report", str(report), str(script), env=env)
    assert "UNMAPPED" in run.stderr, run.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["version"] == SCHEMA_VERSION
    (graph,) = data["graphs"]
    (f,) = data["findings"]
    assert graph["captured_at"] <= f["freed_at"] <= f["found_at"]
    assert graph["node_summary"]["nodes"] and f["phase"] == "eval" and f["step"] == 7
    kinds = [e["kind"] for e in data["events"]]
    for kind in ("capture", "phase", "free", "release", "replay"):
        assert kind in kinds, kinds
    stopped = [e for e in data["events"] if e["kind"] == "replay"]
    assert stopped[-1]["outcome"] == "stopped" and stopped[-1]["t"] == f["found_at"]
    capture = next(e for e in data["events"] if e["kind"] == "capture")
    assert capture["label"] == "scale" and capture["begin"] <= capture["t"] and capture["stream"]
    shown = _cli("report", "--html", str(html), "--trace", str(trace), str(report), env=env)
    assert shown.returncode == 0, shown.stderr
    page = html.read_text()
    assert "prog.py:11 in &lt;module&gt;" in page or "prog.py:11 in <module>" in page, page[-2000:]
    assert "elementwise" in page
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e.get("cat") for e in events} >= {"capture", "free", "release", "replay", "finding"}

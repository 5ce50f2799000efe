"""The pin policy on real graphs: the bugs that raise under "raise" run to completion, with
correct results, under "pin"; and multi-rank runs under torchrun (H200)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.gpu_programs import ROOT, prefetch, run_program

pytestmark = pytest.mark.gpu

PIN_PROGRAMS = ["freed_empty_cache", "pin_resize", "pin_eval_cache"]


@pytest.fixture(scope="module", autouse=True)
def _all_programs_side_by_side():
    prefetch([(n, p, None) for n in PIN_PROGRAMS for p in ("raise", "pin")])


@pytest.mark.parametrize("name", PIN_PROGRAMS)
def test_raise_stops_the_replay(name):
    rc, result, log = run_program(name, policy="raise")
    assert rc == 0, log[-3000:]
    assert result["replay"] == "raised", log[-3000:]
    assert result["healthy"]


@pytest.mark.parametrize("name", PIN_PROGRAMS)
def test_pin_runs_to_completion_with_correct_results(name):
    rc, result, log = run_program(name, policy="pin")
    assert rc == 0, log[-3000:]
    assert result["replay"] == "replayed", result.get("error_text", log[-3000:])
    assert result["correct"], "the graph must compute on the memory it was captured with"
    assert result["findings"] == []
    assert result["healthy"]
    if name == "pin_resize":
        assert result["user_view_ok"], "the user's tensor still sees a resize_ with its data"


def test_pin_reports_what_it_pinned_and_retained():
    rc, result, log = run_program("freed_empty_cache", policy="pin")
    assert rc == 0, log[-3000:]
    pinned = result["pinned"]
    assert pinned["blocks"] >= 1 and pinned["bytes"] >= 4 << 20
    assert pinned["retained_bytes"] >= 4 << 20  # x was deleted: only the pin keeps it
    # x was made just before the capture: the capture-end scan of young objects pinned it
    assert pinned["young_scans"] >= 1 and pinned["tensors_scanned"] > 0


def test_torchrun_reports_per_rank_and_merges(tmp_path):
    """Two ranks, each on GPU LOCAL_RANK (both on GPU 0 where there is one); rank 1 frees."""
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun not on PATH")
    script = tmp_path / "prog.py"
    script.write_text(
        "import os, torch\n"
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK']) % torch.cuda.device_count())\n"
        "s = torch.cuda.Stream()\n"
        "x = torch.randn(1 << 20, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g, stream=s):\n"
        "    y = x * 2\n"
        "if os.environ['RANK'] == '1':\n"
        "    del x\n"
        "g.replay()\n"
        "torch.cuda.synchronize()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    report = tmp_path / "out.json"
    cmd = [
        "torchrun",
        "--nproc-per-node",
        "2",
        "--master-port",
        "29533",
        "-m",
        "graphsan.cli",
        "run",
        "--policy",
        "record",
        "--report",
        str(report),
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r0, r1 = tmp_path / "out.rank0.json", tmp_path / "out.rank1.json"
    assert json.loads(r0.read_text())["findings"] == []
    (finding,) = json.loads(r1.read_text())["findings"]
    assert finding["kind"] == "freed"
    assert finding["graph"]["device"] == 1 % torch.cuda.device_count()
    merged = subprocess.run(
        [sys.executable, "-m", "graphsan.cli", "report", str(r0), str(r1)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert merged.returncode == 0
    assert "seen on rank 1" in merged.stdout and "no findings on rank 0" in merged.stdout
    assert "[rank 1] FREED" in merged.stdout

"""The incremental allocator view equals real allocator snapshots (H200), with and without
expandable segments; the program runs in a subprocess (tests/gpu/view_vs_snapshot.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("chunk", [None, 3], ids=["chunks", "small-chunks"])
@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_view_follows_the_real_allocator(seed, expandable, chunk):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    argv = [str(seed)] + ([str(chunk)] if chunk else [])
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", "view_vs_snapshot.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    assert res["disabled"] is None, res
    assert res["checks"] == 40 and res["mismatches"] == 0, res
    assert res["events"] > 100, res  # the view followed the log, it was not reseeded each time
    assert res["seeds"] == 1, res

"""The driver walk's parameter reads on a real capture (H200); the program runs in a subprocess
(tests/gpu/walk_params.py), since a wrong read of the driver's memory would kill the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_read_of_a_parameter_block_equals_reading_each_parameter():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "gpu", "walk_params.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    res = json.loads(lines[-1][len("RESULT ") :])
    print(res)  # the one-read share and the walk's cost per node, for PERF notes
    assert res["with_params"] >= 30, res  # elementwise and copy kernels take kernelParams
    assert res["mismatches"] == 0, res
    assert res["walk_kernels"] == res["kernels"] and res["walk_unreadable"] == 0, res

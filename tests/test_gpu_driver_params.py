"""The driver walk's parameter reads on a real capture (H200); the program runs in a subprocess
(tests/gpu/walk_params.py), since a wrong read of the driver's memory would kill the process."""

from __future__ import annotations

import pytest

from tests.gpu_programs import run_script

pytestmark = pytest.mark.gpu


def test_one_read_of_a_parameter_block_equals_reading_each_parameter():
    res = run_script("walk_params.py")
    print(res)  # the one-read share and the walk's cost per node, for PERF notes
    assert res["with_params"] >= 30, res  # elementwise and copy kernels take kernelParams
    assert res["mismatches"] == 0, res
    assert res["walk_kernels"] == res["kernels"] and res["walk_unreadable"] == 0, res

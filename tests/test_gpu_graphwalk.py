"""graphsan's compiled walk against the walk through cuda-bindings on a real capture (H200); the
program runs in a subprocess (tests/gpu/graphwalk_vs_driver.py), since a wrong read of the
driver's memory would kill the process."""

from __future__ import annotations

import pytest

from tests.gpu_programs import run_script

pytestmark = pytest.mark.gpu


def test_the_compiled_walk_reads_a_capture_as_cuda_bindings_does():
    res = run_script("graphwalk_vs_driver.py")
    print(res)  # both walks' cost per node, for PERF notes
    assert res["compiled"], res["why"]
    assert res["equal"] and res["stats_equal"], res
    assert res["kinds"] == ["kernel", "memcpy", "memset"] and res["triton"], res
    assert res["host_copies"] >= 2, res
    assert res["stats"]["unreadable"] == 0, res

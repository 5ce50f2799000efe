"""Every lab Triton kernel compiles for sm_90 with the flags its launcher passes on a GPU, on
the installed Triton, without a GPU (tests/lab/compile_kernels.py, in its own process: the
kernels must be compiled, not interpreted). The interpreter tests check what the kernels
compute; this checks that the GPU can be given them at all."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.lab.compile_kernels import run_compiled

# A folder holding another Triton (`pip install --target`) to compile the kernels with too:
# .ci/run puts there the oldest Triton fastlaunch is checked on, the GPU machine's, since a
# kernel can compile on the newest Triton and not on that one.
ALSO = "GRAPHSAN_ALSO_TRITON"


@pytest.mark.slow
@pytest.mark.parametrize("which", ["installed", ALSO])
def test_every_kernel_compiles_for_sm90_as_its_launcher_launches_it(which):
    triton = pytest.importorskip("triton")
    home, version = "", triton.__version__
    if which == ALSO:
        home = os.environ.get(ALSO, "")
        if not home:
            pytest.skip(f"{ALSO} is not set: compiled on the installed Triton only")
        found = sorted(Path(home).glob("triton-*.dist-info"))
        assert found, f"{ALSO}={home}: expected a folder holding a Triton (pip install --target)"
        version = found[0].name.removesuffix(".dist-info").split("-", 1)[1]
    proc = run_compiled("tests.lab.compile_kernels", triton_home=home)
    rc, lines, stderr = proc.returncode, proc.stdout.splitlines(), proc.stderr
    verdict = [line for line in lines if line.startswith("kernels compile:")]
    assert rc == 0 and verdict and f" ok on Triton {version} " in verdict[-1], (
        (verdict[-1] if verdict else "no verdict") + "\n" + stderr[-3000:]
    )
    compiled = dict(line.split(": ", 1) for line in lines if line.endswith(" specializations"))
    for kernel in ("nvfp4_col_fused_kernel", "mxfp8_words_kernel", "qgemm_kernel"):
        assert kernel in compiled, compiled

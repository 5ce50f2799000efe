"""The Triton quantize kernels under Triton's interpreter (TRITON_INTERPRET=1) on CPU, byte for
byte against the torch reference: the kernels' logic is checked on every machine with Triton,
GPU or not. The compiled kernels (and the hardware FP8 conversion, which the interpreter only
emulates) are checked on the GPU by test_quant_triton_gpu.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from graphsan.lab.quant import mxfp8, nvfp4

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="this machine has CUDA: the compiled kernels are tested (test_quant_triton_gpu)",
    ),
    # the kernels divide by zero on purpose (an all-zero block) and clamp the inf; numpy says so
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def tk():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py)")
    pytest.importorskip("triton")
    from graphsan.lab.quant import triton_kernels

    assert triton_kernels.available(), "triton imports but the kernels do not"
    return triton_kernels


def inputs(shape, seed):
    """Random bf16 with wide row/col ranges, plus NaN, -inf, -0.0, a subnormal and a zero tile."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g)
    x *= torch.exp(torch.randn(m, 1, generator=g) * 4)
    x *= torch.exp(torch.randn(1, k, generator=g) * 2)
    x = x.to(torch.bfloat16)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (4,), generator=g)
    flat[idx[0]], flat[idx[1]], flat[idx[2]], flat[idx[3]] = math.nan, -math.inf, -0.0, 1e-40
    x[:16, :16] = 0
    return x


@pytest.mark.parametrize("shape", [(32, 32), (64, 160), (96, 64)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_kernel_matches_reference(tk, shape, fmt):
    for seed in range(2):
        x = inputs(shape, seed)
        row, col = tk.mxfp8_quantize_both(x, fmt)
        for q, axis in ((row, -1), (col, 0)):
            ref = mxfp8.quantize_reference(x, axis, fmt)
            assert torch.equal(q.scale, ref.scale), (axis, seed)
            assert torch.equal(q.data, ref.data), (axis, seed)


@pytest.mark.parametrize("shape", [(32, 128), (48, 64)])
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_kernel_matches_reference(tk, shape, order):
    x = inputs(shape, 3)
    for axis, block_2d, use_rht in [(-1, False, False), (0, False, False), (-1, True, False),
                                    (0, True, False), (0, False, True)]:  # fmt: skip
        for sr in (False, True):
            g1 = torch.Generator().manual_seed(5) if sr else None
            g2 = torch.Generator().manual_seed(5) if sr else None
            a = tk.nvfp4_quantize(x, axis, block_2d, order, use_rht, g1)
            b = nvfp4.quantize_reference(x, axis, block_2d, order, use_rht, g2)
            where = (axis, block_2d, use_rht, sr)
            assert torch.equal(a.amax, b.amax), where
            assert torch.equal(a.scale, b.scale), where
            assert torch.equal(a.data, b.data), where

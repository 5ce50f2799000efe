"""What the quantize-kernel tests check, shared by the compiled kernels on the GPU
(test_quant_triton_gpu.py) and Triton's interpreter on CPU (test_quant_triton_interpret.py)."""

from __future__ import annotations

import math

import torch

from graphsan.lab.quant import mxfp8, nvfp4

# (axis, block_2d, rht) of every NVFP4 operand kind: rowwise and columnwise, 1D and 2D blocks,
# and the Hadamard-transformed columnwise wgrad operand
NVFP4_KINDS = [(-1, False, False), (0, False, False), (-1, True, False), (0, True, False)]
NVFP4_KINDS += [(0, False, True)]


def edge_inputs(shape, seed, device):
    """Random bf16 with wide row/col ranges, plus NaN, -inf, -0.0, a subnormal and a zero tile."""
    g = torch.Generator(device=device).manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, device=device, generator=g)
    x *= torch.exp(torch.randn(m, 1, device=device, generator=g) * 4)
    x *= torch.exp(torch.randn(1, k, device=device, generator=g) * 2)
    x = x.to(torch.bfloat16)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (4,), device=device, generator=g)
    flat[idx[0]] = math.nan
    flat[idx[1]] = -math.inf
    flat[idx[2]] = -0.0
    flat[idx[3]] = 1e-40
    x[:32, :32] = 0
    return x


def mxfp8_inputs(shape, seed, device):
    """edge_inputs, in float32 for seeds >= 2: no bf16 rounding ahead of the FP8 conversion."""
    x = edge_inputs(shape, seed, device)
    if seed >= 2:
        g = torch.Generator(device=device).manual_seed(seed)
        noise = torch.rand(x.shape, device=device, generator=g)
        x = x.float() * (1 + noise * 2**-10)
    return x


def assert_mxfp8_matches(tk, x, fmt):
    """Both directions from one pass, and each alone, equal the reference byte for byte."""
    row, col = tk.mxfp8_quantize_both(x, fmt)
    for q, axis in ((row, -1), (col, 0)):
        ref = mxfp8.quantize_reference(x, axis, fmt)
        assert torch.equal(q.scale, ref.scale), axis
        assert torch.equal(q.data, ref.data), axis
        single = tk.mxfp8_quantize(x, axis, fmt)
        assert torch.equal(single.data, ref.data) and torch.equal(single.scale, ref.scale), axis
    return row, col


def assert_nvfp4_matches(tk, x, order, seed):
    """Every operand kind, with and without stochastic rounding (same seed, same bits)."""
    for axis, block_2d, use_rht in NVFP4_KINDS:
        if use_rht and x.shape[0] % 16:
            continue
        for sr in (False, True):
            g1 = torch.Generator(device=x.device).manual_seed(seed) if sr else None
            g2 = torch.Generator(device=x.device).manual_seed(seed) if sr else None
            a = tk.nvfp4_quantize(x, axis, block_2d, order, use_rht, g1)
            b = nvfp4.quantize_reference(x, axis, block_2d, order, use_rht, g2)
            where = (axis, block_2d, use_rht, sr)
            assert torch.equal(a.amax, b.amax), where
            assert torch.equal(a.scale, b.scale), where
            assert torch.equal(a.data, b.data), where

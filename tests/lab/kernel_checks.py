"""What the quantize-kernel tests check, shared by the compiled kernels on the GPU
(test_quant_triton_gpu.py) and Triton's interpreter on CPU (test_quant_triton_interpret.py).

`tk` is the launch module (`graphsan.lab.quant.kernels.launch`); `strided=True` runs the strided
kernels even where the launcher would pick the bf16-word kernels, so both families are checked
on the same inputs."""

from __future__ import annotations

import math

import pytest
import torch

from graphsan.lab.quant import mxfp8, nvfp4

# Each kernel test runs twice: the kernels the launcher picks (bf16 words where the input allows)
# and the strided kernels on the same input.
STRIDED = pytest.mark.parametrize("strided", [False, True], ids=["picked", "strided"])

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


def nvfp4_edge_cases(device):
    """64x64 float32 inputs with named edges: every E2M1 tie (global amax 2688 and block max 6
    make the encode factor exactly 1, so the elements are the values the encoder sees), zeros,
    inf, tiny, scale underflow, subnormal scales."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat((ties, ties - 1e-3, ties + 1e-3, torch.linspace(0, 6, 32)))
    values = torch.cat((near, -near))
    values = torch.cat((values, torch.linspace(-12, 12, 4096 - values.numel())))
    tie = values[torch.randperm(4096)].reshape(64, 64)
    tie.view(64, 4, 16)[:, :, 0] = 6.0  # every block's max is 6
    tie[5, 17] = 2688.0
    cases = {
        "ties": tie,
        "zeros": torch.zeros(64, 64),
        "inf": torch.randn(64, 64).index_put_(
            (torch.tensor([3]), torch.tensor([7])), torch.tensor(math.inf)
        ),
        "tiny": torch.randn(64, 64) * 1e-40,
        "underflow": torch.randn(64, 64) * 1e-3,
        "subnormal-scales": torch.randn(64, 64)
        * 2.0 ** -torch.randint(12, 22, (64, 4, 1)).float().repeat(1, 1, 16).reshape(64, 64),
    }
    cases["underflow"][0, 0] = 1e4
    cases["subnormal-scales"][0, 0] = 1.0
    return {name: x.to(device) for name, x in cases.items()}


def assert_nvfp4_edges_match(tk, order, strided, device):
    """`nvfp4_edge_cases` in both directions, 1D and 2D blocks, byte for byte."""
    for name, x in nvfp4_edge_cases(device).items():
        for axis in (-1, 0):
            for block_2d in (False, True):
                a = tk.nvfp4_quantize(x, axis, block_2d, order, _strided=strided)
                b = nvfp4.quantize_reference(x, axis, block_2d, order)
                where = (name, strided, axis, block_2d)
                assert torch.equal(a.amax, b.amax), where
                assert torch.equal(a.scale, b.scale), where
                assert torch.equal(a.data, b.data), where


def mxfp8_inputs(shape, seed, device):
    """edge_inputs, in float32 for seeds >= 2: no bf16 rounding ahead of the FP8 conversion."""
    x = edge_inputs(shape, seed, device)
    if seed >= 2:
        g = torch.Generator(device=device).manual_seed(seed)
        noise = torch.rand(x.shape, device=device, generator=g)
        x = x.float() * (1 + noise * 2**-10)
    return x


def assert_mxfp8_matches(tk, x, fmt, strided=False):
    """Both directions from one pass, and each alone, equal the reference byte for byte."""
    row, col = tk.mxfp8_quantize_both(x, fmt, _strided=strided)
    for q, axis in ((row, -1), (col, 0)):
        ref = mxfp8.quantize_reference(x, axis, fmt)
        assert torch.equal(q.scale, ref.scale), (strided, axis)
        assert torch.equal(q.data, ref.data), (strided, axis)
        single = tk.mxfp8_quantize(x, axis, fmt, _strided=strided)
        assert torch.equal(single.data, ref.data), (strided, axis)
        assert torch.equal(single.scale, ref.scale), (strided, axis)
    return row, col


def assert_nvfp4_matches(tk, x, order, seed, strided=False):
    """Every operand kind, with and without stochastic rounding (same seed, same bits), and the
    global amax kernel alone."""
    assert torch.equal(tk.global_amax(x), nvfp4.global_amax(x.float()))
    for axis, block_2d, use_rht in NVFP4_KINDS:
        if use_rht and x.shape[0] % 16:
            continue
        for sr in (False, True):
            g1 = torch.Generator(device=x.device).manual_seed(seed) if sr else None
            g2 = torch.Generator(device=x.device).manual_seed(seed) if sr else None
            a = tk.nvfp4_quantize(x, axis, block_2d, order, use_rht, g1, _strided=strided)
            b = nvfp4.quantize_reference(x, axis, block_2d, order, use_rht, g2)
            where = (strided, axis, block_2d, use_rht, sr)
            assert torch.equal(a.amax, b.amax), where
            assert torch.equal(a.scale, b.scale), where
            assert torch.equal(a.data, b.data), where

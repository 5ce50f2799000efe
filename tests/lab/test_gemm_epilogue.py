"""The emulated GEMM's epilogue kernel (`kernels.launch_gemm.gemm_epilogue`) against the torch
operations it replaces, bit for bit: QuantLinear's alpha and rounding to bf16, its addition into
main_grad, the grouped experts' per-row alpha with padding rows, and the grouped weight gradient
with an empty expert. On CPU in Triton's interpreter, on the GPU compiled (marked gpu)."""

from __future__ import annotations

import os

import pytest
import torch

from graphsan.lab.quant.formats import NVFP4_ALPHA_DIVISOR
from graphsan.lab.quant.grouped import _groups_out, _nonempty, _rows_out
from graphsan.lab.quant.recipe import RowGroups
from tests.lab.kernel_checks import launchers

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module")
def tk():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py)")
    pytest.importorskip("triton")
    return launchers()


def values(shape, g, device, dtype=torch.float32):
    """Random values over many binades, with NaN, infinities and signed zeros mixed in."""
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 6)
    flat = x.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return x[torch.randperm(x.shape[0], generator=g)].to(device, dtype)


def factors(n, g, device):
    amax = torch.rand(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3) + 1e-3
    return amax.to(device).reshape(() if n == 1 else (n,))


def same_bits(a, b):
    """Equal, NaN where the other is NaN (the NaN payload of a rounding is not specified)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def alpha(a, b, mode):
    if mode == 2:
        return (a * b) / torch.full((), NVFP4_ALPHA_DIVISOR, device=a.device)
    return a * b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [1, 2])
def test_alpha_then_bf16_and_the_main_grad_addition(tk, device, mode):
    g = torch.Generator().manual_seed(mode)
    for shape in ((37, 70), (64, 1024), (3, 5)):
        c = values(shape, g, device)
        a, b = factors(1, g, device), factors(1, g, device)
        want = (c * alpha(a, b, mode)).to(torch.bfloat16)
        assert same_bits(tk.gemm.gemm_epilogue(c, a, b, mode), want), shape
        grad = values(shape, g, device)
        want = grad + c * alpha(a, b, mode)
        got = tk.gemm.gemm_epilogue(c, a, b, mode, out=grad.clone())
        assert same_bits(got, want), shape


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_rows_take_their_alpha_and_padding_is_zero(tk, device):
    g = torch.Generator().manual_seed(3)
    groups = 5
    sizes = [16, 0, 32, 48, 16]
    index = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)] + [torch.full((8,), 5)])
    rows = RowGroups(index.to(device), groups)
    c = values((index.numel(), 96), g, device, torch.bfloat16)
    a, b = factors(groups, g, device), factors(groups, g, device)
    for mode in (0, 1, 2):
        ab = None if mode == 0 else alpha(a, b, mode)
        want = _rows_out(c, ab, rows).to(torch.bfloat16)
        got = tk.gemm.gemm_epilogue(c, a, b, mode, row_groups=rows)
        assert same_bits(got, want), mode
        assert got[-8:].eq(0).all()  # the padding rows, whatever the GEMM left there


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_weight_gradient_adds_nothing_for_an_empty_group(tk, device):
    g = torch.Generator().manual_seed(4)
    offsets = torch.tensor([16, 16, 48, 64], dtype=torch.int32, device=device)
    dw = values((4, 24, 40), g, device, torch.bfloat16)
    a, b = factors(4, g, device), factors(4, g, device)
    main = values((4, 24, 40), g, device)
    want = main + _groups_out(dw, alpha(a, b, 2), _nonempty(offsets))
    got = tk.gemm.gemm_epilogue(dw, a, b, 2, out=main.clone(), offsets=offsets)
    assert same_bits(got, want)
    assert same_bits(got[1], main[1])  # group 1 has no rows

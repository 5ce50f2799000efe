"""MXFP8 quantize/dequantize: the test vectors of docs/numerics.md, byte for byte, on CPU."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.lab.quant import mxfp8
from tests.lab.quant_oracles import (
    e8m0_te_oracle,
    fp8_grid,
    fp8_rne_oracle,
    mxfp8_numpy_reference,
)

MAX = {"e4m3": 448.0, "e5m2": 57344.0}
MAX_BYTE = {"e4m3": 0x7E, "e5m2": 0x7B}
FMTS = ("e4m3", "e5m2")
AXES = (-1, 0)


def _place(block: torch.Tensor, axis: int, shape=(64, 96)) -> torch.Tensor:
    """A random bf16 tensor whose first block (along `axis`) is `block` (32 values)."""
    x = torch.randn(shape, dtype=torch.float32) * 0.01
    if axis == -1:
        x[0, :32] = block
    else:
        x[:32, 0] = block
    return x.to(torch.bfloat16)


def _first(q: mxfp8.MXFP8Tensor):
    """(scale byte, data bytes) of the first block."""
    if q.axis == -1:
        return int(q.scale[0, 0]), q.data[0, :32]
    return int(q.scale[0, 0]), q.data[:32, 0]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("axis", AXES)
def test_zero_and_negative_zero_blocks(fmt, axis):
    x = _place(torch.zeros(32), axis)
    scale, data = _first(mxfp8.quantize(x, axis, fmt))
    assert scale == 0 and data.eq(0).all()
    x = _place(torch.full((32,), -0.0), axis)
    scale, data = _first(mxfp8.quantize(x, axis, fmt))
    assert scale == 0 and data.eq(0x80).all()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("k", [-20, 0, 5])
def test_power_of_two_amax(fmt, axis, k):
    amax = MAX[fmt] * 2.0**k
    block = torch.rand(32) * amax * 0.9
    block[7] = -amax
    scale, data = _first(mxfp8.quantize(_place(block, axis), axis, fmt))
    assert scale == 127 + k
    assert int(data[7]) == MAX_BYTE[fmt] | 0x80
    # The next bf16 above amax needs the next power of two.
    above = torch.tensor(amax, dtype=torch.bfloat16)
    above = torch.nextafter(above.float(), torch.tensor(math.inf)).bfloat16()  # rounds up in bf16
    above = (above.view(torch.int16) + (0 if above.float() > amax else 1)).view(torch.bfloat16)
    assert above.float() > amax
    block[7] = above.float()
    scale, _ = _first(mxfp8.quantize(_place(block, axis), axis, fmt))
    assert scale == 128 + k


@pytest.mark.parametrize("axis", AXES)
def test_amax_500_rounds_the_scale_up(axis):
    """The round-up rule scales 500 by 2^-1 (a floor rule would pick 2^0 and saturate it)."""
    block = torch.linspace(-3, 3, 32)
    block[3] = 500.0
    x = _place(block, axis)
    scale, data = _first(mxfp8.quantize(x, axis, "e4m3"))
    assert scale == 128
    assert data[3].view(torch.float8_e4m3fn).float().item() == 256.0  # 500 / 2 = 250 -> 256


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("axis", AXES)
def test_tiny_amax_scales(fmt, axis):
    # bf16-subnormal amax: scale 0x00, the elements are scaled by 2^127 and keep non-zero codes.
    block = torch.full((32,), 1e-40)
    scale, data = _first(mxfp8.quantize(_place(block, axis), axis, fmt))
    assert scale == 0 and (data != 0).all()
    # amax == max * 2^-127 exactly: still 0x00; the next bf16 above: 0x01.
    edge = MAX[fmt] * 2.0**-127
    block = torch.full((32,), edge / 4)
    block[0] = edge
    x = _place(block, axis)
    assert x.float()[0, 0].item() == edge  # exact in bf16
    scale, data = _first(mxfp8.quantize(x, axis, fmt))
    assert scale == 0 and int(data[0]) == MAX_BYTE[fmt]
    x = _place(block, axis)
    nxt = (torch.tensor(edge, dtype=torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16)
    x[0, 0] = nxt  # element 0 of the first block in both directions
    scale, _ = _first(mxfp8.quantize(x, axis, fmt))
    assert scale == 1


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("axis", AXES)
def test_inf_and_nan(fmt, axis):
    block = torch.randn(32)
    block[5] = -math.inf
    x = _place(block, axis)
    scale, data = _first(mxfp8.quantize(x, axis, fmt))
    assert scale == 0xFE
    assert int(data[5]) == MAX_BYTE[fmt] | 0x80
    others = torch.cat((block[:5], block[6:])).bfloat16().float() * 2.0**-127
    expected = torch.tensor([fp8_rne_oracle(v, fmt) for v in others.tolist()], dtype=torch.uint8)
    assert torch.equal(torch.cat((data[:5], data[6:])), expected)

    block = torch.randn(32)
    block[9] = math.nan
    x = _place(block, axis)
    scale, data = _first(mxfp8.quantize(x, axis, fmt))
    finite_amax = torch.cat((block[:9], block[10:])).bfloat16().float().abs().max().item()
    assert scale == e8m0_te_oracle(finite_amax, fmt)
    assert math.isnan(data[9:10].view(mxfp8_dtype(fmt)).float().item())
    assert not torch.isnan(torch.cat((data[:9], data[10:])).view(mxfp8_dtype(fmt)).float()).any()


def mxfp8_dtype(fmt):
    return {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("axis", AXES)
def test_rne_ties_including_subnormals(fmt, axis):
    """Every midpoint between adjacent grid values (with scale 2^0) rounds to the even code."""
    codes, vals = fp8_grid(fmt)
    mids = (vals[:-1] + vals[1:]) / 2
    mids = np.concatenate([mids, vals[:-1] + (vals[1:] - vals[:-1]) * 0.25])  # and non-ties
    mids = mids[np.abs(mids) < MAX[fmt]]
    mids = mids[torch.tensor(mids).bfloat16().double().numpy() == mids]  # exact in bf16
    n = len(mids)
    blocks = -(-n // 31)
    vals_t = torch.zeros(blocks * 31, dtype=torch.float64)
    vals_t[:n] = torch.tensor(mids)
    vals_t = vals_t.reshape(blocks, 31)
    signs = torch.where(torch.rand(blocks, 31) < 0.5, -1.0, 1.0).double()
    vals_t = vals_t * signs
    rows = torch.cat(
        (torch.full((blocks, 1), MAX[fmt], dtype=torch.float64), vals_t), 1
    )  # scale 127
    x = rows.reshape(-1, 32).to(torch.bfloat16)  # [blocks, 32]
    pad = (-x.shape[0]) % 32
    x = torch.cat((x, torch.zeros(pad, 32, dtype=torch.bfloat16)))
    if axis == 0:
        x = x.t().contiguous()  # blocks along dim 0
    q = mxfp8.quantize(x, axis, fmt)
    assert (q.scale[:blocks] == 127).all() if axis == -1 else (q.scale[:, :blocks] == 127).all()
    expected = torch.tensor(
        [fp8_rne_oracle(v, fmt) for v in x.float().flatten().tolist()], dtype=torch.uint8
    ).reshape(x.shape)
    assert torch.equal(q.data, expected)


@pytest.mark.parametrize("axis", AXES)
def test_spike_changes_one_block_only(axis):
    base = torch.randn(64, 128, dtype=torch.bfloat16)
    q0 = mxfp8.quantize(base, axis)
    for pos in (31, 32):
        x = base.clone()
        if axis == -1:
            x[3, pos] = 1e4
        else:
            x[pos, 3] = 1e4
        q = mxfp8.quantize(x, axis)
        changed_scale = (q.scale != q0.scale).nonzero().tolist()
        block = pos // 32
        assert changed_scale == ([[3, block]] if axis == -1 else [[block, 3]])
        changed = (q.data != q0.data).nonzero()
        if axis == -1:
            assert (changed[:, 0] == 3).all() and (changed[:, 1] // 32 == block).all()
        else:
            assert (changed[:, 1] == 3).all() and (changed[:, 0] // 32 == block).all()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("axis", AXES)
def test_random_1e7_matches_numpy_reference(fmt, axis):
    g = torch.Generator().manual_seed(1234 + axis)
    # 2^10 x 10^4 ~ 10^7 elements, with a wide dynamic range per block and a few specials.
    x = torch.randn(1024, 9792, generator=g) * torch.exp(torch.randn(1024, 1, generator=g) * 8)
    x = x.to(torch.bfloat16)
    x.view(-1)[torch.randint(0, x.numel(), (50,), generator=g)] = math.nan
    x.view(-1)[torch.randint(0, x.numel(), (50,), generator=g)] = -math.inf
    q = mxfp8.quantize(x, axis, fmt)
    data, scale = mxfp8_numpy_reference(x.float().numpy(), fmt, axis)
    assert np.array_equal(q.scale.numpy(), scale)
    nan = np.isnan(q.data.view(mxfp8_dtype(fmt)).float().numpy())
    assert np.array_equal(nan, data == 0x7F)
    assert np.array_equal(q.data.numpy()[~nan], data[~nan])


@pytest.mark.parametrize("axis", AXES)
def test_layouts_and_dequantize(axis):
    # A spike at [0, 0] pushes the small values of its row block (rowwise) or of its column block
    # (columnwise) into the E4M3 subnormal range: the two directions must dequantize differently.
    g = torch.Generator().manual_seed(17)
    x = torch.randn(64, 96, generator=g) * 1e-3
    x[0, 0] = 1e4
    x = x.to(torch.bfloat16)
    q = mxfp8.quantize(x, axis)
    assert q.data.shape == x.shape and q.data.dtype == torch.uint8
    assert q.scale.shape == ((64, 3) if axis == -1 else (2, 96))
    y = mxfp8.dequantize(q)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # Direction matters: rowwise and columnwise quantizations of the same data differ.
    other = mxfp8.quantize(x, 0 if axis == -1 else -1)
    assert not torch.equal(mxfp8.dequantize(other), y)


@pytest.mark.parametrize(
    "shape,axis,msg",
    [((64, 40), -1, "multiple of 32"), ((40, 64), 0, "multiple of 32"), ((2, 32, 32), -1, "2-D")],
)
def test_bad_shapes_raise_clear_errors(shape, axis, msg):
    with pytest.raises(ValueError, match=msg):
        mxfp8.quantize(torch.randn(shape), axis)


def test_bad_arguments():
    x = torch.randn(32, 32)
    with pytest.raises(ValueError, match="fmt"):
        mxfp8.quantize(x, fmt="e3m4")
    with pytest.raises(ValueError, match="axis"):
        mxfp8.quantize(x, axis=2)


def test_arguments_are_checked_once_per_call(monkeypatch):
    calls = []
    check = mxfp8.check_blocked
    monkeypatch.setattr(mxfp8, "check_blocked", lambda *a: calls.append(a[1]) or check(*a))
    x = torch.randn(32, 32)
    mxfp8.quantize(x, 0)
    mxfp8.quantize_both(x)
    mxfp8.quantize_reference(x, -1)
    assert calls == [0, -1, 0, -1]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.floats(-60, 60),
    fmt=st.sampled_from(FMTS),
    axis=st.sampled_from(AXES),
)
def test_round_trip_error_bound(seed, log_scale, fmt, axis):
    """|x - deq| <= half a grid step of the block scale (relative 2^-4 for e4m3, 2^-3 for e5m2)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 64, generator=g) * 2.0**log_scale).to(torch.bfloat16)
    q = mxfp8.quantize(x, axis, fmt)
    y = mxfp8.dequantize(q)
    src = x.float() if axis == -1 else x.float().t()
    amax = src.reshape(src.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    mant = {"e4m3": 3, "e5m2": 2}[fmt]
    # Elements are at most max (no saturation with the round-up rule); relative error bound
    # for normal values, absolute bound at the subnormal quantum of the block.
    block_scale = 2.0 ** (torch.ceil(torch.log2(amax / MAX[fmt])))
    sub_quantum = block_scale * 2.0 ** ({"e4m3": -9, "e5m2": -16}[fmt])
    err = (y - x.float()).abs()
    err = err if axis == -1 else err.t()
    bound = torch.maximum(
        src.abs().reshape(src.shape[0], -1, 32) * 2.0 ** -(mant + 1),
        sub_quantum.expand(-1, -1, 32) / 2,
    ).reshape(src.shape)
    assert (err <= bound * (1 + 1e-6)).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), row=st.integers(0, 63), col=st.integers(0, 95))
def test_block_locality(seed, row, col):
    """Changing one element changes scales and bytes of its own block only (both directions)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    y = x.clone()
    y[row, col] = y[row, col] * 3 + 1
    for axis in AXES:
        a, b = mxfp8.quantize(x, axis), mxfp8.quantize(y, axis)
        diff = (a.data != b.data).nonzero()
        if axis == -1:
            assert (diff[:, 0] == row).all() and (diff[:, 1] // 32 == col // 32).all()
        else:
            assert (diff[:, 1] == col).all() and (diff[:, 0] // 32 == row // 32).all()

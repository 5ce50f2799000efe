"""NVFP4 quantize/dequantize on CPU: the test vectors of docs/numerics.md byte for byte against a
block oracle, both operation orders, 2-D blocks, bad inputs, error bounds (RHT and stochastic
rounding: test_quant_nvfp4_rht_sr.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.lab.quant import NVFP4Options, nvfp4
from graphsan.lab.quant.elements import unpack_nibbles
from tests.lab.quant_oracles import nvfp4_block_oracle

ORDERS = ("current", "legacy")
AXES = (-1, 0)


def codes_of(q: nvfp4.NVFP4Tensor) -> torch.Tensor:
    """E2M1 codes in the stored layout ([M, K] rowwise, [K, M] columnwise)."""
    return unpack_nibbles(q.data)


def oracle(x: torch.Tensor, axis: int, order: str, block_2d: bool = False):
    """(scale bytes, codes, amax) of the whole tensor by the per-block numpy oracle."""
    src = (x.t() if axis == 0 else x).float().numpy()
    rows, cols = src.shape
    absx = np.where(np.isnan(src), 0, np.abs(src))
    amax = float(absx.max())
    scales = np.zeros((rows, cols // 16), np.uint8)
    codes = np.zeros((rows, cols), np.uint8)
    for r in range(rows):
        for b in range(cols // 16):
            blk = src[r, b * 16 : (b + 1) * 16]
            if block_2d:
                r0 = r // 16 * 16
                tile = absx[r0 : r0 + 16, b * 16 : (b + 1) * 16]
                # the tile's max decides the scale: put it into a 1x16 block with blk's values
                s, _ = nvfp4_block_oracle(np.full(16, tile.max(), np.float32), amax, order)
                c = _codes_with_scale(blk, s, amax)
            else:
                s, c = nvfp4_block_oracle(blk, amax, order)
            scales[r, b] = s
            codes[r, b * 16 : (b + 1) * 16] = c
    return torch.from_numpy(scales), torch.from_numpy(codes), amax


def _codes_with_scale(blk, s_byte, amax):
    from tests.lab.quant_oracles import F32, e2m1_oracle

    a = F32(amax)
    s_enc = min(F32(2688.0) / a, F32(np.finfo(F32).max)) if a != 0 else F32(1.0)
    s_enc = F32(1.0) if s_enc == 0 else s_enc
    s_dec = F32(1.0) / s_enc
    s_q = F32(torch.tensor([s_byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item())
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        enc = min(F32(1.0) / (s_q * s_dec), F32(np.finfo(F32).max))
        return [e2m1_oracle(float(np.clip(F32(v) * enc, -6, 6))) for v in blk]


def assert_matches_oracle(x, axis=-1, order="current", block_2d=False):
    q = nvfp4.quantize(x, axis, NVFP4Options(order=order, block_2d=block_2d))
    scales, codes, amax = oracle(x, axis, order, block_2d)
    assert torch.equal(q.scale, scales)
    assert torch.equal(codes_of(q), codes)
    assert q.amax.dtype == torch.float32 and q.amax.dim() == 0
    assert q.amax.item() == amax or (math.isnan(amax) and math.isnan(q.amax.item()))
    return q


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("block_2d", [False, True])
def test_all_zero(order, axis, block_2d):
    x = torch.zeros(32, 48, dtype=torch.bfloat16)
    q = nvfp4.quantize(x, axis, NVFP4Options(order=order, block_2d=block_2d))
    assert q.amax.item() == 0 and q.scale.eq(0).all() and q.data.eq(0).all()
    s_enc, _ = nvfp4.global_scales(q.amax)
    assert s_enc.item() == 1.0
    assert nvfp4.dequantize(q).eq(0).all()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("block_2d", [False, True])
def test_block_with_global_amax(order, axis, block_2d):
    x = torch.randn(32, 64) * 3
    x[5, 21] = -17.25
    x = x.to(torch.bfloat16)
    q = assert_matches_oracle(x, axis, order, block_2d)
    row, col = (5, 21) if axis == -1 else (21, 5)
    assert int(q.scale[row, col // 16]) == 0x7E
    assert int(codes_of(q)[row, col]) == 7 | 8


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("axis", AXES)
def test_ties_and_linspace_at_unit_scale(order, axis):
    """Global amax 2688 (S_enc = 1), block max 6 (scale 1.0): x is the scaled value itself."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expect = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    vals = torch.cat(
        (
            ties,
            ties + 1e-3,
            ties - 1e-3,
            torch.linspace(-12, 12, 97) + 1e-3,
            torch.linspace(-12, 12, 97) - 1e-3,
        )
    )
    vals = vals.clamp(-5.999, 5.999)
    n = vals.numel()
    nblocks = -(-n // 15)
    body = torch.zeros(nblocks * 15)
    body[:n] = vals
    blocks = torch.cat((torch.full((nblocks, 1), 6.0), body.reshape(nblocks, 15)), dim=1)
    rows = -(-nblocks // 4) * 4
    x = torch.zeros(rows * 4, 16)
    x[:nblocks] = blocks
    x = x.reshape(rows, 64)
    x[-1, -1] = 2688.0  # the global amax, alone in its block
    x = x if axis == -1 else x.t().contiguous()
    q = assert_matches_oracle(x, axis, order)
    c = codes_of(q).reshape(-1, 16)[:nblocks].flatten()[torch.arange(nblocks * 16) % 16 != 0]
    for i, t in enumerate(ties.tolist()):
        assert int(c[i]) == expect[t], t
    # linspace +- 1e-3 includes values beyond 6 (clamped: code 7) and negative ones
    assert (c == 15).any()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("axis", AXES)
def test_scale_underflow_block(order, axis):
    x = torch.randn(16, 64) * 1e-3
    x[0, 0] = 1e4
    x = x if axis == -1 else x.t().contiguous()
    q = assert_matches_oracle(x, axis, order)
    # every block except the one holding 1e4 has scale 0, codes +-6, dequantizes to 0
    row_ok = torch.ones_like(q.scale, dtype=torch.bool)
    row_ok[0, 0] = False
    assert q.scale[row_ok].eq(0).all()
    codes = codes_of(q).reshape(q.scale.shape[0], -1, 16)[row_ok]
    assert ((codes & 7) == 7).all()
    deq = nvfp4.dequantize(q)
    mask = torch.ones_like(deq, dtype=torch.bool)
    if axis == -1:
        mask[0, :16] = False
    else:
        mask[:16, 0] = False
    assert deq[mask].eq(0).all()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("axis", AXES)
def test_subnormal_scales_inf_and_tiny_amax(order, axis):
    g = torch.Generator().manual_seed(7)
    # subnormal E4M3 scales (< 2^-6): block max / global amax below ~2^-15
    x = torch.randn(16, 128, generator=g)
    x *= 2.0 ** -torch.randint(12, 22, (16, 8, 1), generator=g).float().repeat(1, 1, 16).reshape(
        16, 128
    )
    x[0, 0] = 1.0
    x = x if axis == -1 else x.t().contiguous()
    q = assert_matches_oracle(x, axis, order)
    assert ((q.scale > 0) & (q.scale < 8)).any()  # E4M3 subnormal bytes

    # global amax inf: S_enc = 1; the block with inf saturates its scale at 448
    y = torch.randn(16, 64, generator=g) * 1e3
    y[3, 40] = math.inf
    y = y if axis == -1 else y.t().contiguous()
    q = assert_matches_oracle(y, axis, order)
    assert math.isinf(q.amax.item())
    row, col = 3, 40  # y was pre-transposed for axis 0, so the stored layout is y's
    assert int(q.scale[row, col // 16]) == 0x7E and int(codes_of(q)[row, col]) == 7

    # tiny global amax (float32 subnormal and small normal)
    for tiny in (1e-40, 1e-30):
        z = torch.randn(16, 32, generator=g) * tiny
        z = z if axis == -1 else z.t().contiguous()
        assert_matches_oracle(z, axis, order)


def test_nan_element_policy():
    x = torch.randn(16, 32)
    x[2, 3] = math.nan
    x[4, 5] = -0.0
    x[6, 7] = -1e-9
    q = assert_matches_oracle(x)
    c = codes_of(q)
    assert int(c[2, 3]) == 7  # NaN -> +6
    assert int(c[4, 5]) == 0  # exact -0.0 -> code 0
    assert int(c[6, 7]) == 8  # tiny negative -> -0


def test_op_orders_differ_on_a_regression_set():
    """Block maxima whose scale sits next to an E4M3 rounding midpoint: the two op orders round
    differently there. Both must match their own oracle, and the scale bytes must differ."""
    amax = 1000.0  # S_enc = 2.688: neither order is exact
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    mids = ((grid[:-1] + grid[1:]) / 2)[40:]  # normal range
    s_enc = torch.tensor(2688.0) / torch.tensor(amax)
    centre = (mids * 6 / s_enc.double()).float()
    cand = torch.cat(
        [torch.nextafter(centre, centre * 2) if k else centre for k in (0, 1)]
        + [torch.nextafter(centre, torch.zeros_like(centre))]
    )
    cand = cand[cand < amax]
    cur = nvfp4.block_scale(cand, s_enc, "current")
    leg = nvfp4.block_scale(cand, s_enc, "legacy")
    differ = cand[cur != leg]
    assert differ.numel() >= 3
    x = torch.rand(differ.numel(), 32) * differ[:, None] * 0.9
    x[:, 5] = differ
    x[0, 20] = amax
    for order in ORDERS:
        assert_matches_oracle(x, order=order)
    a = nvfp4.quantize(x, -1, NVFP4Options(order="current")).scale[:, 0]
    b = nvfp4.quantize(x, -1, NVFP4Options(order="legacy")).scale[:, 0]
    assert (a != b).sum() >= 3


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", [(64, 48), (40, 48)])
def test_2d_blocks_are_transposes_and_pad_with_zeros(order, shape):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 10).to(
        torch.bfloat16
    )
    if shape[0] % 16 == 0:
        row = nvfp4.quantize(x, -1, NVFP4Options(block_2d=True, order=order))
        col = nvfp4.quantize(x, 0, NVFP4Options(block_2d=True, order=order))
        assert torch.equal(codes_of(row), codes_of(col).t())
        assert torch.equal(row.scale[::16], col.scale[::16].t())
        assert torch.equal(row.amax, col.amax)
        assert row.data.shape == (shape[0], shape[1] // 2) and col.data.shape == (
            shape[1],
            shape[0] // 2,
        )
    # rowwise with a partial last tile (40 rows): the tile's scale comes from its existing rows
    q = assert_matches_oracle(x, -1, order, block_2d=True)
    for t in range(0, shape[0], 16):
        assert (q.scale[t : t + 16] == q.scale[t]).all()


@pytest.mark.parametrize(
    "kwargs,shape,msg",
    [
        ({}, (16, 40), "multiple of 16"),
        ({"axis": 0}, (40, 16), "multiple of 16"),
        ({"order": "new"}, (16, 16), "order"),
        ({"rht": True}, (16, 16), "columnwise"),
        ({"axis": 0, "rht": True, "block_2d": True}, (16, 16), "2-D weights"),
        ({}, (4, 16, 16), "2-D tensor"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, shape, msg):
    axis = kwargs.pop("axis", -1)
    with pytest.raises(ValueError, match=msg):
        nvfp4.quantize(torch.randn(shape), axis, NVFP4Options(**kwargs))


def test_arguments_are_checked_once_per_call(monkeypatch):
    calls = []
    check = nvfp4.check_blocked
    monkeypatch.setattr(nvfp4, "check_blocked", lambda *a: calls.append(a[1]) or check(*a))
    x = torch.randn(32, 32)
    nvfp4.quantize(x, 0, NVFP4Options(rht=True, generator=torch.Generator().manual_seed(0)))
    nvfp4.quantize_reference(x, -1)
    assert calls == [0, -1]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_scale=st.floats(-30, 30),
    axis=st.sampled_from(AXES),
    block_2d=st.booleans(),
    order=st.sampled_from(ORDERS),
)
def test_round_trip_error_bound(seed, log_scale, axis, block_2d, order):
    """|x - deq| <= vec_max / 6 * (1 + 2^-4) + tiny: one E2M1 half-step at the block scale."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(32, 64, generator=g) * 2.0**log_scale).to(torch.bfloat16)
    q = nvfp4.quantize(x, axis, NVFP4Options(block_2d=block_2d, order=order))
    y = nvfp4.dequantize(q)
    src = (x.float() if axis == -1 else x.float().t()).contiguous()
    vec = nvfp4.block_amax(src, block_2d).repeat_interleave(16, dim=1)
    err = (y - x.float()).abs()
    err = err if axis == -1 else err.t()
    assert (err <= vec / 6 * (1 + 2**-4) * (1 + 1e-5) + 1e-37).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), row=st.integers(0, 31), col=st.integers(0, 63))
def test_block_locality(seed, row, col):
    """Changing one element (below the global amax) changes only its block's bytes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g)
    x[0, 0] = 100.0  # global amax, fixed
    if (row, col) == (0, 0):
        row = 1
    y = x.clone()
    y[row, col] = y[row, col] * -2 + 0.5
    for axis in AXES:
        a, b = nvfp4.quantize(x, axis), nvfp4.quantize(y, axis)
        diff = (codes_of(a) != codes_of(b)).nonzero()
        r, c = (row, col) if axis == -1 else (col, row)
        assert (diff[:, 0] == r).all() and (diff[:, 1] // 16 == c // 16).all()
        sdiff = (a.scale != b.scale).nonzero().tolist()
        assert sdiff in ([], [[r, c // 16]])


def test_every_code_times_every_scale_byte_is_exact_in_bf16():
    """The claim the dequantization kernels rest on (kernels/gemm.py): an E2M1 value times an
    E4M3 scale, computed in float32, is a bf16 value, so its bf16 is the float32's high half: the
    low 16 bits are zero for all 16 codes x 256 scale bytes (NaN scales, 0x7F and 0xFF, give
    NaN whatever the code, zero included); and bf16 holds it exactly."""
    from graphsan.lab.quant.elements import e2m1_decode, fp8_decode

    codes = torch.arange(16, dtype=torch.uint8)
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    prod = e2m1_decode(codes)[:, None] * fp8_decode(scales, "e4m3")[None, :]
    nan = torch.isnan(prod)
    assert torch.equal(nan, ((scales & 0x7F) == 0x7F)[None, :].expand(16, 256))
    finite = prod[~nan]
    assert ((finite.view(torch.int32) & 0xFFFF) == 0).all()
    assert torch.equal(finite.to(torch.bfloat16).float(), finite)
    nonzero = finite[finite != 0].abs()
    assert nonzero.min() == 2.0**-10 and nonzero.max() == 6 * 448

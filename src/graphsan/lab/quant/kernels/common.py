"""Triton helpers both formats' kernels use: the FP8 byte from bit fields, and the reading of
bf16 sources as 64-bit words (four bf16 per word) with NaN-ignoring block maxima."""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import FLT_MAX as _FLT_MAX

FLT_MAX = tl.constexpr(_FLT_MAX)


@triton.jit
def fp8_bytes(s, MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, SUB: tl.constexpr):
    """FP8 byte of float32 `s`: nearest even, saturating to +-MAX, NaN -> 0x7F | sign.

    Also returns |value| as float32 (exact). MBITS mantissa bits, EMIN smallest normal exponent,
    SUB = 2^(MBITS - EMIN) (subnormal quanta per unit).
    """
    sbits = s.to(tl.int32, bitcast=True)
    sign = (sbits >> 24) & 0x80
    a = tl.abs(s)
    is_nan = a != a
    a = tl.where(a > MAX, MAX, a)
    a = tl.where(is_nan, 0.0, a)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    quantum = ((127 + e - MBITS) << 23).to(tl.float32, bitcast=True)
    inv_quantum = ((127 - e + MBITS) << 23).to(tl.float32, bitcast=True)
    # Round to an integer, nearest even: y < 2^4 here, and adding then subtracting 2^23 rounds
    # y at unit precision (exact IEEE adds; the product a * inv_quantum is exact, so a fused
    # multiply-add gives the same bits).
    r = ((a * inv_quantum + 8388608.0) - 8388608.0) * quantum
    rbits = r.to(tl.int32, bitcast=True)
    er = ((rbits >> 23) & 0xFF) - 127
    mant = (rbits >> (23 - MBITS)) & ((1 << MBITS) - 1)
    byte = tl.where(
        er >= EMIN, ((er - EMIN + 1) << MBITS) | mant, (tl.minimum(r, 1.0) * SUB).to(tl.int32)
    )
    byte = tl.where(is_nan, 0x7F, byte) | sign
    return byte, r


@triton.jit
def bf16_lanes(w):
    """The four bf16 of 64-bit words w as float32 (exact), element 0 in the low bits."""
    lo = w.to(tl.int32)
    hi = (w >> 32).to(tl.int32)
    x0 = (lo << 16).to(tl.float32, bitcast=True)
    x1 = (lo & -65536).to(tl.float32, bitcast=True)
    x2 = (hi << 16).to(tl.float32, bitcast=True)
    x3 = (hi & -65536).to(tl.float32, bitcast=True)
    return x0, x1, x2, x3


@triton.jit
def abs_for_max(x, MAXNUM: tl.constexpr):
    """|x| for a block maximum that ignores NaN. MAXNUM (compiled kernels): `tl.max` and
    `tl.maximum` are IEEE maxNum there (max.f32 returns the non-NaN operand), so NaN drops out by
    itself and `nan_to_0` maps an all-NaN block's NaN to 0; otherwise (Triton's interpreter,
    whose maximum propagates NaN) NaN is replaced by 0 here, one compare and select more per
    element."""
    a = tl.abs(x)
    if not MAXNUM:
        a = tl.where(a != a, 0.0, a)
    return a


@triton.jit
def nan_to_0(amax, MAXNUM: tl.constexpr):
    if MAXNUM:
        amax = tl.maximum(amax, 0.0)
    return amax


@triton.jit
def load_or_0(ptr, mask):
    """tl.load(ptr), masked with 0 where `mask` is given; None (whole tiles) loads unmasked."""
    if mask is None:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v

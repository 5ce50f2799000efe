"""Columnwise NVFP4 with the random Hadamard transform (RHT) and stochastic rounding (SR) fused
into the quantize kernel: the wgrad operands (X with RHT, dY with RHT and SR).

`nvfp4_col_fused_kernel` reads x [M, K] down its columns, 16 rows (one block of the transposed
[K, M] source) at a time: 16 loads of an [NB blocks, BK columns] tile, each coalesced along K.
Every thread holds whole 16-element column blocks, so the transform (the reference's order: the
signs and 1/4, then four butterfly stages), the bf16 rounding, the block maximum, the scale, the
SR bits (one Philox4x32-10 call per block, `elements.block_random_bits`) and the packing of the
block's 16 codes into one 64-bit word of the transposed data all run in its registers. It runs
twice with RHT: AMAX_ONLY=True accumulates the post-RHT global amax (one atomic max per program),
then the quantize pass recomputes the transform: the amax must be complete before any block is
scaled, and reading x again costs less than writing and reading the transformed copy.

bf16 sources are read as int16 bits (BF16_BITS) and widened by a shift, exact for subnormals too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import abs_for_max, nan_to_0
from .nvfp4 import _block_scale, _e2m1_lane, _global_scales


@triton.jit
def _load_row(ptr, r, stride_m, mask, BF16_BITS: tl.constexpr):
    """Row r of every block in the tile as float32 (exact)."""
    v = tl.load(ptr + r * stride_m, mask=mask, other=0)
    if BF16_BITS:
        v = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _bf16_round(y):
    """float32 rounded to the nearest bf16 (ties to even), as float32; NaN stays NaN."""
    bits = y.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, r)


@triton.jit
def _rht16(
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, ROUND: tl.constexpr
):
    """b @ (diag(s) H16 / 4) for the block b = (x0..x15), in `rht.rht`'s order: multiply by
    s_j / 4 (exact), then the stages h = 1, 2, 4, 8 of (y_i, y_i+h) -> (y_i + y_i+h, y_i - y_i+h),
    then bf16 rounding where ROUND. The signs are rht.RHT_SIGNS (the kernel tests compare with
    rht.rht)."""
    y0, y1, y2, y3 = x0 * 0.25, x1 * 0.25, x2 * 0.25, x3 * -0.25
    y4, y5, y6, y7 = x4 * 0.25, x5 * -0.25, x6 * -0.25, x7 * -0.25
    y8, y9, y10, y11 = x8 * -0.25, x9 * -0.25, x10 * -0.25, x11 * 0.25
    y12, y13, y14, y15 = x12 * -0.25, x13 * 0.25, x14 * -0.25, x15 * -0.25
    y0, y1 = _bf(y0, y1)
    y2, y3 = _bf(y2, y3)
    y4, y5 = _bf(y4, y5)
    y6, y7 = _bf(y6, y7)
    y8, y9 = _bf(y8, y9)
    y10, y11 = _bf(y10, y11)
    y12, y13 = _bf(y12, y13)
    y14, y15 = _bf(y14, y15)
    y0, y2 = _bf(y0, y2)
    y1, y3 = _bf(y1, y3)
    y4, y6 = _bf(y4, y6)
    y5, y7 = _bf(y5, y7)
    y8, y10 = _bf(y8, y10)
    y9, y11 = _bf(y9, y11)
    y12, y14 = _bf(y12, y14)
    y13, y15 = _bf(y13, y15)
    y0, y4 = _bf(y0, y4)
    y1, y5 = _bf(y1, y5)
    y2, y6 = _bf(y2, y6)
    y3, y7 = _bf(y3, y7)
    y8, y12 = _bf(y8, y12)
    y9, y13 = _bf(y9, y13)
    y10, y14 = _bf(y10, y14)
    y11, y15 = _bf(y11, y15)
    y0, y8 = _bf(y0, y8)
    y1, y9 = _bf(y1, y9)
    y2, y10 = _bf(y2, y10)
    y3, y11 = _bf(y3, y11)
    y4, y12 = _bf(y4, y12)
    y5, y13 = _bf(y5, y13)
    y6, y14 = _bf(y6, y14)
    y7, y15 = _bf(y7, y15)
    if ROUND:
        y0, y1, y2, y3 = _bf16_round(y0), _bf16_round(y1), _bf16_round(y2), _bf16_round(y3)
        y4, y5, y6, y7 = _bf16_round(y4), _bf16_round(y5), _bf16_round(y6), _bf16_round(y7)
        y8, y9, y10, y11 = _bf16_round(y8), _bf16_round(y9), _bf16_round(y10), _bf16_round(y11)
        y12, y13 = _bf16_round(y12), _bf16_round(y13)
        y14, y15 = _bf16_round(y14), _bf16_round(y15)
    return y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15


@triton.jit
def _amax_part(a, b, c, d, MAXNUM: tl.constexpr):
    """NaN-ignoring max of |a|, |b|, |c|, |d| (NaN only if all four are; `abs_for_max`)."""
    a = abs_for_max(a, MAXNUM)
    b = abs_for_max(b, MAXNUM)
    c = abs_for_max(c, MAXNUM)
    d = abs_for_max(d, MAXNUM)
    return tl.maximum(tl.maximum(a, b), tl.maximum(c, d))


@triton.jit
def _quad(a, b, c, d, enc, w, SR: tl.constexpr, MAXNUM: tl.constexpr):
    """Codes of four consecutive block elements as 16 bits (first lowest); SR with the bytes of
    the random word w."""
    q = _e2m1_lane(a * enc, w, 0, SR, MAXNUM)
    q |= _e2m1_lane(b * enc, w, 1, SR, MAXNUM)
    q |= _e2m1_lane(c * enc, w, 2, SR, MAXNUM)
    q |= _e2m1_lane(d * enc, w, 3, SR, MAXNUM)
    return q.to(tl.int64) & 0xFFFF


@triton.jit
def nvfp4_col_fused_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    amax_ptr,
    group_ptr,
    G,
    seed_ptr,
    data_ptr,
    scale_ptr,
    INV_6: tl.constexpr,
    LEGACY: tl.constexpr,
    RHT: tl.constexpr,
    SR: tl.constexpr,
    AMAX_ONLY: tl.constexpr,
    BF16_BITS: tl.constexpr,
    HW_FP8: tl.constexpr,
    NB: tl.constexpr,
    BK: tl.constexpr,
    GROUPED: tl.constexpr = False,
    MAXNUM: tl.constexpr = False,
):
    """NVFP4 of x^T (16x1 blocks down x's columns, 1D blocks), written transposed: data as an
    int64 view [K, M/16] (one word per column and block, row 2j of the block in the low nibble of
    byte j), scales uint8 [K, M/16]. RHT: each block transformed first; SR: random bytes from
    Philox keyed by the int64 at seed_ptr, counter = the block's index in [K, M/16].
    AMAX_ONLY: only the NaN-ignoring max |block| into amax_ptr (the post-RHT global amax).
    GROUPED (rows in groups, every group's row count a multiple of 16): AMAX_ONLY takes one
    amax per group, amax_ptr[group_ptr[first row of the block]] (int64 groups, G = none: skipped);
    the quantize pass reads each block's amax at amax_ptr[its first row] (float32 [M]).
    MAXNUM (compiled kernels, `common.abs_for_max`): NaN leaves maxima and the SR clamp through
    the GPU's NaN-ignoring maximum and minimum, without a compare and select per element."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    blk = pid_m * NB + tl.arange(0, NB)[:, None]
    col = pid_k * BK + tl.arange(0, BK)[None, :]
    mask = (blk < M // 16) & (col < K)
    p = x_ptr + (blk * 16).to(tl.int64) * stride_m + col.to(tl.int64) * stride_k
    x0 = _load_row(p, 0, stride_m, mask, BF16_BITS)
    x1 = _load_row(p, 1, stride_m, mask, BF16_BITS)
    x2 = _load_row(p, 2, stride_m, mask, BF16_BITS)
    x3 = _load_row(p, 3, stride_m, mask, BF16_BITS)
    x4 = _load_row(p, 4, stride_m, mask, BF16_BITS)
    x5 = _load_row(p, 5, stride_m, mask, BF16_BITS)
    x6 = _load_row(p, 6, stride_m, mask, BF16_BITS)
    x7 = _load_row(p, 7, stride_m, mask, BF16_BITS)
    x8 = _load_row(p, 8, stride_m, mask, BF16_BITS)
    x9 = _load_row(p, 9, stride_m, mask, BF16_BITS)
    x10 = _load_row(p, 10, stride_m, mask, BF16_BITS)
    x11 = _load_row(p, 11, stride_m, mask, BF16_BITS)
    x12 = _load_row(p, 12, stride_m, mask, BF16_BITS)
    x13 = _load_row(p, 13, stride_m, mask, BF16_BITS)
    x14 = _load_row(p, 14, stride_m, mask, BF16_BITS)
    x15 = _load_row(p, 15, stride_m, mask, BF16_BITS)
    if RHT:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, not AMAX_ONLY
        )
    vec = tl.maximum(
        tl.maximum(_amax_part(x0, x1, x2, x3, MAXNUM), _amax_part(x4, x5, x6, x7, MAXNUM)),
        tl.maximum(_amax_part(x8, x9, x10, x11, MAXNUM), _amax_part(x12, x13, x14, x15, MAXNUM)),
    )
    vec = nan_to_0(vec, MAXNUM)
    if AMAX_ONLY:
        # the transform is not rounded in this pass: rounding is monotonic, so the largest
        # rounded |value| is the rounded largest one, and one rounding per block suffices
        if GROUPED:
            bmask = blk < M // 16
            group = tl.load(group_ptr + blk * 16, mask=bmask, other=G)
            bmax = _bf16_round(tl.max(vec, axis=1)[:, None])
            tl.atomic_max(amax_ptr + group, bmax, mask=bmask & (group < G))
        else:
            tl.atomic_max(amax_ptr, _bf16_round(tl.max(tl.max(vec, axis=1), axis=0)))
    else:
        s_enc, s_dec = _global_scales(amax_ptr, blk * 16, blk < M // 16, GROUPED)
        sbyte, enc = _block_scale(vec, s_enc, s_dec, INV_6, LEGACY, HW_FP8)
        out = col.to(tl.int64) * (M // 16) + blk
        if SR:
            w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), out)
            # zero, but made from the block's own values: Triton then moves the four words to
            # the elements' layout, not the sixteen floats made from them
            z = sbyte.to(tl.int32) >> 8
            w0, w1, w2, w3 = w0 ^ z, w1 ^ z, w2 ^ z, w3 ^ z
        else:
            w0 = 0
            w1 = 0
            w2 = 0
            w3 = 0
        word = _quad(x0, x1, x2, x3, enc, w0, SR, MAXNUM)
        word |= _quad(x4, x5, x6, x7, enc, w1, SR, MAXNUM) << 16
        word |= _quad(x8, x9, x10, x11, enc, w2, SR, MAXNUM) << 32
        word |= _quad(x12, x13, x14, x15, enc, w3, SR, MAXNUM) << 48
        tl.store(data_ptr + out, word, mask=mask)
        tl.store(scale_ptr + out, sbyte, mask=mask)

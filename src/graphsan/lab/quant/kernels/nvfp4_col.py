"""Columnwise NVFP4 with the random Hadamard transform (RHT) and stochastic rounding (SR) fused
into the quantize kernel: the wgrad operands (X with RHT, dY with RHT and SR).

`nvfp4_col_fused_kernel` reads x [M, K] down its columns, 16 rows (one block of the transposed
[K, M] source) at a time: 16 loads of an [NB blocks, BK columns] tile, each coalesced along K.
Every thread holds whole 16-element column blocks, so the transform (the reference's order: the
signs and 1/4, then four butterfly stages), the bf16 rounding, the block maximum, the scale, the
SR bits (one Philox4x32-10 call per block, `elements.block_random_bits`) and the packing of the
block's 16 codes into one 64-bit word of the transposed data all run in its registers. With RHT
`nvfp4_col_amax_kernel` runs first: it takes the post-RHT global amax (and, for the rowwise copy
of the same tensor, the plain one in the same read), because the amax must be complete before
any block is scaled, and reading x again costs less than writing and reading the transformed
copy.

bf16 sources are read as int16 bits (BF16_BITS) and widened by a shift, exact for subnormals too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import abs_for_max, load_or_0, nan_to_0
from .nvfp4 import _block_scale, _e2m1_lane, _e2m1_rne_field, _e2m1_sr_field, _global_scales


@triton.jit
def _load_row(ptr, mask, BF16_BITS: tl.constexpr, PTX: tl.constexpr = False):
    """One row of every block in the tile as float32 (exact). PTX: two neighbouring bf16 of a
    register at a time, one instruction each (a shift for the low half, a mask for the high
    one), where the int16 path extracts and sign-extends the high half first."""
    v = load_or_0(ptr, mask)
    if BF16_BITS:
        if PTX:
            v = tl.inline_asm_elementwise(
                "shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;",
                "=r,=r,r",
                [v],
                dtype=tl.float32,
                is_pure=True,
                pack=2,
            )
        else:
            v = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _bf16_round(y, PTX: tl.constexpr = False):
    """float32 rounded to the nearest bf16 (ties to even), as float32; NaN stays NaN. PTX
    (compiled kernels): the hardware conversion, one instruction, its NaN the canonical one
    (every NaN encodes as code 7 with no sign, so the payload never shows in the bytes); the
    low half of the packed pair is the conversion of +0, so the word is the rounded float."""
    if PTX:
        r = tl.inline_asm_elementwise(
            "{ .reg .f32 z; mov.f32 z, 0f00000000; cvt.rn.bf16x2.f32 $0, $1, z; }",
            "=r,f",
            [y],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        ).to(tl.float32, bitcast=True)
    else:
        bits = y.to(tl.int32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        r = tl.where(y != y, y, r)
    return r


@triton.jit
def _bf1(x0, c0: tl.constexpr, x1, c1: tl.constexpr, FMA: tl.constexpr):
    """The first butterfly of (x0 * c0, x1 * c1). FMA (sources of 16 bits or fewer, whose
    quarters are exact): x1 * c1 is exact, so the fused multiply-add rounds the same sum once
    and the second multiply goes."""
    y0 = x0 * c0
    if FMA:
        return tl.fma(x1, c1, y0), tl.fma(x1, -c1, y0)
    else:
        return _bf(y0, x1 * c1)


@triton.jit
def _rht16(
    x0,
    x1,
    x2,
    x3,
    x4,
    x5,
    x6,
    x7,
    x8,
    x9,
    x10,
    x11,
    x12,
    x13,
    x14,
    x15,
    ROUND: tl.constexpr,
    FMA: tl.constexpr = False,
    PTX: tl.constexpr = False,
):
    """b @ (diag(s) H16 / 4) for the block b = (x0..x15), in `rht.rht`'s order: multiply by
    s_j / 4 (exact), then the stages h = 1, 2, 4, 8 of (y_i, y_i+h) -> (y_i + y_i+h, y_i - y_i+h),
    then bf16 rounding where ROUND (`_bf16_round`). The signs are rht.RHT_SIGNS (the kernel tests
    compare with rht.rht); FMA: the first stage as `_bf1`."""
    y0, y1 = _bf1(x0, 0.25, x1, 0.25, FMA)
    y2, y3 = _bf1(x2, 0.25, x3, -0.25, FMA)
    y4, y5 = _bf1(x4, 0.25, x5, -0.25, FMA)
    y6, y7 = _bf1(x6, -0.25, x7, -0.25, FMA)
    y8, y9 = _bf1(x8, -0.25, x9, -0.25, FMA)
    y10, y11 = _bf1(x10, -0.25, x11, 0.25, FMA)
    y12, y13 = _bf1(x12, -0.25, x13, 0.25, FMA)
    y14, y15 = _bf1(x14, -0.25, x15, -0.25, FMA)
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
        y0, y1 = _bf16_round(y0, PTX), _bf16_round(y1, PTX)
        y2, y3 = _bf16_round(y2, PTX), _bf16_round(y3, PTX)
        y4, y5 = _bf16_round(y4, PTX), _bf16_round(y5, PTX)
        y6, y7 = _bf16_round(y6, PTX), _bf16_round(y7, PTX)
        y8, y9 = _bf16_round(y8, PTX), _bf16_round(y9, PTX)
        y10, y11 = _bf16_round(y10, PTX), _bf16_round(y11, PTX)
        y12, y13 = _bf16_round(y12, PTX), _bf16_round(y13, PTX)
        y14, y15 = _bf16_round(y14, PTX), _bf16_round(y15, PTX)
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
def _philox(seed, counter):
    """`tl.randint4x(seed, counter)` (Philox4x32-10, `elements.philox4x32`) for an int64 seed and
    int64 counters, each round's two 32x32-bit products as 64-bit ones: one wide multiply gives
    both halves where the high and low products are two multiplies."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = counter.to(tl.uint32)
    c1 = (counter >> 32).to(tl.uint32)
    c2 = c0 * 0
    c3 = c2
    for _ in tl.static_range(10):
        a = c0.to(tl.uint64) * 0xD2511F53
        b = c2.to(tl.uint64) * 0xCD9E8D57
        c0 = (b >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (a >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = b.to(tl.uint32)
        c3 = a.to(tl.uint32)
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _field(v, w, J: tl.constexpr, SR: tl.constexpr, MAXNUM: tl.constexpr):
    """The code field of v (`_half`): SR with byte J of w, else nearest even."""
    if SR:
        f = _e2m1_sr_field(v, w, J)
    else:
        f = _e2m1_rne_field(v, MAXNUM)
    return f


@triton.jit
def _half(v0, v1, v2, v3, v4, v5, v6, v7, wa, wb, SR: tl.constexpr, MAXNUM: tl.constexpr):
    """The codes with signs of eight consecutive block elements as 32 bits (first lowest): SR
    (compiled kernels only) with bytes 0-3 of wa for the first four, of wb for the others, else
    nearest even; from fields whose bits 22-24, XOR 4, are the codes (`_e2m1_sr_field`,
    `_e2m1_rne_field`), so each code takes one shift and one masked merge."""
    q = (_field(v0, wa, 0, SR, MAXNUM) >> 22) & 0x7
    q |= (_field(v1, wa, 1, SR, MAXNUM) >> 18) & 0x70
    q |= (_field(v2, wa, 2, SR, MAXNUM) >> 14) & 0x700
    q |= (_field(v3, wa, 3, SR, MAXNUM) >> 10) & 0x7000
    q |= (_field(v4, wb, 0, SR, MAXNUM) >> 6) & 0x70000
    q |= (_field(v5, wb, 1, SR, MAXNUM) >> 2) & 0x700000
    q |= (_field(v6, wb, 2, SR, MAXNUM) << 2) & 0x7000000
    q |= (_field(v7, wb, 3, SR, MAXNUM) << 6) & 0x70000000
    q ^= 0x44444444
    q = tl.where(v0 < 0.0, q | 0x8, q)
    q = tl.where(v1 < 0.0, q | 0x80, q)
    q = tl.where(v2 < 0.0, q | 0x800, q)
    q = tl.where(v3 < 0.0, q | 0x8000, q)
    q = tl.where(v4 < 0.0, q | 0x80000, q)
    q = tl.where(v5 < 0.0, q | 0x800000, q)
    q = tl.where(v6 < 0.0, q | 0x8000000, q)
    q = tl.where(v7 < 0.0, q | -0x80000000, q)
    return q


@triton.jit
def _rows16(x_ptr, blk, col, mask, stride_m, stride_k, BF16_BITS: tl.constexpr, PTX: tl.constexpr):
    """The 16 rows of the blocks `blk` (down the columns `col`), each a [NB, BK] float32 tile."""
    p0 = x_ptr + (blk * 16).to(tl.int64) * stride_m + col.to(tl.int64) * stride_k
    # each row's pointers from the last row's: one 64-bit add a row, where r * stride_m from
    # the first row's costs a multiply more
    p1 = p0 + stride_m
    p2 = p1 + stride_m
    p3 = p2 + stride_m
    p4 = p3 + stride_m
    p5 = p4 + stride_m
    p6 = p5 + stride_m
    p7 = p6 + stride_m
    p8 = p7 + stride_m
    p9 = p8 + stride_m
    p10 = p9 + stride_m
    p11 = p10 + stride_m
    p12 = p11 + stride_m
    p13 = p12 + stride_m
    p14 = p13 + stride_m
    p15 = p14 + stride_m
    return (
        _load_row(p0, mask, BF16_BITS, PTX),
        _load_row(p1, mask, BF16_BITS, PTX),
        _load_row(p2, mask, BF16_BITS, PTX),
        _load_row(p3, mask, BF16_BITS, PTX),
        _load_row(p4, mask, BF16_BITS, PTX),
        _load_row(p5, mask, BF16_BITS, PTX),
        _load_row(p6, mask, BF16_BITS, PTX),
        _load_row(p7, mask, BF16_BITS, PTX),
        _load_row(p8, mask, BF16_BITS, PTX),
        _load_row(p9, mask, BF16_BITS, PTX),
        _load_row(p10, mask, BF16_BITS, PTX),
        _load_row(p11, mask, BF16_BITS, PTX),
        _load_row(p12, mask, BF16_BITS, PTX),
        _load_row(p13, mask, BF16_BITS, PTX),
        _load_row(p14, mask, BF16_BITS, PTX),
        _load_row(p15, mask, BF16_BITS, PTX),
    )


@triton.jit
def _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, MAXNUM):
    """Each block's NaN-ignoring max |x| (0 for an all-NaN block)."""
    vec = tl.maximum(
        tl.maximum(_amax_part(x0, x1, x2, x3, MAXNUM), _amax_part(x4, x5, x6, x7, MAXNUM)),
        tl.maximum(_amax_part(x8, x9, x10, x11, MAXNUM), _amax_part(x12, x13, x14, x15, MAXNUM)),
    )
    return nan_to_0(vec, MAXNUM)


@triton.jit
def nvfp4_col_amax_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    amax_ptr,
    pre_amax_ptr,
    group_ptr,
    G,
    BF16_BITS: tl.constexpr,
    NB: tl.constexpr,
    BK: tl.constexpr,
    ITERS: tl.constexpr,
    GROUPED: tl.constexpr = False,
    MAXNUM: tl.constexpr = False,
    PTX: tl.constexpr = False,
    EVEN: tl.constexpr = False,
    PRE_AMAX: tl.constexpr = False,
):
    """The RHT amax pass: the NaN-ignoring max of the transformed |x| (the post-RHT global amax,
    bf16-rounded as the transform is) into amax_ptr; PRE_AMAX: the max |x| before the transform
    into pre_amax_ptr too (the plain global amax of the rowwise copy: both from one read, as
    TE's `hadamard_transform_amax` takes them). Each program takes ITERS tiles of NB blocks down
    its BK columns, keeps a running maximum and makes one atomic per amax at the end, so the
    atomics and the reduction across the program are ITERS times fewer. GROUPED (rows in groups,
    every group's row count a multiple of 16): one amax per group instead, amax_ptr[group_ptr[
    first row of the block]] (int64 groups, G = none: skipped; pre_amax_ptr likewise), an
    atomic per block row and tile. EVEN: the tiles cover x exactly (M / 16 a multiple of
    NB * ITERS, K of BK), so no masks."""
    pid_m = tl.program_id(0)
    col = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
    acc = tl.zeros([NB, BK], dtype=tl.float32)
    pre_acc = tl.zeros([NB, BK], dtype=tl.float32)
    for it in range(ITERS):
        blk = (pid_m * ITERS + it) * NB + tl.arange(0, NB)[:, None]
        mask = None if EVEN else (blk < M // 16) & (col < K)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(
            x_ptr, blk, col, mask, stride_m, stride_k, BF16_BITS, PTX
        )
        if PRE_AMAX:
            pre = _max16(
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, MAXNUM
            )
        # not rounded here: rounding is monotonic, so the largest rounded |value| is the
        # rounded largest one, and one rounding per maximum suffices
        y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15 = _rht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            False, BF16_BITS, PTX,
        )  # fmt: skip
        vec = _max16(y0, y1, y2, y3, y4, y5, y6, y7, y8, y9, y10, y11, y12, y13, y14, y15, MAXNUM)
        if GROUPED:
            bmask = blk < M // 16
            group = tl.load(group_ptr + blk * 16, mask=bmask, other=G)
            bmax = _bf16_round(tl.max(vec, axis=1)[:, None])
            tl.atomic_max(amax_ptr + group, bmax, mask=bmask & (group < G))
            if PRE_AMAX:
                pmax = tl.max(pre, axis=1)[:, None]
                tl.atomic_max(pre_amax_ptr + group, pmax, mask=bmask & (group < G))
        else:
            acc = tl.maximum(acc, vec)
            if PRE_AMAX:
                pre_acc = tl.maximum(pre_acc, pre)
    if not GROUPED:
        tl.atomic_max(amax_ptr, _bf16_round(tl.max(tl.max(acc, axis=1), axis=0)))
        if PRE_AMAX:
            tl.atomic_max(pre_amax_ptr, tl.max(tl.max(pre_acc, axis=1), axis=0))


@triton.jit
def nvfp4_col_fused_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    amax_ptr,
    seed_ptr,
    data_ptr,
    scale_ptr,
    INV_6: tl.constexpr,
    LEGACY: tl.constexpr,
    RHT: tl.constexpr,
    SR: tl.constexpr,
    BF16_BITS: tl.constexpr,
    HW_FP8: tl.constexpr,
    NB: tl.constexpr,
    BK: tl.constexpr,
    GROUPED: tl.constexpr = False,
    MAXNUM: tl.constexpr = False,
    PTX: tl.constexpr = False,
    EVEN: tl.constexpr = False,
):
    """NVFP4 of x^T (16x1 blocks down x's columns, 1D blocks), written transposed: data as an
    int64 view [K, M/16] (one word per column and block, row 2j of the block in the low nibble of
    byte j), scales uint8 [K, M/16]. RHT: each block transformed first (the post-RHT amax at
    amax_ptr: `nvfp4_col_amax_kernel`); SR: random bytes from Philox keyed by the int64 at
    seed_ptr, counter = the block's index in [K, M/16]. GROUPED: each block's amax at
    amax_ptr[its first row] (float32 [M]: its row group's).
    MAXNUM (compiled kernels, `common.abs_for_max`): NaN leaves maxima and the SR clamp through
    the GPU's NaN-ignoring maximum and minimum, without a compare and select per element.
    PTX (compiled kernels, with MAXNUM): the bf16 widening two values a register at a time, the
    bf16 rounding by the hardware conversion and the SR encoder `_e2m1_sr_field`, which use
    inline PTX and rounding modes the interpreter lacks (it runs `_e2m1_sr_code`).
    EVEN: the tiles cover x exactly (M / 16 a multiple of NB, K of BK), so no masks."""
    blk = tl.program_id(0) * NB + tl.arange(0, NB)[:, None]
    col = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
    mask = None if EVEN else (blk < M // 16) & (col < K)
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(
        x_ptr, blk, col, mask, stride_m, stride_k, BF16_BITS, PTX
    )
    if RHT:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
            x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
            True, BF16_BITS, PTX,
        )  # fmt: skip
    vec = _max16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, MAXNUM)
    s_enc, s_dec = _global_scales(amax_ptr, blk * 16, blk < M // 16, GROUPED)
    sbyte, enc = _block_scale(vec, s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    out = col.to(tl.int64) * (M // 16) + blk
    if SR:
        # the counter XOR a zero made from the block's own scale: Triton then computes the
        # counter and Philox in the elements' layout, so no word moves between layouts
        z = (sbyte.to(tl.int32) >> 8).to(tl.int64)
        w0, w1, w2, w3 = _philox(tl.load(seed_ptr), out ^ z)
        w0, w1 = w0.to(tl.int32, bitcast=True), w1.to(tl.int32, bitcast=True)
        w2, w3 = w2.to(tl.int32, bitcast=True), w3.to(tl.int32, bitcast=True)
    else:
        w0 = 0
        w1 = 0
        w2 = 0
        w3 = 0
    if PTX or not SR:
        e = enc
        lo = _half(
            x0 * e, x1 * e, x2 * e, x3 * e, x4 * e, x5 * e, x6 * e, x7 * e, w0, w1, SR, MAXNUM
        )
        hi = _half(
            x8 * e, x9 * e, x10 * e, x11 * e, x12 * e, x13 * e, x14 * e, x15 * e, w2, w3, SR, MAXNUM
        )
        word = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
    else:
        word = _quad(x0, x1, x2, x3, enc, w0, SR, MAXNUM)
        word |= _quad(x4, x5, x6, x7, enc, w1, SR, MAXNUM) << 16
        word |= _quad(x8, x9, x10, x11, enc, w2, SR, MAXNUM) << 32
        word |= _quad(x12, x13, x14, x15, enc, w3, SR, MAXNUM) << 48
    tl.store(data_ptr + out, word, mask=mask)
    tl.store(scale_ptr + out, sbyte, mask=mask)

"""MXFP8 Triton kernels: one pass over a tile writes the rowwise and/or columnwise element bytes
and E8M0 scales, bit-identical to `mxfp8.quantize_reference`.

- `mxfp8_strided_kernel`: any floating dtype and strides, one element per load; rowwise,
  columnwise or both. Each thread holds a slice of rows of a column block, so the 32-row
  (columnwise) maximum is a register reduction plus a few shuffles.
- `mxfp8_words_kernel`: bf16 sources with unit column stride read as 64-bit words (4 bf16) and
  data written as 32-bit words (4 bytes), so the load and the store share one tile shape and
  Triton gives them one layout (16-byte loads and stores); columnwise, or both directions. Block
  maxima drop NaN through the GPU's NaN-ignoring maximum (MAXNUM) instead of a select per element.

Element bytes come from the hardware conversion where HW_FP8 (sm_90 and later: nearest even,
saturating, like the reference), because the bit-field version makes the kernels
instruction-bound; elsewhere (Triton's interpreter, older GPUs) from `fp8_bytes`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import E8M0_MAX as _E8M0_MAX
from ..formats import E8M0_NAN as _E8M0_NAN
from .common import abs_for_max, bf16_lanes, fp8_bytes, nan_to_0

E8M0_MAX = tl.constexpr(_E8M0_MAX)
E8M0_NAN = tl.constexpr(_E8M0_NAN)


@triton.jit
def _e8m0_round_up(v):
    """TE's E8M0 byte (int32) of a non-negative float32 v."""
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != E8M0_MAX) & ((exp != 0) | (mant > 0x400000))
    e = exp + up.to(tl.int32)
    return tl.where(exp == 0xFF, tl.where(mant == 0, E8M0_MAX, E8M0_NAN), e)


@triton.jit
def _exp2_neg_biased(e):
    """Exact float32 2^(127 - e) for an E8M0 byte e (int32); 0xFF gives NaN."""
    kb = 254 - e
    bits = tl.where(kb >= 1, kb << 23, 0x00400000)
    bits = tl.where(e == E8M0_NAN, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_hw_bits(s, MBITS: tl.constexpr):
    """The hardware conversion's byte (uint8): nearest even, saturating, sign kept, 0x7F for
    every NaN (the caller ORs the source's sign bit in: a no-op except for negative NaN)."""
    if MBITS == 3:
        q = s.to(tl.float8e4nv)
    else:
        q = s.to(tl.float8e5)
    return q.to(tl.uint8, bitcast=True)


@triton.jit
def _fp8_byte(
    s,
    MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    SUB: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """FP8 bytes of s by the hardware conversion where HW_FP8 (the caller ORs the source's sign
    in: `_fp8_hw_bits`), else by bit fields, so every MXFP8 kernel picks its path one way."""
    if HW_FP8:
        byte = _fp8_hw_bits(s, MBITS)
    else:
        byte, _ = fp8_bytes(s, MAX, MBITS, EMIN, SUB)
    return byte


@triton.jit
def _bf16_signs(w):
    """The sign bits of the four bf16 of 64-bit words w (bits 15, 31, 47, 63) moved to bits 7, 15,
    23, 31 of an int32: the sign bits of the four FP8 bytes packed the same way."""
    lo = w.to(tl.int32)
    hi = (w >> 32).to(tl.int32)
    sign = ((lo >> 8) & 0x80) | ((lo >> 16) & 0x8000) | ((hi << 8) & 0x800000)
    return sign | (hi & -2147483648)


@triton.jit
def _fp8_word(
    signs,
    x0,
    x1,
    x2,
    x3,
    f0,
    f1,
    f2,
    f3,
    MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    SUB: tl.constexpr,
    HW_FP8: tl.constexpr,
):
    """The FP8 bytes of x0 * f0 .. x3 * f3 packed into int32 words, x0's byte lowest; NaN ->
    0x7F | sign. The four are joined in a last dimension that each thread holds in order, so the
    hardware converts them in pairs; it gives 0x7F for every NaN and keeps every other sign, so
    the sources' sign bits (`signs`, from `_bf16_signs`) are ORed in afterwards."""
    s = tl.join(tl.join(x0 * f0, x2 * f2), tl.join(x1 * f1, x3 * f3))
    byte = _fp8_byte(s, MAX, MBITS, EMIN, SUB, HW_FP8)
    byte = tl.reshape(byte, x0.shape + (4,)).to(tl.int32)
    word = tl.sum(byte << (tl.arange(0, 4) * 8), axis=len(x0.shape))
    if HW_FP8:
        word |= signs
    return word


@triton.jit
def mxfp8_strided_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    INV_MAX: tl.constexpr,
    MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    SUB: tl.constexpr,
    HW_FP8: tl.constexpr,
    DO_ROW: tl.constexpr,
    DO_COL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """MXFP8 of x [M, K] (any dtype and strides) with DO_ROW and/or DO_COL: data bytes [M, K]
    per direction, scales [M, K/32] rowwise and [M/32, K] columnwise. A BM x BN tile is read once
    as [BM/32 blocks, SPLIT, 32/SPLIT rows, BN]: each thread holds 32/SPLIT rows of a column
    block, so the 32-row (columnwise) maximum is a register reduction plus log2(SPLIT) shuffles;
    the 32-column (rowwise) maximum reshapes the last dim. The NaN fix-up of the hardware
    conversion is one OR of the source's sign bit."""
    NB: tl.constexpr = BM // 32
    RS: tl.constexpr = 32 // SPLIT
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blk = tl.arange(0, NB)[:, None, None, None]
    half = tl.arange(0, SPLIT)[None, :, None, None]
    row = tl.arange(0, RS)[None, None, :, None]
    offs_n = pid_n * BN + tl.arange(0, BN)
    col = offs_n[None, None, None, :]
    offs_m = pid_m * BM + blk * 32 + half * RS + row
    mask = (offs_m < M) & (col < K)
    x = tl.load(x_ptr + offs_m * stride_m + col * stride_k, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    a = tl.where(a != a, 0.0, a)
    out_offs = offs_m * K + col
    if HW_FP8:
        sign = ((x.to(tl.int32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
    if DO_COL:
        e = _e8m0_round_up(tl.max(tl.max(a, axis=2), axis=1) * INV_MAX)
        s = x * _exp2_neg_biased(e)[:, None, None, :]
        byte = _fp8_byte(s, MAX, MBITS, EMIN, SUB, HW_FP8)
        if HW_FP8:
            byte |= sign
        tl.store(col_data_ptr + out_offs, byte.to(tl.uint8), mask=mask)
        sr = pid_m * NB + tl.arange(0, NB)
        smask = (sr[:, None] < M // 32) & (offs_n[None, :] < K)
        tl.store(col_scale_ptr + sr[:, None] * K + offs_n[None, :], e.to(tl.uint8), mask=smask)
    if DO_ROW:
        e = _e8m0_round_up(tl.max(tl.reshape(a, (NB, SPLIT, RS, BN // 32, 32)), axis=4) * INV_MAX)
        s = tl.reshape(x, (NB, SPLIT, RS, BN // 32, 32)) * _exp2_neg_biased(e)[:, :, :, :, None]
        s = tl.reshape(s, (NB, SPLIT, RS, BN))
        byte = _fp8_byte(s, MAX, MBITS, EMIN, SUB, HW_FP8)
        if HW_FP8:
            byte |= sign
        tl.store(row_data_ptr + out_offs, byte.to(tl.uint8), mask=mask)
        sc = (pid_n * (BN // 32) + tl.arange(0, BN // 32))[None, None, None, :]
        smask = (offs_m < M) & (sc < K // 32)
        tl.store(row_scale_ptr + offs_m * (K // 32) + sc, e.to(tl.uint8), mask=smask)


@triton.jit
def mxfp8_words_kernel(
    xw_ptr,
    M,
    KW,
    stride_mw,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    INV_MAX: tl.constexpr,
    MAX: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    SUB: tl.constexpr,
    HW_FP8: tl.constexpr,
    MAXNUM: tl.constexpr,
    DO_ROW: tl.constexpr,
    SPLIT: tl.constexpr,
    G: tl.constexpr,
    CW: tl.constexpr,
):
    """Columnwise (and with DO_ROW rowwise) MXFP8 of a bf16 [M, K] source seen as int64 words
    xw [M, KW = K/4] (row stride stride_mw words). Data outputs are int32 views [M, KW] (4 bytes
    per word, column 4w + j in byte j), the columnwise scales an int32 view [M/32, KW], the
    rowwise scales uint8 [M, K/32]. A program covers 32 rows x G * CW words, as a tile
    [SPLIT, G, 32 / SPLIT, CW]: Triton fills dimensions in that order, so SPLIT threads of one
    warp share the 32 rows of a block and the warps take column groups G; a column maximum is
    32 / SPLIT register maxima plus log2(SPLIT) shuffles, with no shared memory and no barrier."""
    RS: tl.constexpr = 32 // SPLIT
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    half = tl.arange(0, SPLIT)[:, None, None, None]
    grp = tl.arange(0, G)[None, :, None, None]
    row = tl.arange(0, RS)[None, None, :, None]
    word = tl.arange(0, CW)[None, None, None, :]
    offs_m = pid_m * 32 + half * RS + row
    offs_w = pid_n * (G * CW) + grp * CW + word
    mask = (offs_m < M) & (offs_w < KW)
    w = tl.load(xw_ptr + offs_m * stride_mw + offs_w, mask=mask, other=0)
    x0, x1, x2, x3 = bf16_lanes(w)
    signs = _bf16_signs(w)
    a0 = abs_for_max(x0, MAXNUM)
    a1 = abs_for_max(x1, MAXNUM)
    a2 = abs_for_max(x2, MAXNUM)
    a3 = abs_for_max(x3, MAXNUM)
    out_offs = offs_m * KW + offs_w

    # columnwise: 32-row maxima, per lane j of the words: [G, CW] each
    e0 = _e8m0_round_up(nan_to_0(tl.max(tl.max(a0, axis=2), axis=0), MAXNUM) * INV_MAX)
    e1 = _e8m0_round_up(nan_to_0(tl.max(tl.max(a1, axis=2), axis=0), MAXNUM) * INV_MAX)
    e2 = _e8m0_round_up(nan_to_0(tl.max(tl.max(a2, axis=2), axis=0), MAXNUM) * INV_MAX)
    e3 = _e8m0_round_up(nan_to_0(tl.max(tl.max(a3, axis=2), axis=0), MAXNUM) * INV_MAX)
    f0 = _exp2_neg_biased(e0)[None, :, None, :]
    f1 = _exp2_neg_biased(e1)[None, :, None, :]
    f2 = _exp2_neg_biased(e2)[None, :, None, :]
    f3 = _exp2_neg_biased(e3)[None, :, None, :]
    packed = _fp8_word(signs, x0, x1, x2, x3, f0, f1, f2, f3, MAX, MBITS, EMIN, SUB, HW_FP8)
    tl.store(col_data_ptr + out_offs, packed, mask=mask)
    sw = pid_n * (G * CW) + tl.arange(0, G)[:, None] * CW + tl.arange(0, CW)[None, :]
    swords = e0 | (e1 << 8) | (e2 << 16) | (e3 << 24)
    # The scale row as a block, not a scalar compare joined to a block mask: Triton 3.9's
    # interpreter materialises a broadcast scalar compare as int32 and rejects it as a mask.
    srow = pid_m + tl.zeros((G, CW), dtype=tl.int32)
    smask = (srow < M // 32) & (sw < KW)
    tl.store(col_scale_ptr + srow * KW + sw, swords, mask=smask)

    if DO_ROW:
        # rowwise: 32-column maxima = 8 words, two threads' worth
        am = tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))
        am = tl.reshape(am, (SPLIT, G, RS, CW // 8, 8))
        e = _e8m0_round_up(nan_to_0(tl.max(am, axis=4), MAXNUM) * INV_MAX)
        f = _exp2_neg_biased(e)
        f = tl.broadcast_to(f[:, :, :, :, None], (SPLIT, G, RS, CW // 8, 8))
        f = tl.reshape(f, (SPLIT, G, RS, CW))
        packed = _fp8_word(signs, x0, x1, x2, x3, f, f, f, f, MAX, MBITS, EMIN, SUB, HW_FP8)
        tl.store(row_data_ptr + out_offs, packed, mask=mask)
        sb = (pid_n * (G * CW) + grp * CW) // 8 + tl.arange(0, CW // 8)[None, None, None, :]
        tl.store(
            row_scale_ptr + offs_m * (KW // 8) + sb,
            e.to(tl.uint8),
            mask=(offs_m < M) & (sb < KW // 8),
        )

"""NVFP4 Triton kernels for bf16 sources with unit column stride, read as 64-bit words (4 bf16),
bit-identical to `nvfp4.quantize_reference`: nibbles written as packed words in the same tile
shape, block maxima and nibble packing in registers.

- `nvfp4_row_words_kernel`: rowwise and the contiguous RHT copy, with or without SR (Philox
  bytes per block, made in the kernel).
- `nvfp4_col_words_kernel`: columnwise, no RHT, no SR.

The element encoders and block scales are `nvfp4.py`'s, shared with the strided kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import abs_for_max, bf16_lanes, nan_to_0
from .nvfp4 import _block_scale, _e2m1_lane, _global_scales


@triton.jit
def nvfp4_row_words_kernel(
    xw_ptr,
    R,
    CWT,
    stride_rw,
    amax_ptr,
    seed_ptr,
    data_ptr,
    scale_ptr,
    INV_6: tl.constexpr,
    LEGACY: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    SR: tl.constexpr,
    HW_FP8: tl.constexpr,
    MAXNUM: tl.constexpr,
    BR: tl.constexpr,
    CW: tl.constexpr,
    PER_ROW: tl.constexpr = False,
):
    """NVFP4 along the last dim of a bf16 [R, C] source seen as int64 words xw [R, CWT = C/4]
    (row stride stride_rw words). Data is written as an int16 view [R, C/4] (the 4 nibbles of a
    word, element 0 lowest), scales uint8 [R, C/16]; SR bits are Philox bytes per block (keyed by
    the int64 at seed_ptr, counter = the block's index in [R, C/16]: `elements.block_random_bits`),
    the block's four 32-bit words one per data word.
    A program covers BR rows x CW words: the 64-bit loads and the 16-bit stores of their four
    nibbles have one tile shape, so one layout with whole 16-element blocks in each thread (block
    maxima in registers: no shuffle, and no shared memory for 1D blocks)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BR + tl.arange(0, BR)[:, None]
    offs_w = pid_c * CW + tl.arange(0, CW)[None, :]
    mask = (offs_r < R) & (offs_w < CWT)
    w = tl.load(xw_ptr + offs_r * stride_rw + offs_w, mask=mask, other=0)
    x0, x1, x2, x3 = bf16_lanes(w)
    s_enc, s_dec = _global_scales(amax_ptr, offs_r, offs_r < R, PER_ROW)
    am = tl.maximum(
        tl.maximum(abs_for_max(x0, MAXNUM), abs_for_max(x1, MAXNUM)),
        tl.maximum(abs_for_max(x2, MAXNUM), abs_for_max(x3, MAXNUM)),
    )
    if BLOCK_2D:
        t = tl.max(tl.max(tl.reshape(am, (BR // 16, 16, CW // 4, 4)), axis=3), axis=1)
        vec = tl.broadcast_to(t[:, None, :], (BR // 16, 16, CW // 4))
        vec = tl.reshape(vec, (BR, CW // 4))
    else:
        vec = tl.max(tl.reshape(am, (BR, CW // 4, 4)), axis=2)
    sbyte, enc = _block_scale(nan_to_0(vec, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    enc = tl.reshape(tl.broadcast_to(enc[:, :, None], (BR, CW // 4, 4)), (BR, CW))
    sc = pid_c * (CW // 4) + tl.arange(0, CW // 4)[None, :]
    if SR:
        w0, w1, w2, w3 = tl.randint4x(tl.load(seed_ptr), offs_r.to(tl.int64) * (CWT // 4) + sc)
        r = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BR, CW))  # w0 w1 w2 w3
    else:
        r = 0
    word = _e2m1_lane(x0 * enc, r, 0, SR, MAXNUM)
    word |= _e2m1_lane(x1 * enc, r, 1, SR, MAXNUM)
    word |= _e2m1_lane(x2 * enc, r, 2, SR, MAXNUM)
    word |= _e2m1_lane(x3 * enc, r, 3, SR, MAXNUM)
    tl.store(data_ptr + offs_r * CWT + offs_w, word.to(tl.int16), mask=mask)
    smask = (offs_r < R) & (sc < CWT // 4)
    tl.store(scale_ptr + offs_r * (CWT // 4) + sc, sbyte, mask=smask)


@triton.jit
def nvfp4_col_words_kernel(
    xw_ptr,
    M,
    KW,
    stride_mw,
    amax_ptr,
    data_ptr,
    scale_ptr,
    INV_6: tl.constexpr,
    LEGACY: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    HW_FP8: tl.constexpr,
    MAXNUM: tl.constexpr,
    NB: tl.constexpr,
    CW: tl.constexpr,
    PER_ROW: tl.constexpr = False,
):
    """NVFP4 down the columns of a bf16 [M, K] source seen as int64 words xw [M, KW = K/4] (row
    stride stride_mw words), written transposed: data as an int64 view [K, M/16] (one word per
    column and 16-row block), scales uint8 [K, M/16]. A program covers NB blocks x CW words,
    read as two [NB, 8 rows, CW] tiles (the top and bottom halves of each 16-row block). Triton
    lays a tile out from its contiguous dimension (words) and then in index order, the last
    dimension taking what is left: threads and warps go to words and blocks, and every thread
    holds whole 8-row columns, so block maxima and nibble packing run in its registers and a
    column's 16 codes form one 64-bit word of the transposed output (row 2j in the low nibble of
    byte j), stored as it is."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blk = pid_m * NB + tl.arange(0, NB)[:, None, None]
    row = tl.arange(0, 8)[None, :, None]
    offs_w = pid_n * CW + tl.arange(0, CW)[None, None, :]
    mask = (blk < M // 16) & (offs_w < KW)
    top = tl.load(xw_ptr + (blk * 16 + row) * stride_mw + offs_w, mask=mask, other=0)
    bot = tl.load(xw_ptr + (blk * 16 + 8 + row) * stride_mw + offs_w, mask=mask, other=0)
    t0, t1, t2, t3 = bf16_lanes(top)
    b0, b1, b2, b3 = bf16_lanes(bot)
    first = pid_m * NB + tl.arange(0, NB)[:, None]  # a block's first row names its group
    s_enc, s_dec = _global_scales(amax_ptr, first * 16, first < M // 16, PER_ROW)
    v0 = tl.max(tl.maximum(abs_for_max(t0, MAXNUM), abs_for_max(b0, MAXNUM)), axis=1)
    v1 = tl.max(tl.maximum(abs_for_max(t1, MAXNUM), abs_for_max(b1, MAXNUM)), axis=1)
    v2 = tl.max(tl.maximum(abs_for_max(t2, MAXNUM), abs_for_max(b2, MAXNUM)), axis=1)
    v3 = tl.max(tl.maximum(abs_for_max(t3, MAXNUM), abs_for_max(b3, MAXNUM)), axis=1)
    if BLOCK_2D:  # 16x16 tiles: 16 columns are 4 words, one maximum for all four lanes
        t = tl.maximum(tl.maximum(v0, v1), tl.maximum(v2, v3))
        t = tl.max(tl.reshape(t, (NB, CW // 4, 4)), axis=2)
        v0 = tl.reshape(tl.broadcast_to(t[:, :, None], (NB, CW // 4, 4)), (NB, CW))
        v1 = v0
        v2 = v0
        v3 = v0
    blk2 = pid_m * NB + tl.arange(0, NB)[:, None]
    col = 4 * (pid_n * CW + tl.arange(0, CW)[None, :])
    omask = (blk2 < M // 16) & (col < 4 * KW)
    # each lane's scale right before its store: computing all four first keeps more registers
    # live, which makes the kernel slower (docs/PERF.md)
    s0, e0 = _block_scale(nan_to_0(v0, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _col_store(t0, b0, e0, s0, data_ptr, scale_ptr, col, blk2, M, omask)
    s1, e1 = _block_scale(nan_to_0(v1, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _col_store(t1, b1, e1, s1, data_ptr, scale_ptr, col + 1, blk2, M, omask)
    s2, e2 = _block_scale(nan_to_0(v2, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _col_store(t2, b2, e2, s2, data_ptr, scale_ptr, col + 2, blk2, M, omask)
    s3, e3 = _block_scale(nan_to_0(v3, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _col_store(t3, b3, e3, s3, data_ptr, scale_ptr, col + 3, blk2, M, omask)


@triton.jit
def _e2m1_column_word(x, enc, ROWS: tl.constexpr):
    """The codes of x * enc [blocks, ROWS, words] (ROWS <= 8) packed down dim 1 into int32
    nibbles, row 0 lowest."""
    shift = (tl.arange(0, ROWS) * 4)[None, :, None]
    return tl.sum(_e2m1_lane(x * enc[:, None, :], 0, 0, False) << shift, axis=1)


@triton.jit
def _col_store(top, bot, enc, sbyte, data_ptr, scale_ptr, col, blk, M, mask):
    """One lane of the column kernel: its [NB, CW] output words and scale bytes."""
    lo = _e2m1_column_word(top, enc, 8).to(tl.int64) & 0xFFFFFFFF
    hi = _e2m1_column_word(bot, enc, 8).to(tl.int64) << 32
    out = col * (M // 16) + blk
    tl.store(data_ptr + out, lo | hi, mask=mask)
    tl.store(scale_ptr + out, sbyte, mask=mask)

"""Triton kernels for the hot quantize paths (imported only where Triton is importable).

Bit-identical to the torch reference by construction: every float operation is one IEEE op in the
same order as the reference (divisions are `div_rn`; kernels are compiled without fp contraction,
so no multiply-add is fused). FP8 bytes (MXFP8 elements, NVFP4 E4M3 block scales) come from the
hardware conversion on sm_90 and later (`cvt.rn.satfinite`, nearest even, the reference's rule;
NaN patched), because the bit-field version made the kernels instruction-bound; elsewhere
(Triton's interpreter, older GPUs: no FP8 type before sm_89, and a conversion through fp16 on
sm_89) from bit fields. Two variants: "v2", for any strides and dtypes, and "v3", for bf16 with
unit column stride, read as 64-bit words. The GPU tests compare every byte with the reference,
NaN, inf, -0.0 and subnormals included. See `triton_kernels.py` for the Python entry points.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _fp8_bytes(s, MAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, SUB: tl.constexpr):
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
def _e8m0_round_up(v):
    """TE's E8M0 byte (int32) of a non-negative float32 v."""
    bits = v.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != 0xFE) & ((exp != 0) | (mant > 0x400000))
    e = exp + up.to(tl.int32)
    return tl.where(exp == 0xFF, tl.where(mant == 0, 0xFE, 0xFF), e)


@triton.jit
def _exp2_neg_biased(e):
    """Exact float32 2^(127 - e) for an E8M0 byte e (int32); 0xFF gives NaN."""
    kb = 254 - e
    bits = tl.where(kb >= 1, kb << 23, 0x00400000)
    bits = tl.where(e == 0xFF, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


# --- variant "v2" -----------------------------------------------------------------------------
# The same bytes with fewer instructions per element than the first kernels ("v1", measured
# instruction-bound on the H200 and removed once v2 and v3 beat them on every kernel; their
# numbers stay in docs/PERF.md). Counted offline from the sm_90 SASS of the 8192x8192 problem
# (thread instructions per element, v1 -> v2): MXFP8 rowwise 17 -> 11, columnwise 42 -> 16,
# row+col 54 -> 21; NVFP4 rowwise 54 -> 30, columnwise 103 -> 23. How:
# - E2M1 codes by arithmetic (`_e2m1_code`), no clamp to +-6 (the code saturates by itself);
# - the E4M3 block scale by the hardware conversion where HW_FP8 (sm_90+), as MXFP8 elements;
# - MXFP8 NaN fix-up as one OR of the sign bit (the hardware gives 0x7F for every NaN and keeps
#   the sign of every other value);
# - columnwise kernels read the source in memory order as [blocks, rows, cols] tiles, laid out so
#   that each thread holds whole columns of a block: the block reduction runs in registers and
#   only the packed bytes are transposed, no bf16 tile goes through shared memory;
# - launched with fp-contraction off (`enable_fp_fusion=False`), so no multiply-add is ever fused.


@triton.jit
def _e2m1_code(m):
    """E2M1 magnitude code (int32, 0-7) of a non-negative float32 m, nearest even; values past
    6, inf and NaN give 7. The grid step is 0.5 below 2, 1 on [2, 4), 2 from 4 on; adding
    magic = step * 2^23 rounds m to a multiple of step (one IEEE add, nearest even), and the
    sum's low bits count the steps: code = steps + 2 * (exponent above 1)."""
    ec = tl.minimum(tl.maximum(m.to(tl.int32, bitcast=True) >> 23, 127), 129)
    magic = (ec + 22) << 23
    steps = (m + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic
    return tl.minimum(steps + 2 * (ec - 127), 7)


@triton.jit
def _e2m1_sr_grid(v, r):
    """Stochastic rounding of float32 v to the E2M1 grid (magnitude, float32) with 8 random bits r:
    the reference's formula, step for step (clamp to 6, NaN -> 6)."""
    v = tl.where(v > 6.0, 6.0, tl.where(v < -6.0, -6.0, v))
    m = tl.abs(v)
    m = tl.where(m != m, 6.0, m)
    u = r.to(tl.float32) * 0.00390625
    step = tl.where(m < 2.0, 0.5, tl.where(m < 4.0, 1.0, 2.0))
    t = m + u * step
    step_t = tl.where(t < 2.0, 0.5, tl.where(t < 4.0, 1.0, 2.0))
    inv_step_t = tl.where(t < 2.0, 2.0, tl.where(t < 4.0, 1.0, 0.5))
    return tl.minimum(tl.floor(t * inv_step_t) * step_t, 6.0)


@triton.jit
def _e4m3_scale(s, HW_FP8: tl.constexpr):
    """E4M3 byte (uint8) and its float32 value of a non-negative, non-NaN float32 s."""
    if HW_FP8:
        q = s.to(tl.float8e4nv)  # nearest even, saturating at 448
        byte = q.to(tl.uint8, bitcast=True)
        value = q.to(tl.float32)
    else:
        byte, value = _fp8_bytes(s, 448.0, 3, -6, 512.0)
        byte = byte.to(tl.uint8)
    return byte, value


@triton.jit
def _nvfp4_global_scales(amax_ptr):
    amax = tl.load(amax_ptr)
    s_enc = tl.minimum(tl.math.div_rn(2688.0, amax), FLT_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    return s_enc, tl.math.div_rn(1.0, s_enc)


@triton.jit
def _nvfp4_block_scale(vec, s_enc, s_dec, INV_6: tl.constexpr, LEGACY: tl.constexpr, HW_FP8):
    """Steps 3-4: scale byte and encode factor of block maxima `vec`."""
    if LEGACY:
        s = tl.math.div_rn(vec, 6.0) * s_enc
    else:
        s = vec * (s_enc * INV_6)
    sbyte, sq = _e4m3_scale(tl.minimum(s, FLT_MAX), HW_FP8)
    return sbyte, tl.minimum(tl.math.div_rn(1.0, sq * s_dec), FLT_MAX)


@triton.jit
def _mxfp8_kernel_v2(
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
    """A BM x BN tile read once as [BM/32 blocks, SPLIT, 32/SPLIT rows, BN]: each thread holds
    32/SPLIT rows of a column block, so the 32-row (columnwise) maximum is a register reduction
    plus log2(SPLIT) shuffles; the 32-column (rowwise) maximum reshapes the last dim."""
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
        if HW_FP8:
            byte = _fp8_hw_bits(s, MBITS) | sign
        else:
            byte, _ = _fp8_bytes(s, MAX, MBITS, EMIN, SUB)
        tl.store(col_data_ptr + out_offs, byte.to(tl.uint8), mask=mask)
        sr = pid_m * NB + tl.arange(0, NB)
        smask = (sr[:, None] < M // 32) & (offs_n[None, :] < K)
        tl.store(col_scale_ptr + sr[:, None] * K + offs_n[None, :], e.to(tl.uint8), mask=smask)
    if DO_ROW:
        e = _e8m0_round_up(tl.max(tl.reshape(a, (NB, SPLIT, RS, BN // 32, 32)), axis=4) * INV_MAX)
        s = tl.reshape(x, (NB, SPLIT, RS, BN // 32, 32)) * _exp2_neg_biased(e)[:, :, :, :, None]
        s = tl.reshape(s, (NB, SPLIT, RS, BN))
        if HW_FP8:
            byte = _fp8_hw_bits(s, MBITS) | sign
        else:
            byte, _ = _fp8_bytes(s, MAX, MBITS, EMIN, SUB)
        tl.store(row_data_ptr + out_offs, byte.to(tl.uint8), mask=mask)
        sc = (pid_n * (BN // 32) + tl.arange(0, BN // 32))[None, None, None, :]
        smask = (offs_m < M) & (sc < K // 32)
        tl.store(row_scale_ptr + offs_m * (K // 32) + sc, e.to(tl.uint8), mask=smask)


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
def amax_kernel_v2(x_ptr, N, amax_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """amax_kernel with BLOCK elements per load round (BLOCK / threads elements, several 16-byte
    loads in flight per thread) and ITERS rounds per program before its one atomic max."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = tl.program_id(0).to(tl.int64) * (ITERS * BLOCK)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, tl.where(a != a, 0.0, a))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _nvfp4_row_kernel_v2(
    src_ptr,
    R,
    C,
    stride_r,
    stride_c,
    amax_ptr,
    rbits_ptr,
    data_ptr,
    scale_ptr,
    INV_6: tl.constexpr,
    LEGACY: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    SR: tl.constexpr,
    HW_FP8: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """NVFP4 along the last dim of a row-major [R, C] source (rowwise, or the contiguous RHT copy)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BR + tl.arange(0, BR)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    x = tl.load(
        src_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0
    ).to(tl.float32)
    s_enc, s_dec = _nvfp4_global_scales(amax_ptr)
    a = tl.abs(x)
    a = tl.where(a != a, 0.0, a)
    if BLOCK_2D:
        t = tl.max(tl.max(tl.reshape(a, (BR // 16, 16, BC // 16, 16)), axis=3), axis=1)
        vec = tl.reshape(tl.broadcast_to(t[:, None, :], (BR // 16, 16, BC // 16)), (BR, BC // 16))
    else:
        vec = tl.max(tl.reshape(a, (BR, BC // 16, 16)), axis=2)
    sbyte, enc = _nvfp4_block_scale(vec, s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    v = tl.reshape(tl.reshape(x, (BR, BC // 16, 16)) * enc[:, :, None], (BR, BC))
    if SR:
        r = tl.load(rbits_ptr + offs_r[:, None] * C + offs_c[None, :], mask=mask, other=0)
        m = _e2m1_sr_grid(v, r)
    else:
        m = tl.abs(v)
    code = _e2m1_code(m) | tl.where(v < 0.0, 8, 0)
    lo, hi = tl.split(tl.reshape(code, (BR, BC // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    dc = pid_c * (BC // 2) + tl.arange(0, BC // 2)
    dmask = (offs_r[:, None] < R) & (dc[None, :] < C // 2)
    tl.store(data_ptr + offs_r[:, None] * (C // 2) + dc[None, :], packed, mask=dmask)
    sc = pid_c * (BC // 16) + tl.arange(0, BC // 16)
    smask = (offs_r[:, None] < R) & (sc[None, :] < C // 16)
    tl.store(scale_ptr + offs_r[:, None] * (C // 16) + sc[None, :], sbyte, mask=smask)


@triton.jit
def _nvfp4_col_kernel_v2(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    amax_ptr,
    rbits_ptr,
    data_ptr,
    scale_ptr,
    INV_6: tl.constexpr,
    LEGACY: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    SR: tl.constexpr,
    HW_FP8: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    """NVFP4 columnwise of x [M, K] (16x1 blocks down the columns), written transposed: data
    [K, M/2], scales [K, M/16]. The tile is read in x's order as [BM/16 blocks, 16 rows, BK]; with
    enough blocks x columns to occupy every thread, each thread holds all 16 rows of its columns,
    so block maxima and nibble pairs stay in registers."""
    NB: tl.constexpr = BM // 16
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    blk = tl.arange(0, NB)
    offs_k = pid_k * BK + tl.arange(0, BK)
    col = offs_k[None, None, :]
    offs_m = pid_m * BM + blk[:, None, None] * 16 + tl.arange(0, 16)[None, :, None]
    mask = (offs_m < M) & (col < K)
    x = tl.load(x_ptr + offs_m * stride_m + col * stride_k, mask=mask, other=0.0).to(tl.float32)
    s_enc, s_dec = _nvfp4_global_scales(amax_ptr)
    a = tl.abs(x)
    a = tl.where(a != a, 0.0, a)
    vec = tl.max(a, axis=1)  # [NB, BK]
    if BLOCK_2D:
        t = tl.max(tl.reshape(vec, (NB, BK // 16, 16)), axis=2)
        vec = tl.reshape(tl.broadcast_to(t[:, :, None], (NB, BK // 16, 16)), (NB, BK))
    sbyte, enc = _nvfp4_block_scale(vec, s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    v = x * enc[:, None, :]
    if SR:  # the bits are drawn for the transposed [K, M] source, as the reference draws them
        r = tl.load(rbits_ptr + col * M + offs_m, mask=mask, other=0)
        m = _e2m1_sr_grid(v, r)
    else:
        m = tl.abs(v)
    code = _e2m1_code(m) | tl.where(v < 0.0, 8, 0)
    # rows 2j and 2j+1 of a block -> byte j, low nibble first
    shift = (tl.arange(0, 2) * 4)[None, None, :, None]
    packed = tl.sum(tl.reshape(code, (NB, 8, 2, BK)) << shift, axis=2).to(tl.uint8)
    dm = (pid_m * BM) // 2 + blk[:, None, None] * 8 + tl.arange(0, 8)[None, :, None]
    dmask = (dm < M // 2) & (col < K)
    tl.store(data_ptr + col * (M // 2) + dm, packed, mask=dmask)
    sm = pid_m * NB + blk[:, None]
    smask = (sm < M // 16) & (offs_k[None, :] < K)
    tl.store(scale_ptr + offs_k[None, :] * (M // 16) + sm, sbyte, mask=smask)


# --- variant "v3" -----------------------------------------------------------------------------
# MXFP8 with a columnwise part (columnwise alone, and row+col in one pass) and NVFP4 rowwise, for
# bf16 sources with unit column stride (the launcher runs v2 otherwise). v2's MXFP8 tile put the
# 32 rows of a column block across two warps: a shared-memory exchange with barriers for every
# block maximum, and 40 shuffles per thread. v3 reads the source as 64-bit words (4 bf16) and
# stores 32-bit words (4 FP8 bytes): the load and the store have the same tile shape, so Triton
# gives them one layout, 4 words (16 columns) per thread, 2 x 16-byte loads and 1 x 16-byte store
# per row and direction. The tile [SPLIT, G, 32 / SPLIT, CW] puts SPLIT threads of one warp on the
# 32 rows of a block and the warps on column groups G (Triton fills dimensions in that order), so
# a column maximum is 32 / SPLIT register maxima plus log2(SPLIT) shuffles, and no barrier. Block
# maxima take NaN out with the GPU's NaN-ignoring maximum (MAXNUM) instead of a compare and select
# per element. Counted offline from the sm_90 SASS of the 8192x8192 problem (bench/quant_sass.py;
# thread instructions per element, v2 -> v3): MXFP8 columnwise 16.2 -> 11.4, row+col 21.2 -> 17.5;
# NVFP4 rowwise 29.8 -> 21.5 (1D), 30.1 -> 21.3 (2D).


@triton.jit
def _bf16_lanes(w):
    """The four bf16 of 64-bit words w as float32 (exact), element 0 in the low bits."""
    lo = w.to(tl.int32)
    hi = (w >> 32).to(tl.int32)
    x0 = (lo << 16).to(tl.float32, bitcast=True)
    x1 = (lo & -65536).to(tl.float32, bitcast=True)
    x2 = (hi << 16).to(tl.float32, bitcast=True)
    x3 = (hi & -65536).to(tl.float32, bitcast=True)
    return x0, x1, x2, x3


@triton.jit
def _abs_for_max(x, MAXNUM: tl.constexpr):
    """|x| for a block maximum that ignores NaN. MAXNUM (compiled kernels): `tl.max` and
    `tl.maximum` are IEEE maxNum there (max.f32 returns the non-NaN operand), so NaN drops out by
    itself and `_nan_to_0` maps an all-NaN block's NaN to 0; otherwise (Triton's interpreter,
    whose maximum propagates NaN) NaN is replaced by 0 here, one compare and select more per
    element."""
    a = tl.abs(x)
    if not MAXNUM:
        a = tl.where(a != a, 0.0, a)
    return a


@triton.jit
def _nan_to_0(amax, MAXNUM: tl.constexpr):
    if MAXNUM:
        amax = tl.maximum(amax, 0.0)
    return amax


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
    if HW_FP8:
        byte = _fp8_hw_bits(s, MBITS)
    else:
        byte, _ = _fp8_bytes(s, MAX, MBITS, EMIN, SUB)
    byte = tl.reshape(byte, x0.shape + (4,)).to(tl.int32)
    word = tl.sum(byte << (tl.arange(0, 4) * 8), axis=len(x0.shape))
    if HW_FP8:
        word |= signs
    return word


@triton.jit
def _mxfp8_kernel_v3(
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
    rowwise scales uint8 [M, K/32]. A program covers 32 rows x G * CW words."""
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
    x0, x1, x2, x3 = _bf16_lanes(w)
    signs = _bf16_signs(w)
    a0 = _abs_for_max(x0, MAXNUM)
    a1 = _abs_for_max(x1, MAXNUM)
    a2 = _abs_for_max(x2, MAXNUM)
    a3 = _abs_for_max(x3, MAXNUM)
    out_offs = offs_m * KW + offs_w

    # columnwise: 32-row maxima, per lane j of the words: [G, CW] each
    e0 = _e8m0_round_up(_nan_to_0(tl.max(tl.max(a0, axis=2), axis=0), MAXNUM) * INV_MAX)
    e1 = _e8m0_round_up(_nan_to_0(tl.max(tl.max(a1, axis=2), axis=0), MAXNUM) * INV_MAX)
    e2 = _e8m0_round_up(_nan_to_0(tl.max(tl.max(a2, axis=2), axis=0), MAXNUM) * INV_MAX)
    e3 = _e8m0_round_up(_nan_to_0(tl.max(tl.max(a3, axis=2), axis=0), MAXNUM) * INV_MAX)
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
        e = _e8m0_round_up(_nan_to_0(tl.max(am, axis=4), MAXNUM) * INV_MAX)
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


# NVFP4 rowwise (and the contiguous RHT copy) for bf16 sources with unit column stride, by the
# same word trick: 64-bit loads of 4 bf16 and 16-bit stores of their 4 nibbles have one tile
# shape, so one layout with 8 words (two 16-element blocks) per thread and row: 4 x 16-byte loads
# and one 16-byte store, block maxima in registers (no shuffle, no shared memory for 1D blocks).


@triton.jit
def _nvfp4_row_kernel_v3(
    xw_ptr,
    R,
    CWT,
    stride_rw,
    amax_ptr,
    rbits_ptr,
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
):
    """NVFP4 along the last dim of a bf16 [R, C] source seen as int64 words xw [R, CWT = C/4]
    (row stride stride_rw words). Data is written as an int16 view [R, C/4] (the 4 nibbles of a
    word, element 0 lowest), scales uint8 [R, C/16]; SR bits are read as an int32 view [R, C/4].
    A program covers BR rows x CW words."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BR + tl.arange(0, BR)[:, None]
    offs_w = pid_c * CW + tl.arange(0, CW)[None, :]
    mask = (offs_r < R) & (offs_w < CWT)
    w = tl.load(xw_ptr + offs_r * stride_rw + offs_w, mask=mask, other=0)
    x0, x1, x2, x3 = _bf16_lanes(w)
    s_enc, s_dec = _nvfp4_global_scales(amax_ptr)
    am = tl.maximum(
        tl.maximum(_abs_for_max(x0, MAXNUM), _abs_for_max(x1, MAXNUM)),
        tl.maximum(_abs_for_max(x2, MAXNUM), _abs_for_max(x3, MAXNUM)),
    )
    if BLOCK_2D:
        t = tl.max(tl.max(tl.reshape(am, (BR // 16, 16, CW // 4, 4)), axis=3), axis=1)
        vec = tl.broadcast_to(t[:, None, :], (BR // 16, 16, CW // 4))
        vec = tl.reshape(vec, (BR, CW // 4))
    else:
        vec = tl.max(tl.reshape(am, (BR, CW // 4, 4)), axis=2)
    sbyte, enc = _nvfp4_block_scale(_nan_to_0(vec, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    enc = tl.reshape(tl.broadcast_to(enc[:, :, None], (BR, CW // 4, 4)), (BR, CW))
    if SR:
        r = tl.load(rbits_ptr + offs_r * CWT + offs_w, mask=mask, other=0)
    else:
        r = 0
    word = _e2m1_lane(x0 * enc, r, 0, SR)
    word |= _e2m1_lane(x1 * enc, r, 1, SR)
    word |= _e2m1_lane(x2 * enc, r, 2, SR)
    word |= _e2m1_lane(x3 * enc, r, 3, SR)
    tl.store(data_ptr + offs_r * CWT + offs_w, word.to(tl.int16), mask=mask)
    sc = pid_c * (CW // 4) + tl.arange(0, CW // 4)[None, :]
    smask = (offs_r < R) & (sc < CWT // 4)
    tl.store(scale_ptr + offs_r * (CWT // 4) + sc, sbyte, mask=smask)


@triton.jit
def _e2m1_lane(v, r, J: tl.constexpr, SR: tl.constexpr):
    """E2M1 code with sign (int32, 0-15) of float32 v, shifted to nibble J; SR with the random
    byte J of the int32 words r."""
    if SR:
        m = _e2m1_sr_grid(v, (r >> (8 * J)) & 0xFF)
    else:
        m = tl.abs(v)
    return (_e2m1_code(m) | tl.where(v < 0.0, 8, 0)) << (4 * J)


# NVFP4 columnwise (no RHT, no SR) for bf16 sources with unit column stride. v2 read bf16 in
# [blocks, 16 rows, columns] tiles and transposed its packed bytes through shared memory (each
# output row takes 8 bytes per block). v3 reads 64-bit words (4 columns) in two [blocks, 8 rows,
# words] tiles, the top and bottom halves of each 16-row block. Triton lays a tile out from its
# contiguous dimension (words) and then in index order, the last dimension taking what is left:
# threads and warps go to words and blocks, and every thread holds whole 8-row columns, so block
# maxima and nibble packing run in its registers. A column's 16 codes then form one 64-bit word
# of the transposed output (row 2j in the low nibble of byte j), stored as it is.


@triton.jit
def _e2m1_column_word(x, enc, ROWS: tl.constexpr):
    """The codes of x * enc [blocks, ROWS, words] (ROWS <= 8) packed down dim 1 into int32
    nibbles, row 0 lowest."""
    shift = (tl.arange(0, ROWS) * 4)[None, :, None]
    return tl.sum(_e2m1_lane(x * enc[:, None, :], 0, 0, False) << shift, axis=1)


@triton.jit
def _nvfp4_col_kernel_v3(
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
):
    """NVFP4 down the columns of a bf16 [M, K] source seen as int64 words xw [M, KW = K/4] (row
    stride stride_mw words), written transposed: data as an int64 view [K, M/16] (one word per
    column and 16-row block), scales uint8 [K, M/16]. A program covers NB blocks x CW words."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blk = pid_m * NB + tl.arange(0, NB)[:, None, None]
    row = tl.arange(0, 8)[None, :, None]
    offs_w = pid_n * CW + tl.arange(0, CW)[None, None, :]
    mask = (blk < M // 16) & (offs_w < KW)
    top = tl.load(xw_ptr + (blk * 16 + row) * stride_mw + offs_w, mask=mask, other=0)
    bot = tl.load(xw_ptr + (blk * 16 + 8 + row) * stride_mw + offs_w, mask=mask, other=0)
    t0, t1, t2, t3 = _bf16_lanes(top)
    b0, b1, b2, b3 = _bf16_lanes(bot)
    s_enc, s_dec = _nvfp4_global_scales(amax_ptr)
    v0 = tl.max(tl.maximum(_abs_for_max(t0, MAXNUM), _abs_for_max(b0, MAXNUM)), axis=1)
    v1 = tl.max(tl.maximum(_abs_for_max(t1, MAXNUM), _abs_for_max(b1, MAXNUM)), axis=1)
    v2 = tl.max(tl.maximum(_abs_for_max(t2, MAXNUM), _abs_for_max(b2, MAXNUM)), axis=1)
    v3 = tl.max(tl.maximum(_abs_for_max(t3, MAXNUM), _abs_for_max(b3, MAXNUM)), axis=1)
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
    # live and cost 20% (0.061 -> 0.074 ms on 8192x8192, H200)
    s0, e0 = _nvfp4_block_scale(_nan_to_0(v0, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _nvfp4_col_store(t0, b0, e0, s0, data_ptr, scale_ptr, col, blk2, M, omask)
    s1, e1 = _nvfp4_block_scale(_nan_to_0(v1, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _nvfp4_col_store(t1, b1, e1, s1, data_ptr, scale_ptr, col + 1, blk2, M, omask)
    s2, e2 = _nvfp4_block_scale(_nan_to_0(v2, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _nvfp4_col_store(t2, b2, e2, s2, data_ptr, scale_ptr, col + 2, blk2, M, omask)
    s3, e3 = _nvfp4_block_scale(_nan_to_0(v3, MAXNUM), s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    _nvfp4_col_store(t3, b3, e3, s3, data_ptr, scale_ptr, col + 3, blk2, M, omask)


@triton.jit
def _nvfp4_col_store(top, bot, enc, sbyte, data_ptr, scale_ptr, col, blk, M, mask):
    """One lane of the column kernel: its [NB, CW] output words and scale bytes."""
    lo = _e2m1_column_word(top, enc, 8).to(tl.int64) & 0xFFFFFFFF
    hi = _e2m1_column_word(bot, enc, 8).to(tl.int64) << 32
    out = col * (M // 16) + blk
    tl.store(data_ptr + out, lo | hi, mask=mask)
    tl.store(scale_ptr + out, sbyte, mask=mask)

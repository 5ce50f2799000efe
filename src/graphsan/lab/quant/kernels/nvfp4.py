"""NVFP4 Triton kernels, bit-identical to `nvfp4.quantize_reference`: the global amax, and the
quantize kernels that read it from a device buffer (no host sync).

- `amax_kernel`: max |x| ignoring NaN, one atomic max per program.
- `nvfp4_row_strided_kernel`, `nvfp4_col_strided_kernel`: any floating dtype and strides, with
  or without stochastic rounding (SR). The column kernel reads the source in its own order
  ([blocks, 16 rows, columns] tiles, each thread holding whole columns of a block, so the block
  reduction runs in registers) and writes the transposed layout.
- the element encoders and block scales every NVFP4 kernel shares (the bf16-words kernels of
  `nvfp4_words.py` and the fused column kernel of `nvfp4_col.py` too).

E2M1 codes come from arithmetic (`_e2m1_code`: no table, no clamp to +-6), the E4M3 block scale
from the hardware conversion where HW_FP8 (sm_90 and later), else from `fp8_bytes`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..formats import E2M1_MAX as _E2M1_MAX
from ..formats import E4M3_MAX as _E4M3_MAX
from ..formats import FP8_BITS
from ..formats import NVFP4_GLOBAL_MAX as _GLOBAL_MAX
from .common import FLT_MAX, abs_for_max, fp8_bytes

E2M1_MAX = tl.constexpr(_E2M1_MAX)
E4M3_MAX = tl.constexpr(_E4M3_MAX)
E4M3_MBITS, E4M3_EMIN, E4M3_SUB = (tl.constexpr(v) for v in FP8_BITS["e4m3"])
GLOBAL_MAX = tl.constexpr(_GLOBAL_MAX)


@triton.jit
def amax_kernel(x_ptr, N, amax_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """max |x| over N elements, NaN ignored, into the float32 at amax_ptr (which starts at 0):
    BLOCK elements per load round (several 16-byte loads in flight per thread) and ITERS rounds
    per program before its one atomic max."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = tl.program_id(0).to(tl.int64) * (ITERS * BLOCK)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        a = tl.abs(tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, tl.where(a != a, 0.0, a))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def group_amax_kernel(
    x_ptr,
    M,
    K,
    stride_m,
    stride_k,
    group_ptr,
    amax_ptr,
    G,
    BF16_BITS: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Per-group max |x| (NaN ignored) of x [M, K] whose row r belongs to group group_ptr[r]
    (int64; G for a row in no group, which is skipped) into amax_ptr[group] (float32, starting
    at 0). A program reduces BR rows over ITERS * BC columns, then makes one atomic max when its
    rows share a group (the usual case: groups span many rows) and one per row otherwise."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < M
    acc = tl.zeros((BR, BC), dtype=tl.float32)
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_m
    for i in range(ITERS):
        cols = (tl.program_id(1) * ITERS + i) * BC + tl.arange(0, BC)
        mask = rmask[:, None] & (cols < K)[None, :]
        v = tl.load(base + cols.to(tl.int64)[None, :] * stride_k, mask=mask, other=0)
        if BF16_BITS:
            v = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        a = tl.abs(v.to(tl.float32))
        acc = tl.maximum(acc, tl.where(a != a, 0.0, a))
    row_max = tl.max(acc, axis=1)
    group = tl.load(group_ptr + rows, mask=rmask, other=G)
    first = tl.min(group, axis=0)
    if first == tl.max(tl.where(rmask, group, first), axis=0):
        if first < G:
            tl.atomic_max(amax_ptr + first, tl.max(row_max, axis=0))
    else:
        tl.atomic_max(amax_ptr + group, row_max, mask=rmask & (group < G))


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
def _e2m1_clamp(v, MAXNUM: tl.constexpr):
    """min(|v|, 6), NaN -> 6: the magnitude the SR code and both field encoders start from, one
    helper so the three clamp NaN alike (MAXNUM, compiled kernels: the NaN-ignoring
    `tl.minimum` alone; else a select for NaN)."""
    m = tl.abs(v)
    if MAXNUM:
        m = tl.minimum(m, E2M1_MAX)
    else:
        m = tl.where(m != m, E2M1_MAX, tl.minimum(m, E2M1_MAX))
    return m


@triton.jit
def _e2m1_sr_code(v, r, J: tl.constexpr = 0, MAXNUM: tl.constexpr = False):
    """E2M1 magnitude code (int32, 0-7) of float32 v stochastically rounded with the 8 random
    bits in byte J of the 32-bit integers r: the reference's t = a + (r / 256) * step(a) for
    a = min(|v|, 6) (NaN -> 6), the same float operations, then the code of
    floor(t / step(t)) * step(t) read off t's bits (0 <= t < 8, so the reference's min(., 6)
    never acts). No int/float conversion (a quarter of the float rate or less on sm_90) and no
    compare: u * step(a) is (u / 2) * (2 step(a)), u / 2 the float 0.5 (1 + r / 256) whose
    mantissa holds the byte, minus 0.5, and 2 step(a) a's power of two clamped to [1, 4] (all
    exact, so t is the reference's); the code is 2 * (exponent - 127) + 2 + the mantissa's top
    bit for t >= 1, which is (bits >> 22) - 252, 1 on [0.5, 1) where (bits >> 23) - 125 is 1, 0
    below. MAXNUM (compiled kernels): NaN becomes 6 without a select (`_e2m1_clamp`)."""
    m = _e2m1_clamp(v, MAXNUM)
    r = r.to(tl.int32)
    if J < 2:
        b = r << (15 - 8 * J)
    else:
        b = r >> (8 * J - 15)
    half_u = ((b & 0x7F8000) | 0x3F000000).to(tl.float32, bitcast=True) - 0.5  # (r / 256) / 2
    # 2 step(a): a's power of two (0 below the normal range) clamped to [1, 4]
    two_step = (m.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    t = m + half_u * tl.minimum(tl.maximum(two_step, 1.0), 4.0)
    bits = t.to(tl.int32, bitcast=True)
    return tl.maximum(tl.maximum((bits >> 22) - 252, (bits >> 23) - 125), 0)


@triton.jit
def _e2m1_sr_field(v, r, J: tl.constexpr):
    """Compiled kernels only (inline PTX; NaN -> 6 through the NaN-ignoring minimum): a 32-bit
    value whose bits 22-24, XOR 4, are `_e2m1_sr_code(v, r, J)`, the magnitude code of v
    stochastically rounded with byte J of r. With a = min(|v|, 6), k the byte and t the
    reference's a + (k / 256) * step(a) (docs/numerics.md has the derivations; a CPU test checks
    them on every boundary with every byte):
    - a >= 1: step(a) is 2^22 units of a's last place, so bits(a) + (k << 14) crosses each code
      boundary where t does, and its bits 22-24 (XOR 4) are the code;
    - a < 1: the step is 0.5, so t = fl(a + k / 512) (one fused multiply-add: k << 16 read as a
      float is k * 2^-133, exact, times 2^124), and g = fl_rz(t / 2 + 1 / 2) (toward zero, so
      g >= 0.75 exactly when t >= 0.5 and g >= 1 when t >= 1) has the code in the same bits;
    - each of the two is at most the code where the other applies, and both are non-negative
      floats' bits, so their maximum is the answer."""
    a = _e2m1_clamp(v, True)
    # byte J alone in byte 2: one byte permute (the selector's 4s are zero bytes)
    k16 = tl.inline_asm_elementwise(
        f"prmt.b32 $0, $1, 0, {0x4044 + 0x100 * J};",
        "=r,r",
        [r],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )
    t = tl.fma(k16.to(tl.float32, bitcast=True), 2.0**124, a)
    g = tl.inline_asm_elementwise(
        "fma.rz.f32 $0, $1, 0f3F000000, 0f3F000000;",
        "=r,f",
        [t],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )
    return tl.maximum(a.to(tl.int32, bitcast=True) + (k16 >> 2), g)


@triton.jit
def _e2m1_rne_field(v, MAXNUM: tl.constexpr = False):
    """`_e2m1_code(|v|)` (nearest even) in `_e2m1_sr_field`'s form: bits 22-24, XOR 4, are the
    code. a = min(|v|, 6) (NaN -> 6); for a >= 1 the step is 2^22 units of a's last place, so
    bits(a) rounded to a multiple of 2^22, ties to even (add 2^21 - 1 and bit 22), has the code
    in those bits; below 1, fl(a + 2^22) rounds a to a multiple of 0.5, ties to the even
    multiple (the even code), and fma(that, 1/2, 1/2 - 2^21) = 1/2 + (the rounded a) / 2 is
    exact and has the code in the same bits. Each is at most the code where the other applies,
    so their maximum is the answer (a CPU test checks every boundary)."""
    a = _e2m1_clamp(v, MAXNUM)
    bits = a.to(tl.int32, bitcast=True)
    hi = bits + 0x1FFFFF + ((bits >> 22) & 1)
    lo = tl.fma(a + 4194304.0, 0.5, 0.5 - 2097152.0)
    return tl.maximum(hi, lo.to(tl.int32, bitcast=True))


@triton.jit
def _e2m1_lane(v, r, J: tl.constexpr, SR: tl.constexpr, MAXNUM: tl.constexpr = False):
    """E2M1 code with sign (int32, 0-15) of float32 v, shifted to nibble J; SR with the random
    byte J of the int32 words r (MAXNUM: as `_e2m1_sr_code`)."""
    if SR:
        mag = _e2m1_sr_code(v, r, J, MAXNUM)
    else:
        mag = _e2m1_code(tl.abs(v))
    return (mag | tl.where(v < 0.0, 8, 0)) << (4 * J)


@triton.jit
def _e4m3_scale(s, HW_FP8: tl.constexpr):
    """E4M3 byte (uint8) and its float32 value of a non-negative, non-NaN float32 s."""
    if HW_FP8:
        q = s.to(tl.float8e4nv)  # nearest even, saturating at 448
        byte = q.to(tl.uint8, bitcast=True)
        value = q.to(tl.float32)
    else:
        # `.value`: Triton's interpreter cannot shift an int by a constexpr
        byte, value = fp8_bytes(s, E4M3_MAX, E4M3_MBITS.value, E4M3_EMIN.value, E4M3_SUB)
        byte = byte.to(tl.uint8)
    return byte, value


@triton.jit
def _global_scales(amax_ptr, row=0, mask=True, PER_ROW: tl.constexpr = False):
    """S_enc and S_dec (step 1) of the amax at amax_ptr, or with PER_ROW of each row's own amax
    (amax_ptr[row], float32 [rows]: grouped quantization, the row's group's amax)."""
    if PER_ROW:
        amax = tl.load(amax_ptr + row, mask=mask, other=0.0)
    else:
        amax = tl.load(amax_ptr)
    s_enc = tl.minimum(tl.math.div_rn(GLOBAL_MAX, amax), FLT_MAX)
    s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    return s_enc, tl.math.div_rn(1.0, s_enc)


@triton.jit
def _block_scale(vec, s_enc, s_dec, INV_6: tl.constexpr, LEGACY: tl.constexpr, HW_FP8):
    """Steps 3-4: scale byte and encode factor of block maxima `vec`."""
    if LEGACY:
        s = tl.math.div_rn(vec, E2M1_MAX) * s_enc
    else:
        s = vec * (s_enc * INV_6)
    sbyte, sq = _e4m3_scale(tl.minimum(s, FLT_MAX), HW_FP8)
    return sbyte, tl.minimum(tl.math.div_rn(1.0, sq * s_dec), FLT_MAX)


@triton.jit
def nvfp4_row_strided_kernel(
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
    """NVFP4 along the last dim of an [R, C] source, any dtype and strides (rowwise, or the
    contiguous RHT copy): data [R, C/2], scales [R, C/16]; SR bits read as uint8 [R, C]."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = pid_r * BR + tl.arange(0, BR)
    offs_c = pid_c * BC + tl.arange(0, BC)
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    x = tl.load(
        src_ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c, mask=mask, other=0.0
    ).to(tl.float32)
    s_enc, s_dec = _global_scales(amax_ptr)
    a = abs_for_max(x, False)
    if BLOCK_2D:
        t = tl.max(tl.max(tl.reshape(a, (BR // 16, 16, BC // 16, 16)), axis=3), axis=1)
        vec = tl.reshape(tl.broadcast_to(t[:, None, :], (BR // 16, 16, BC // 16)), (BR, BC // 16))
    else:
        vec = tl.max(tl.reshape(a, (BR, BC // 16, 16)), axis=2)
    sbyte, enc = _block_scale(vec, s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    v = tl.reshape(tl.reshape(x, (BR, BC // 16, 16)) * enc[:, :, None], (BR, BC))
    r = 0
    if SR:
        r = tl.load(rbits_ptr + offs_r[:, None] * C + offs_c[None, :], mask=mask, other=0)
    code = _e2m1_lane(v, r, 0, SR)
    lo, hi = tl.split(tl.reshape(code, (BR, BC // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    dc = pid_c * (BC // 2) + tl.arange(0, BC // 2)
    dmask = (offs_r[:, None] < R) & (dc[None, :] < C // 2)
    tl.store(data_ptr + offs_r[:, None] * (C // 2) + dc[None, :], packed, mask=dmask)
    sc = pid_c * (BC // 16) + tl.arange(0, BC // 16)
    smask = (offs_r[:, None] < R) & (sc[None, :] < C // 16)
    tl.store(scale_ptr + offs_r[:, None] * (C // 16) + sc[None, :], sbyte, mask=smask)


@triton.jit
def nvfp4_col_strided_kernel(
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
    s_enc, s_dec = _global_scales(amax_ptr)
    a = abs_for_max(x, False)
    vec = tl.max(a, axis=1)  # [NB, BK]
    if BLOCK_2D:
        t = tl.max(tl.reshape(vec, (NB, BK // 16, 16)), axis=2)
        vec = tl.reshape(tl.broadcast_to(t[:, :, None], (NB, BK // 16, 16)), (NB, BK))
    sbyte, enc = _block_scale(vec, s_enc, s_dec, INV_6, LEGACY, HW_FP8)
    v = x * enc[:, None, :]
    r = 0
    if SR:  # the bits are drawn for the transposed [K, M] source, as the reference draws them
        r = tl.load(rbits_ptr + col * M + offs_m, mask=mask, other=0)
    code = _e2m1_lane(v, r, 0, SR)
    # rows 2j and 2j+1 of a block -> byte j, low nibble first
    shift = (tl.arange(0, 2) * 4)[None, None, :, None]
    packed = tl.sum(tl.reshape(code, (NB, 8, 2, BK)) << shift, axis=2).to(tl.uint8)
    dm = (pid_m * BM) // 2 + blk[:, None, None] * 8 + tl.arange(0, 8)[None, :, None]
    dmask = (dm < M // 2) & (col < K)
    tl.store(data_ptr + col * (M // 2) + dm, packed, mask=dmask)
    sm = pid_m * NB + blk[:, None]
    smask = (sm < M // 16) & (offs_k[None, :] < K)
    tl.store(scale_ptr + offs_k[None, :] * (M // 16) + sm, sbyte, mask=smask)

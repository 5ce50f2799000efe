"""The emulated low-precision GEMM in one Triton kernel: it reads the packed quantized operands
(MXFP8 bytes and E8M0 scales, NVFP4 nibbles and E4M3 scales) tile by tile, dequantizes each
tile in registers to exact bf16 (the values `linear.gemm_operand` makes in torch), multiplies
with float32 accumulation (`tl.dot`), and applies the per-tensor factor alpha in the epilogue,
optionally adding into a float32 output (the weight gradient's `main_grad`).

C[i, j] = alpha * sum_r A(i, r) B(j, r): both operands are addressed as [rows, reduction] with
their blocks along the reduction dim, which every GEMM of the quantized Linear has (the launcher
maps each operand's stored layout to strides). The result equals dequantize-then-GEMM up to the
order of the float32 accumulation (docs/numerics.md states the tolerance).

Element decodes are bit-field arithmetic, the same on the GPU and in Triton's interpreter: the
E2M1 value from its code, E4M3 and E5M2 bytes (subnormals, NaN, E5M2 inf), E8M0 scales (0x00 is
2^-127, 0xFF NaN). The product element x scale is exact in float32; its bf16 rounding (nearest
even, by bits) is exact for NVFP4 and for MXFP8 scale bytes >= 3 (E4M3) or 10 (E5M2), and
otherwise rounds as the torch emulation's cast does.
"""

from __future__ import annotations

import triton
import triton.language as tl

FMT_NVFP4 = tl.constexpr(0)
FMT_E4M3 = tl.constexpr(1)
FMT_E5M2 = tl.constexpr(2)


@triton.jit
def _e2m1_value(c):
    """float32 value of E2M1 codes c (int32, 0-15; code 8 is -0.0)."""
    mag = c & 7
    e = mag >> 1
    bits = tl.where(e == 0, (mag & 1) * (126 << 23), ((126 + e) << 23) | ((mag & 1) << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_value(b, EBITS: tl.constexpr, MBITS: tl.constexpr):
    """float32 value of FP8 bytes b (int32 0-255): E4M3 (4, 3; 0x7F NaN, no inf) or E5M2
    (5, 2; inf and NaN at the top exponent)."""
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    e = (b >> MBITS) & ((1 << EBITS) - 1)
    m = b & ((1 << MBITS) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
    if EBITS == 4:
        sub = m.to(tl.float32) * 0.001953125  # the E4M3 subnormal quantum 2^-9
    else:
        sub = m.to(tl.float32) * 0.0000152587890625  # E5M2: 2^-16
    v = tl.where(e == 0, sub, normal)
    if EBITS == 4:
        v = tl.where((e == 15) & (m == 7), float("nan"), v)
    else:
        v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
    # the sign by its bit: a negation may compile to 0 - v, which loses the sign of zero
    return (v.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_value(s):
    """float32 2^(s-127) of E8M0 bytes s (int32): 0x00 the subnormal 2^-127, 0xFF NaN."""
    v = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 255, float("nan"), v)


@triton.jit
def _bf16_bits(v):
    """float32 rounded to bf16, nearest even by bits, as float32 bits with the low half zero
    (int32); NaN stays NaN. Bit arithmetic rather than a bf16 cast: Triton's interpreter
    converts bf16 subnormals inexactly."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(v != v, bits, (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536)


@triton.jit
def _operand_tile(
    ptr,
    sptr,
    rows,
    r0,
    X,
    R,
    sx,
    sr,
    ssx,
    ssr,
    FMT: tl.constexpr,
    BX: tl.constexpr,
    BR: tl.constexpr,
):
    """The bf16 values of rows `rows` ([BX]) and reduction indices r0 .. r0 + BR of an operand:
    NVFP4 bytes at ptr + x * sx + (r // 2) * sr (element r even in the low nibble), E4M3 scales
    at sptr + x * ssx + (r // 16) * ssr; MXFP8 bytes at ptr + x * sx + r * sr, E8M0 scales at
    sptr + x * ssx + (r // 32) * ssr. Out-of-range entries are 0."""
    xm = (rows < X)[:, None]
    x64 = rows.to(tl.int64)[:, None]
    if FMT == 0:
        half = r0 // 2 + tl.arange(0, BR // 2)[None, :]
        b = tl.load(ptr + x64 * sx + half * sr, mask=xm & (half < R // 2), other=0).to(tl.int32)
        codes = tl.reshape(tl.join(b & 15, b >> 4), (BX, BR))
        blk = r0 // 16 + tl.arange(0, BR // 16)[None, :]
        s = tl.load(sptr + x64 * ssx + blk * ssr, mask=xm & (blk < R // 16), other=0)
        scale = _fp8_value(s.to(tl.int32), 4, 3)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BX, BR // 16, 16)), (BX, BR))
        v = _e2m1_value(codes) * scale
    else:
        r = r0 + tl.arange(0, BR)[None, :]
        b = tl.load(ptr + x64 * sx + r * sr, mask=xm & (r < R), other=0).to(tl.int32)
        if FMT == 1:
            elem = _fp8_value(b, 4, 3)
        else:
            elem = _fp8_value(b, 5, 2)
        blk = r0 // 32 + tl.arange(0, BR // 32)[None, :]
        s = tl.load(sptr + x64 * ssx + blk * ssr, mask=xm & (blk < R // 32), other=0)
        scale = _e8m0_value(s.to(tl.int32))
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BX, BR // 32, 32)), (BX, BR))
        v = elem * scale
    return _bf16_bits(v).to(tl.float32, bitcast=True)  # bf16 values


@triton.jit
def qgemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    c_ptr,
    alpha_ptr,
    NI,
    NJ,
    NR,
    sa_x,
    sa_r,
    sas_x,
    sas_r,
    sb_x,
    sb_r,
    sbs_x,
    sbs_r,
    sc_i,
    sc_j,
    FMT_A: tl.constexpr,
    FMT_B: tl.constexpr,
    ALPHA: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BI: tl.constexpr,
    BJ: tl.constexpr,
    BR: tl.constexpr,
    GROUP: tl.constexpr,
    BF16_DOT: tl.constexpr,
):
    """C [NI, NJ] (float32, strides sc_i, sc_j) = alpha * A B^T over NR, or C += that with
    ACCUMULATE; alpha is the float32 at alpha_ptr where ALPHA. Programs run in groups of GROUP
    row tiles so that neighbouring programs share B tiles in L2. BF16_DOT: the tensor cores'
    bf16 product (compiled kernels); Triton's interpreter multiplies bf16 tiles wrongly, so there
    the tiles stay float32 (holding the same bf16 values)."""
    pid = tl.program_id(0)
    tiles_i = tl.cdiv(NI, BI)
    tiles_j = tl.cdiv(NJ, BJ)
    per_group = GROUP * tiles_j
    first_i = (pid // per_group) * GROUP
    size = tl.minimum(tiles_i - first_i, GROUP)
    pid_i = first_i + (pid % per_group) % size
    pid_j = (pid % per_group) // size
    rows_i = pid_i * BI + tl.arange(0, BI)
    rows_j = pid_j * BJ + tl.arange(0, BJ)
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for r0 in range(0, NR, BR):
        a = _operand_tile(
            a_ptr, as_ptr, rows_i, r0, NI, NR, sa_x, sa_r, sas_x, sas_r, FMT_A, BI, BR
        )
        b = _operand_tile(
            b_ptr, bs_ptr, rows_j, r0, NJ, NR, sb_x, sb_r, sbs_x, sbs_r, FMT_B, BJ, BR
        )
        if BF16_DOT:  # exact: a and b hold bf16 values
            acc = tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)), acc)
        else:  # the same exact products, float32 accumulation
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    if ALPHA:
        acc = acc * tl.load(alpha_ptr)
    ci = rows_i.to(tl.int64)[:, None]
    cj = rows_j.to(tl.int64)[None, :]
    cmask = (ci < NI) & (cj < NJ)
    cptr = c_ptr + ci * sc_i + cj * sc_j
    if ACCUMULATE:
        acc = tl.load(cptr, mask=cmask, other=0.0) + acc
    tl.store(cptr, acc, mask=cmask)


@triton.jit
def dequant_kernel(
    d_ptr,
    s_ptr,
    out_ptr,
    P,
    Q,
    sd_p,
    ss_p,
    ss_q,
    FMT: tl.constexpr,
    SP: tl.constexpr,
    SQ: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
):
    """The bf16 GEMM operand of a quantized tensor in its stored layout, in one pass: out
    [P, Q] (bf16 bits as int16, contiguous) from data [P, Q] bytes (NVFP4: [P, Q/2], two codes per byte, row stride
    sd_p, unit column stride) and the scale of element (p, q) at s_ptr + (p // SP) * ss_p +
    (q // SQ) * ss_q. Element x scale, without the per-tensor factor, as `linear.gemm_operand`
    computes it in torch."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)[:, None]
    q = tl.program_id(1) * BQ + tl.arange(0, BQ)[None, :]
    mask = (p < P) & (q < Q)
    p64 = p.to(tl.int64)
    s = tl.load(s_ptr + (p64 // SP) * ss_p + (q // SQ) * ss_q, mask=mask, other=0).to(tl.int32)
    if FMT == 0:
        half = tl.program_id(1) * (BQ // 2) + tl.arange(0, BQ // 2)[None, :]
        b = tl.load(d_ptr + p64 * sd_p + half, mask=(p < P) & (half < Q // 2), other=0)
        b = b.to(tl.int32)
        codes = tl.reshape(tl.join(b & 15, b >> 4), (BP, BQ))
        v = _e2m1_value(codes) * _fp8_value(s, 4, 3)
    else:
        b = tl.load(d_ptr + p64 * sd_p + q, mask=mask, other=0).to(tl.int32)
        if FMT == 1:
            v = _fp8_value(b, 4, 3) * _e8m0_value(s)
        else:
            v = _fp8_value(b, 5, 2) * _e8m0_value(s)
    tl.store(out_ptr + p64 * Q + q, (_bf16_bits(v) >> 16).to(tl.int16), mask=mask)

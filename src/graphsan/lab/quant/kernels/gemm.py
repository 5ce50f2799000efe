"""The emulated low-precision GEMM's Triton kernels besides cuBLAS: the one-pass operand
preparation that `launch_gemm.gemm_operand` runs first (packed MXFP8 or NVFP4 operand -> its
exact bf16 values) and the epilogue after it (`gemm_epilogue_kernel`: alpha, the bf16 rounding
or the addition into main_grad); the element decoders they share with the fused GEMM
(`qgemm.py`).

Operand preparation (docs/numerics.md, "Triton kernels"): bit for bit the torch dequantization
(`gemm.gemm_operand_reference`: element x scale in float32, then the cast to bf16), edge values
included. Contiguous operands take one of three kernels whose loads, arithmetic and stores share
one register layout (no shared memory, 16-byte stores, the block scale loaded and decoded once
per thread and block):
- `dequant_nvfp4_kernel`: data byte j (two codes) -> output word j (two bf16), scale byte j // 8.
  An E2M1 value times an E4M3 scale has at most 6 significant bits and lies in [2^-10, 2688], so
  the float32 product is exact and its high half is the bf16 (tested over every code and scale
  byte); the code's value is its bits placed in a float32's exponent and mantissa (code 1, 0.5,
  is the subnormal 2^-127) times 2^126, two exact multiplies and no select.
- `dequant_mxfp8_rows_kernel` (rowwise: 32 elements along a row share a scale) and
  `dequant_mxfp8_cols_kernel` (columnwise: a scale row per 32 data rows, decoded once per program
  for all of its rows). Compiled on sm_90 (HW) the element comes from the hardware FP8
  conversion and the product is rounded by the hardware bf16 conversion, the same instructions
  the torch dequantization runs on CUDA; elsewhere (Triton's interpreter) by bit fields.
`dequant_kernel` takes any data row stride and scale strides (the fallback). NaN: compiled, every
NaN product is the GPU's canonical NaN, as torch's on CUDA; in the interpreter the bit-field
paths write the bits torch's CPU cast gives (NAN16, which the launcher reads from torch).

Element decodes by bit fields are the same on the GPU and in Triton's interpreter: the E2M1
value from its code, E4M3 and E5M2 bytes (subnormals, NaN, E5M2 inf), E8M0 scales (0x00 is
2^-127, 0xFF NaN). The product element x scale is exact in float32; its bf16 rounding (nearest
even, by bits) is exact for NVFP4 and for MXFP8 scale bytes >= 3 (E4M3) or 10 (E5M2), and
otherwise rounds as the torch emulation's cast does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import load_or_0

FMT_NVFP4 = tl.constexpr(0)
FMT_E4M3 = tl.constexpr(1)
FMT_E5M2 = tl.constexpr(2)
TWO_P120 = tl.constexpr(2.0**120)
TWO_P126 = tl.constexpr(2.0**126)


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
    NAN16: tl.constexpr,
    BP: tl.constexpr,
    BQ: tl.constexpr,
):
    """The bf16 GEMM operand of a quantized tensor in its stored layout, any strides (the
    fallback of the contiguous kernels below): out [P, Q] (bf16 bits as int16, contiguous) from
    data [P, Q] bytes (NVFP4: [P, Q/2], two codes per byte, row stride sd_p, unit column stride)
    and the scale of element (p, q) at s_ptr + (p // SP) * ss_p + (q // SQ) * ss_q. Element x
    scale, without the per-tensor factor, as `gemm.gemm_operand_reference` computes it in
    torch; NaN products as NAN16 (`_bf16_word`)."""
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
    tl.store(out_ptr + p64 * Q + q, _bf16_word(v, NAN16), mask=mask)


# --- operand preparation for contiguous operands ----------------------------------------------


@triton.jit
def _bf16_word(v, NAN16: tl.constexpr):
    """bf16 bits (int16) of float32 v, nearest even by bits (`_bf16_bits`); NaN as NAN16 where
    it is non-zero (torch's CPU cast: Triton's interpreter keeps NaN payloads that the cast
    does not), else as the NaN's own high half (compiled: the GPU's canonical NaN)."""
    bits = _bf16_bits(v)
    if NAN16 != 0:
        bits = tl.where(v != v, NAN16 << 16, bits)
    return (bits >> 16).to(tl.int16)


@triton.jit
def _e4m3_scale(s):
    """float32 value of E4M3 scale bytes s (int32 0-255), exact: exponent and mantissa fields
    as a float32's (the subnormals get exponent field 0) times 2^120, the sign by its bit, NaN
    for 0x7F and 0xFF. Once per block of 16 elements."""
    mag = s & 0x7F
    v = (mag << 20).to(tl.float32, bitcast=True) * TWO_P120
    v = tl.where(mag == 0x7F, float("nan"), v)
    return (v.to(tl.int32, bitcast=True) | ((s & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_times(b, SHIFT: tl.constexpr, scale):
    """The exact float32 product of the E2M1 code in bits SHIFT .. SHIFT + 3 of b (int32) and
    scale (float32): the code's exponent and mantissa bits in a float32's bits 22-24 and its
    sign in bit 31 are the code's value times 2^-126 (code 1, 0.5, the subnormal 2^-127), which
    one multiply by 2^126 makes exact and normal; the sign rides through the products, so a NaN
    scale gives the multiply's NaN for every code (as the reference's product). The bits come
    from one integer multiply: the code c (alone in its nibble) times 2^22 + 2^28 is c << 22
    plus c << 28, which do not overlap, and the mask 0x81C00000 keeps bits 22-24 of the first
    and bit 31 (the sign) of the second."""
    bits = ((b & (15 << SHIFT)) * (0x10400000 >> SHIFT)) & -2118123520  # 0x81C00000
    return (bits.to(tl.float32, bitcast=True) * TWO_P126) * scale


@triton.jit
def _contiguous_load(d_ptr, s_ptr, j, mask, VEC: tl.constexpr, PER_SCALE: tl.constexpr):
    """Data bytes j of a contiguous operand and the scale byte of each (one per PER_SCALE data
    bytes), the pointers at the program's first ones. Each thread holds VEC consecutive bytes:
    the load's index `(j // VEC) * VEC + j % VEC` is j, written so that Triton's alignment
    analysis gives the load the VEC elements per thread of the kernels' 16-byte stores instead
    of 16, which would need a shared-memory exchange."""
    b = load_or_0(d_ptr + (j // VEC) * VEC + j % VEC, mask)
    return b, load_or_0(s_ptr + j // PER_SCALE, mask)


@triton.jit
def dequant_nvfp4_kernel(
    d_ptr,
    s_ptr,
    out_ptr,
    N,
    NAN16: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A contiguous NVFP4 operand's bf16 values in its stored layout: data bytes [P, Q/2] (N of
    them, element 2j in the low nibble of byte j), E4M3 scales [P, Q/16] contiguous, out int32
    words [P, Q/2] (byte j's two bf16, element 2j in the low half). BLOCK bytes a program; EVEN:
    N is a multiple of BLOCK (no masks).

    Each thread holds 4 consecutive bytes (one 32-bit load, `_contiguous_load`), so one scale
    byte serves a thread's 8 elements. The products are exact (module docstring): the bf16 is
    the float32's high half, no rounding step."""
    base = tl.program_id(0).to(tl.int64) * BLOCK
    j = tl.arange(0, BLOCK)
    mask = None if EVEN else j < N - base
    b, s = _contiguous_load(d_ptr + base, s_ptr + (base >> 3), j, mask, 4, 8)
    b = b.to(tl.int32)
    scale = _e4m3_scale(s.to(tl.int32))
    lo = _e2m1_times(b, 0, scale).to(tl.int32, bitcast=True)
    hi = _e2m1_times(b, 4, scale).to(tl.int32, bitcast=True)
    word = ((lo >> 16) & 0xFFFF) | (hi & -65536)
    if NAN16 != 0:  # a NaN scale is the only NaN product
        word = tl.where(scale != scale, (NAN16 & 0xFFFF) | (NAN16 << 16), word)
    tl.store(out_ptr + base + j, word, mask=mask)


@triton.jit
def _mxfp8_bf16(b, scale, FMT: tl.constexpr, HW: tl.constexpr, NAN16: tl.constexpr):
    """bf16 bits (int16) of MXFP8 element bytes b (uint8) times their float32 scale, rounded as
    torch's cast rounds the float32 product: HW (compiled, sm_90) by the hardware FP8 and bf16
    conversions, else by bit fields (`_fp8_value`, `_bf16_word`)."""
    if HW:
        if FMT == 1:
            e = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            e = b.to(tl.float8e5, bitcast=True).to(tl.float32)
        return (e * scale).to(tl.bfloat16).to(tl.int16, bitcast=True)
    if FMT == 1:
        e = _fp8_value(b.to(tl.int32), 4, 3)
    else:
        e = _fp8_value(b.to(tl.int32), 5, 2)
    return _bf16_word(e * scale, NAN16)


@triton.jit
def dequant_mxfp8_rows_kernel(
    d_ptr,
    s_ptr,
    out_ptr,
    N,
    FMT: tl.constexpr,
    HW: tl.constexpr,
    NAN16: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A contiguous rowwise MXFP8 operand's bf16 values: element bytes [P, Q] (N of them), E8M0
    scales [P, Q/32] contiguous (scale of element i: byte i // 32), out bf16 bits [P, Q] (int16).
    BLOCK elements a program; EVEN: N is a multiple of BLOCK. Each thread holds 8 consecutive
    elements (an 8-byte load, `_contiguous_load`; one 16-byte store) and one scale."""
    base = tl.program_id(0).to(tl.int64) * BLOCK
    i = tl.arange(0, BLOCK)
    mask = None if EVEN else i < N - base
    b, s = _contiguous_load(d_ptr + base, s_ptr + (base >> 5), i, mask, 8, 32)
    out = _mxfp8_bf16(b, _e8m0_value(s.to(tl.int32)), FMT, HW, NAN16)
    tl.store(out_ptr + base + i, out, mask=mask)


@triton.jit
def dequant_mxfp8_cols_kernel(
    d_ptr,
    s_ptr,
    out_ptr,
    Q,
    FMT: tl.constexpr,
    HW: tl.constexpr,
    NAN16: tl.constexpr,
    EVEN: tl.constexpr,
    R: tl.constexpr,
    BQ: tl.constexpr,
):
    """A contiguous columnwise MXFP8 operand's bf16 values: element bytes [P, Q], E8M0 scales
    [P/32, Q] contiguous (a scale per column and 32 rows), out bf16 bits [P, Q] (int16). A
    program takes R rows (R divides 32: one scale row) and BQ columns; EVEN: Q is a multiple of
    BQ. The scale row is loaded and decoded once and broadcast down the R rows, which each thread
    holds whole (BQ = 256 x num_warps: 8 columns a thread, so the scale row and the [R, BQ] tile
    get one register layout)."""
    r0 = tl.program_id(0) * R
    q0 = tl.program_id(1) * BQ
    q = tl.arange(0, BQ)[None, :]
    qi = (q // 8) * 8 + q % 8
    srow = s_ptr + (r0 // 32).to(tl.int64) * Q + q0
    off = (r0 + tl.arange(0, R)[:, None]).to(tl.int64) * Q + q0
    cmask = None if EVEN else q < Q - q0
    s = load_or_0(srow + qi, cmask)
    b = load_or_0(d_ptr + off + qi, cmask)
    out = _mxfp8_bf16(b, _e8m0_value(s.to(tl.int32)), FMT, HW, NAN16)
    tl.store(out_ptr + off + q, out, mask=cmask)


@triton.jit
def gemm_epilogue_kernel(
    c_ptr,
    out_ptr,
    a_ptr,
    b_ptr,
    group_ptr,
    offs_ptr,
    R,
    C,
    G,
    GROUP_ROWS,
    NAN16: tl.constexpr,
    DIVISOR: tl.constexpr,
    ALPHA: tl.constexpr,
    GROUPS: tl.constexpr,
    ADD: tl.constexpr,
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    """The emulated GEMM's epilogue in one pass over its float32 (or bf16) result c [R, C]
    (contiguous): times alpha, then written as bf16 bits to out (int16, the rounding and NaN of
    `_bf16_word`) or added into the float32 out (ADD), with the float operations and rounding of
    the torch epilogue it replaces.

    ALPHA 0: no factor; 1: a * b (FP8 scale_invs); 2: (a * b) / DIVISOR (NVFP4 amaxes, one IEEE
    division). GROUPS 0: a and b are one float32 each; 1: row r belongs to group group_ptr[r]
    (int64; G means no group: the row is written as zeros) and takes a[g], b[g]; 2: row r belongs
    to group r // GROUP_ROWS (a grouped weight gradient [G, N, K] seen as [G*N, K]) and a group
    whose rows are empty (offs_ptr: int32 cumulative row counts) adds zeros."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < R
    mask = rmask[:, None] & (cols < C)[None, :]
    idx = rows.to(tl.int64)[:, None] * C + cols[None, :]
    v = tl.load(c_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    keep = rmask
    if GROUPS == 0:
        g = rows * 0
    elif GROUPS == 1:
        g = tl.load(group_ptr + rows, mask=rmask, other=G)
        keep = g < G
        g = tl.minimum(g, G - 1)
    else:
        g = rows // GROUP_ROWS
        end = tl.load(offs_ptr + g, mask=rmask, other=0)
        start = tl.load(offs_ptr + g - 1, mask=rmask & (g > 0), other=0)
        keep = end > start
    if ALPHA > 0:
        alpha = tl.load(a_ptr + g, mask=rmask, other=1.0) * tl.load(
            b_ptr + g, mask=rmask, other=1.0
        )
        if ALPHA == 2:
            alpha = tl.math.div_rn(alpha, DIVISOR)
        v = v * alpha[:, None]
    if GROUPS != 0:
        v = tl.where(keep[:, None], v, 0.0)
    if ADD:
        tl.store(out_ptr + idx, tl.load(out_ptr + idx, mask=mask, other=0.0) + v, mask=mask)
    else:
        tl.store(out_ptr + idx, _bf16_word(v, NAN16), mask=mask)

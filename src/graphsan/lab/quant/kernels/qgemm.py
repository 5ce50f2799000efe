"""The fused packed-operand GEMM (`qgemm_kernel`, off by default: `launch_gemm.FUSED_GEMM`): it
reads the packed MXFP8 or NVFP4 operands tile by tile, dequantizes each tile in registers to the
same bf16 values as the operand preparation (`gemm.py`'s decoders), multiplies with float32
accumulation (`tl.dot`) and applies the per-tensor factor alpha in the epilogue, optionally adding
into a float32 output (the weight gradient's `main_grad`).

C[i, j] = alpha * sum_r A(i, r) B(j, r): both operands are addressed as [rows, reduction] with
their blocks along the reduction dim, which every GEMM of the quantized Linear has (the launcher
maps each operand's stored layout to strides). The result equals dequantize-then-GEMM up to the
order of the float32 accumulation (docs/numerics.md states the tolerance).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .gemm import _bf16_bits, _e2m1_value, _e8m0_value, _fp8_value


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

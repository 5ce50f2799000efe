"""The emulated GEMM's launchers: the operands' one-pass preparation for cuBLAS
(`gemm_operand`), the epilogue (`gemm_epilogue`: alpha, the bf16 rounding, main_grad) and the
fused packed-operand GEMM (`quantized_mm`, off by default: `FUSED_GEMM`).

Same bits as the torch emulation in `gemm.py` (`gemm_operand_reference`, the epilogue's torch
operations); the callers there check the operands.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..formats import MXFP8_BLOCK, NVFP4_ALPHA_DIVISOR, NVFP4_BLOCK
from ..tensors import MXFP8Tensor, NVFP4Tensor
from . import gemm as jit
from . import qgemm as qgemm_jit
from .launch_common import COMPILE_OPTIONS, compiled, fast_kernels, hw_fp8_for

(
    dequant_kernel,
    dequant_mxfp8_cols_kernel,
    dequant_mxfp8_rows_kernel,
    dequant_nvfp4_kernel,
    gemm_epilogue_kernel,
    qgemm_kernel,
) = fast_kernels(
    jit.dequant_kernel,
    jit.dequant_mxfp8_cols_kernel,
    jit.dequant_mxfp8_rows_kernel,
    jit.dequant_nvfp4_kernel,
    jit.gemm_epilogue_kernel,
    qgemm_jit.qgemm_kernel,
)

# gemm_operand's kernels (contiguous operands; DEQUANT_TILE: any strides), the fastest or level
# with the fastest of bench/tile_sweep.py's tiles on the H200 (docs/PERF.md). BLOCK: bytes
# (NVFP4) or elements (MXFP8 rowwise) a program; columnwise MXFP8: R rows a program (R divides
# 32), 256 x num_warps columns.
DEQUANT_NVFP4_TILE = {"BLOCK": 2048, "num_warps": 4}
DEQUANT_MXFP8_ROW_TILE = {"BLOCK": 4096, "num_warps": 4}
DEQUANT_MXFP8_COL_TILE = {"R": 8, "num_warps": 4}
DEQUANT_TILE = {"BP": 32, "BQ": 128, "num_warps": 4}
GEMM_TILE = {"BI": 128, "BJ": 128, "BR": 64, "GROUP": 8, "num_warps": 8, "num_stages": 3}
GEMM_EPILOGUE_TILE = {"BR": 8, "BC": 512, "num_warps": 4}

# Whether QuantLinear's GEMMs run the fused packed-operand GEMM (`quantized_mm`) instead of
# one-pass operand preparation (`gemm_operand`) and cuBLAS. Off: the fused kernel decodes every
# operand tile once per output tile, about 15 integer operations per element against 0.5 tensor
# core multiply-adds at 128x128 tiles on Hopper, so it is expected to be ALU-bound; the benchmark
# (bench/bench_quant_linear.py) times both.
FUSED_GEMM = False


def _nan16(x: torch.Tensor) -> int:
    """The bf16 bits (int16) that the kernels for x write for NaN: 0 where they are compiled,
    where the NaN is the GPU's canonical one, as torch's (and reading it back here would sync,
    or fail inside a graph capture); in Triton's interpreter, what torch's float32 -> bf16 cast
    gives there (`_interpreted_nan16`)."""
    return 0 if compiled(x) else _interpreted_nan16(x.device.type)


@functools.cache
def _interpreted_nan16(device_type: str) -> int:
    """The bf16 bits of torch's float32 -> bf16 cast of NaN on a device type, for the bit-field
    paths of Triton's interpreter (CPU: 0xFFFF from the vectorised cast, whatever the payload;
    read from torch, not assumed)."""
    nan = torch.full((64,), float("nan"), dtype=torch.float32, device=device_type)
    return int(nan.to(torch.bfloat16).view(torch.int16)[0])


def gemm_operand(q, *, _strided: bool = False) -> torch.Tensor | None:
    """The exact bf16 values of an MXFP8 or NVFP4 operand without its per-tensor factor, in its
    logical shape (a transposed view for NVFP4 columnwise), from one pass over the packed data;
    None for other tensors. The same bits as `gemm.gemm_operand_reference`. Contiguous data
    and scales run `dequant_nvfp4_kernel`, `dequant_mxfp8_rows_kernel` or
    `dequant_mxfp8_cols_kernel`, anything else (or `_strided=True`, for the tests)
    `dequant_kernel`."""
    if isinstance(q, NVFP4Tensor):
        fmt, (p, q2), sp, sq = 0, q.data.shape, 1, NVFP4_BLOCK
        cols = q2 * 2
    elif isinstance(q, MXFP8Tensor):
        fmt, (p, cols) = (1 if q.fmt == "e4m3" else 2), q.data.shape
        sp, sq = (MXFP8_BLOCK, 1) if q.axis == 0 else (1, MXFP8_BLOCK)
    else:
        return None
    if q.data.stride(1) != 1:
        return None
    dev = q.data.device
    out = torch.empty(p, cols, dtype=torch.bfloat16, device=dev)
    nan16 = _nan16(q.data)
    dense = not _strided and q.data.is_contiguous() and q.scale.is_contiguous()
    if out.numel() and dense:
        _dequant_dense(q, fmt, p, cols, out.view(torch.int16), nan16)
    elif out.numel():
        tile = DEQUANT_TILE
        grid = (triton.cdiv(p, tile["BP"]), triton.cdiv(cols, tile["BQ"]))
        dequant_kernel[grid](
            q.data,
            q.scale,
            out.view(torch.int16),
            p,
            cols,
            q.data.stride(0),
            q.scale.stride(0),
            q.scale.stride(1),
            FMT=fmt,
            SP=sp,
            SQ=sq,
            NAN16=nan16,
            **tile,
            **COMPILE_OPTIONS,
        )
    return out.t() if isinstance(q, NVFP4Tensor) and q.axis == 0 else out


def _dequant_dense(q, fmt, p, cols, out16, nan16):
    """`gemm_operand` for contiguous data and scales (out16: the bf16 output as int16)."""
    if fmt == 0:
        _dequant_flat(
            dequant_nvfp4_kernel, DEQUANT_NVFP4_TILE, q, out16.view(torch.int32), NAN16=nan16
        )
        return
    flags = {"FMT": fmt, "HW": hw_fp8_for(q.data), "NAN16": nan16}
    if q.axis != 0:
        _dequant_flat(dequant_mxfp8_rows_kernel, DEQUANT_MXFP8_ROW_TILE, q, out16, **flags)
        return
    tile = dict(DEQUANT_MXFP8_COL_TILE)
    if MXFP8_BLOCK % tile["R"]:
        raise ValueError(f"DEQUANT_MXFP8_COL_TILE: R={tile['R']} must divide {MXFP8_BLOCK}")
    bq = 256 * tile["num_warps"]  # 8 columns a thread: one layout for scales and data
    grid = (p // tile["R"], triton.cdiv(cols, bq))
    dequant_mxfp8_cols_kernel[grid](
        q.data,
        q.scale,
        out16,
        cols,
        **flags,
        EVEN=cols % bq == 0,
        BQ=bq,
        **tile,
        **COMPILE_OPTIONS,
    )


def _dequant_flat(kernel, tile, q, out, **flags):
    """A kernel that takes the packed data as one flat run of BLOCK elements a program."""
    n = q.data.numel()
    tile = dict(tile)
    kernel[(triton.cdiv(n, tile["BLOCK"]),)](
        q.data, q.scale, out, n, **flags, EVEN=n % tile["BLOCK"] == 0, **tile, **COMPILE_OPTIONS
    )


def _gemm_view(q, r_is_q: bool):
    """An operand as the GEMM kernel reads it: (data, scale, rows X, reduction R, data strides
    (x, r), scale strides (x, r-block), format), where the reduction runs along the logical
    dim q (r_is_q) or p of q's logical [p, q] shape; None where the blocks do not run along it."""
    d, s = q.data, q.scale
    if isinstance(q, NVFP4Tensor):
        if r_is_q != (q.axis != 0):
            return None
        return d, s, d.shape[0], d.shape[1] * 2, d.stride(0), d.stride(1), *s.stride(), 0
    if isinstance(q, MXFP8Tensor):
        fmt = 1 if q.fmt == "e4m3" else 2
        if r_is_q and q.axis != 0:
            return d, s, d.shape[0], d.shape[1], d.stride(0), d.stride(1), *s.stride(), fmt
        if not r_is_q and q.axis == 0:
            return (
                d,
                s,
                d.shape[1],
                d.shape[0],
                d.stride(1),
                d.stride(0),
                s.stride(1),
                s.stride(0),
                fmt,
            )
    return None


def quantized_mm(a, b, transpose_a, transpose_b, alpha, out=None):
    """op(a) @ op(b) * alpha (float32) from the packed operands in one kernel, or added into
    `out` (float32) when given; None where the kernel does not take the operands (FP8
    per-tensor, mixed kinds): the caller runs the torch emulation."""
    if type(a) is not type(b) or not isinstance(a, (NVFP4Tensor, MXFP8Tensor)):
        return None
    va, vb = _gemm_view(a, not transpose_a), _gemm_view(b, transpose_b)
    if va is None or vb is None or va[3] != vb[3]:
        return None
    i, j, r = va[2], vb[2], va[3]
    c = out if out is not None else torch.empty(i, j, dtype=torch.float32, device=a.data.device)
    tile = GEMM_TILE
    grid = (triton.cdiv(i, tile["BI"]) * triton.cdiv(j, tile["BJ"]),)
    qgemm_kernel[grid](
        va[0],
        va[1],
        vb[0],
        vb[1],
        c,
        alpha if alpha is not None else c,
        i,
        j,
        r,
        *va[4:8],
        *vb[4:8],
        c.stride(0),
        c.stride(1),
        FMT_A=va[8],
        FMT_B=vb[8],
        ALPHA=alpha is not None,
        ACCUMULATE=out is not None,
        BF16_DOT=compiled(c),
        **tile,
        **COMPILE_OPTIONS,
    )
    return c


# --- the emulated GEMM's epilogue --------------------------------------------------------------


def gemm_epilogue(c, a, b, mode, out=None, row_groups=None, offsets=None):
    """A GEMM result c [R, C] (or [G, N, K] with `offsets`) times alpha in one pass: written as
    a new bf16 tensor, or added into the float32 `out` (returned). `mode` and the factors a, b
    are `gemm.alpha_factors`' (0: no alpha; 1: a * b; 2: NVFP4, (a * b) / 6^2 448^2). Rows:
    `row_groups` (a RowGroups) gives each row its group's factors and writes rows in no group as
    zeros; `offsets` (int32 cumulative group rows) reads c as G groups of N rows, each with its
    group's factors, an empty group's rows as zeros (the grouped weight gradient)."""
    c = c.contiguous()
    cols = c.shape[-1]
    rows = c.numel() // cols
    groups, group_rows, kind, count = c, 1, 0, 0
    if row_groups is not None:
        groups, kind, count = row_groups.index, 1, row_groups.count
    elif offsets is not None:
        kind, count, group_rows = 2, c.shape[0], c.shape[1]
    if out is None:
        out = torch.empty(c.shape, dtype=torch.bfloat16, device=c.device)
    tile = GEMM_EPILOGUE_TILE
    grid = (triton.cdiv(rows, tile["BR"]), triton.cdiv(cols, tile["BC"]))
    add = out.dtype == torch.float32
    gemm_epilogue_kernel[grid](
        c,
        out if add else out.view(torch.int16),
        a if a is not None else c,
        b if b is not None else c,
        groups,
        offsets if offsets is not None else c,
        rows,
        cols,
        count,
        group_rows,
        NAN16=_nan16(c),
        DIVISOR=NVFP4_ALPHA_DIVISOR,
        ALPHA=mode,
        GROUPS=kind,
        ADD=add,
        **tile,
        **COMPILE_OPTIONS,
    )
    return out

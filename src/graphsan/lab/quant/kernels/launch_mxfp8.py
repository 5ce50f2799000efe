"""The MXFP8 launchers: outputs, tiles, and which kernel runs for which input.

Same arguments and bytes as `mxfp8.quantize_reference`. The bf16-word kernel runs where
`words_fit(x)` and a columnwise copy is asked for (it always writes one), the strided kernel
elsewhere; `_strided=True` runs the strided kernel everywhere, for the benchmarks and tests that
compare the two.
"""

from __future__ import annotations

import torch
import triton

from ..formats import FP8_BITS, FP8_MAX, MXFP8_BLOCK, fp32_reciprocal
from ..tensors import MXFP8Tensor
from . import mxfp8 as jit
from .launch_common import COMPILE_OPTIONS, compiled, fast_kernels, hw_fp8_for, words_fit

mxfp8_strided_kernel, mxfp8_words_kernel = fast_kernels(
    jit.mxfp8_strided_kernel, jit.mxfp8_words_kernel
)

MXFP8_STRIDED_TILE = {"BM": 32, "BN": 128, "SPLIT": 2, "num_warps": 2}
MXFP8_WORDS_COL_TILE = {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2}  # columnwise alone
MXFP8_WORDS_BOTH_TILE = {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2}  # row+col in one pass


def mxfp8_quantize(
    x: torch.Tensor, axis: int = -1, fmt: str = "e4m3", *, _strided: bool = False
) -> MXFP8Tensor:
    """One direction of MXFP8 (TE's round-up scale rule)."""
    row, col = _mxfp8(x, fmt, axis != 0, axis == 0, _strided)
    return col if axis == 0 else row


def mxfp8_quantize_both(
    x: torch.Tensor, fmt: str = "e4m3", *, _strided: bool = False
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Rowwise and columnwise MXFP8 from one read of x."""
    return _mxfp8(x, fmt, True, True, _strided)


def _mxfp8(x, fmt, do_row, do_col, strided):
    m, k = x.shape
    dev = x.device
    row = col = None
    if do_row:
        row = MXFP8Tensor(
            torch.empty(m, k, dtype=torch.uint8, device=dev),
            torch.empty(m, k // MXFP8_BLOCK, dtype=torch.uint8, device=dev),
            -1,
            fmt,
        )
    if do_col:
        col = MXFP8Tensor(
            torch.empty(m, k, dtype=torch.uint8, device=dev),
            torch.empty(m // MXFP8_BLOCK, k, dtype=torch.uint8, device=dev),
            0,
            fmt,
        )
    if do_col and not strided and words_fit(x):  # the words kernel always writes columnwise
        _mxfp8_words(x, fmt, row, col)
    else:
        _mxfp8_strided(x, fmt, row, col)
    return row, col


def _fp8_constants(fmt: str) -> dict:
    """The MXFP8 kernels' element-format arguments."""
    mbits, emin, sub = FP8_BITS[fmt]
    max_ = FP8_MAX[fmt]
    return {"INV_MAX": fp32_reciprocal(max_), "MAX": max_, "MBITS": mbits, "EMIN": emin, "SUB": sub}


def _mxfp8_strided(x, fmt, row, col):
    m, k = x.shape
    dummy = torch.empty(1, dtype=torch.uint8, device=x.device)
    tile = MXFP8_STRIDED_TILE
    grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(k, tile["BN"]))
    mxfp8_strided_kernel[grid](
        x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        row.data if row else dummy,
        row.scale if row else dummy,
        col.data if col else dummy,
        col.scale if col else dummy,
        **_fp8_constants(fmt),
        HW_FP8=hw_fp8_for(x),
        DO_ROW=row is not None,
        DO_COL=col is not None,
        **tile,
        **COMPILE_OPTIONS,
    )


def _mxfp8_words(x, fmt, row, col):
    """x as int64 words [M, K/4]; data and columnwise scales written as int32 words."""
    m, k = x.shape
    xw = x.view(torch.int64)
    tile = MXFP8_WORDS_BOTH_TILE if row is not None else MXFP8_WORDS_COL_TILE
    grid = (triton.cdiv(m, MXFP8_BLOCK), triton.cdiv(k // 4, tile["G"] * tile["CW"]))
    dummy = col.scale.new_empty(1)
    mxfp8_words_kernel[grid](
        xw,
        m,
        k // 4,
        x.stride(0) // 4,
        row.data.view(torch.int32) if row else dummy,
        row.scale if row else dummy,
        col.data.view(torch.int32),
        col.scale.view(torch.int32),
        **_fp8_constants(fmt),
        HW_FP8=hw_fp8_for(x),
        MAXNUM=compiled(x),  # Triton's interpreter has no NaN-ignoring maximum
        DO_ROW=row is not None,
        **tile,
        **COMPILE_OPTIONS,
    )

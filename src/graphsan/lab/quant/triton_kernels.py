"""Fast path: Triton kernels for MXFP8 and NVFP4 quantization on CUDA.

`mxfp8.quantize` and `nvfp4.quantize` call these automatically for CUDA tensors when Triton is
importable (GRAPHSAN_NO_TRITON=1, true, yes or on forces the torch reference); the torch
reference stays the fallback and the oracle, and the GPU tests compare the two byte for byte.

- MXFP8: one kernel reads each tile once and writes rowwise and/or columnwise bytes and scales
  (`mxfp8_quantize_both` for the pair).
- NVFP4: an amax kernel accumulates the global amax into a device buffer (atomic max, no host
  sync), then the quantize kernel reads it; columnwise reads the source in its own order (blocks
  down its columns, so the reads stay coalesced) and writes the transposed layout. The RHT (bf16,
  torch) and the random bits for SR (`torch.randint` on the caller's generator, exactly as the
  reference draws them) are prepared in torch, so SR stays reproducible and graph-capturable.

Two variants compute the same bytes: "v2" (arithmetic E2M1 codes, hardware E4M3 block scales on
sm_90, columnwise blocks reduced in registers; any dtype and strides) and "v3" (bf16 sources with
unit column stride read as 64-bit words of 4 and outputs written as packed words, so the load and
the store share one layout: MXFP8 columnwise and row+col, NVFP4 rowwise, columnwise and the RHT
copy; every other kernel and input runs v2 under "v3"; see `_triton_impl`). The first kernels
("v1") were removed once v2 and v3 beat them on every kernel (their times stay in docs/PERF.md).
Every entry point takes `variant=`; the default is `default_variant()`: GRAPHSAN_TRITON_VARIANT,
else "v3" (as fast or faster on every kernel in `bench/bench_quant.py`, which times both side by
side and checks that their bytes are equal).

Triton is imported lazily, on first use, and the two environment switches are read where the
kernels are chosen (not at import): a bad value is a `TritonSettingError`, one line naming the
variable and the values it accepts.
"""

from __future__ import annotations

import functools
import os

import torch

from . import mxfp8 as _mx
from . import nvfp4 as _nv
from .elements import FP8_MAX, fp32_reciprocal
from .rht import rht as apply_rht

_IMPL = None
_AVAILABLE: bool | None = None

# (MBITS, EMIN, SUB) of the FP8 element formats, for the bit-field encoding
_FP8_PARAMS = {"e4m3": (3, -6, 2.0**9), "e5m2": (2, -14, 2.0**16)}


@functools.cache
def hw_fp8(device_index: int) -> bool:
    """Whether the MXFP8 kernel converts with the hardware FP8 instruction on this GPU (sm_90+;
    the tests run both paths against the reference)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


# "v3" exists for the MXFP8 kernels with a columnwise part (columnwise, row+col) and the NVFP4
# row kernel (rowwise, and the contiguous RHT copy of columnwise) and column kernel (no RHT, no
# SR), on bf16 input with unit column stride; every other kernel and input (MXFP8 rowwise alone,
# NVFP4 columnwise with SR and no RHT, float32 input) runs its v2 kernel when "v3" is asked for,
# and the global amax runs v2's kernel with a tile of its own.
VARIANTS = ("v2", "v3")
DEFAULT_VARIANT = "v3"  # when GRAPHSAN_TRITON_VARIANT is unset or empty

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class TritonSettingError(ValueError):
    """GRAPHSAN_NO_TRITON or GRAPHSAN_TRITON_VARIANT holds a value that means nothing."""


def triton_disabled() -> bool:
    """Whether GRAPHSAN_NO_TRITON turns the kernels off: 1/true/yes/on do, 0/false/no/off or
    unset/empty do not (any case); anything else is a `TritonSettingError`."""
    raw = os.environ.get("GRAPHSAN_NO_TRITON", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise TritonSettingError(
        f"GRAPHSAN_NO_TRITON={raw!r}: expected 1, true, yes or on (Triton off: the torch "
        "reference runs) or 0, false, no, off or empty (Triton on)"
    )


def default_variant() -> str:
    """The variant that runs when none is passed: GRAPHSAN_TRITON_VARIANT, else DEFAULT_VARIANT;
    an unknown name is a `TritonSettingError`."""
    raw = os.environ.get("GRAPHSAN_TRITON_VARIANT", "")
    value = raw.strip() or DEFAULT_VARIANT
    if value not in VARIANTS:
        raise TritonSettingError(
            f"GRAPHSAN_TRITON_VARIANT={raw!r}: expected one of {', '.join(VARIANTS)} "
            f"(or unset: {DEFAULT_VARIANT})"
        )
    return value


# v2 launch parameters (fixed; chosen from the sm_90 SASS instruction counts; the column tile was
# the fastest of six in bench/tile_sweep.py on the H200)
MX_V2 = {"BM": 32, "BN": 128, "SPLIT": 2, "num_warps": 2}
NV_ROW_V2 = {"BR": 32, "BC": 128, "num_warps": 4}
NV_COL_V2 = {"BM": 256, "BK": 64, "num_warps": 4}
# v3 launch parameters (fixed; the fastest of the tiles bench/tile_sweep.py compares on the H200,
# docs/PERF.md): MXFP8 columnwise alone, and row+col in one pass
MX_COL_V3 = {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2}
MX_BOTH_V3 = {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2}
NV_ROW_V3 = {"BR": 16, "CW": 64, "num_warps": 2}
NV_COL_V3 = {"NB": 8, "CW": 16, "num_warps": 2}
AMAX_V2_BLOCK = 16384
AMAX_V2_ITERS = 2
AMAX_V3 = (4096, 16)  # 0.040 ms against v2's 0.045 ms on 8192x8192 (the first kernel's tile)
# v2 kernels are compiled without fp contraction: no rounding step may be fused away
_V2_OPTIONS = {"enable_fp_fusion": False}


def _variant(variant: str | None) -> str:
    variant = default_variant() if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")
    return variant


def available() -> bool:
    """True when Triton can be imported and GRAPHSAN_NO_TRITON does not turn it off."""
    global _AVAILABLE, _IMPL
    if triton_disabled():
        return False
    if _AVAILABLE is None:
        try:
            from . import _triton_impl

            _IMPL = _triton_impl
            _AVAILABLE = True
        except Exception:  # ImportError, or a Triton without a usable backend
            _AVAILABLE = False
    return _AVAILABLE


def _impl():
    if not available():
        raise RuntimeError("Triton is not available (not installed, or GRAPHSAN_NO_TRITON=1)")
    return _IMPL


def _hw_fp8_for(x: torch.Tensor) -> bool:
    if not x.is_cuda:  # CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1, tests)
        return False
    return hw_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())


def _mx_launch(x, fmt, do_row, do_col, variant):
    impl = _impl()
    m, k = x.shape
    dev = x.device
    row = col = None
    dummy = torch.empty(1, dtype=torch.uint8, device=dev)
    if do_row:
        row = _mx.MXFP8Tensor(
            torch.empty(m, k, dtype=torch.uint8, device=dev),
            torch.empty(m, k // 32, dtype=torch.uint8, device=dev),
            -1,
            fmt,
        )
    if do_col:
        col = _mx.MXFP8Tensor(
            torch.empty(m, k, dtype=torch.uint8, device=dev),
            torch.empty(m // 32, k, dtype=torch.uint8, device=dev),
            0,
            fmt,
        )
    if variant == "v3" and do_col and _words_fit(x):
        _mx_launch_v3(x, fmt, row, col)
        return row, col
    grid = (triton_cdiv(m, MX_V2["BM"]), triton_cdiv(k, MX_V2["BN"]))
    impl._mxfp8_kernel_v2[grid](
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
        HW_FP8=_hw_fp8_for(x),
        DO_ROW=do_row,
        DO_COL=do_col,
        **MX_V2,
        **_V2_OPTIONS,
    )
    return row, col


def _fp8_constants(fmt: str) -> dict:
    """The MXFP8 kernels' element-format arguments."""
    mbits, emin, sub = _FP8_PARAMS[fmt]
    max_ = FP8_MAX[fmt]
    return {"INV_MAX": fp32_reciprocal(max_), "MAX": max_, "MBITS": mbits, "EMIN": emin, "SUB": sub}


def _words_fit(x: torch.Tensor) -> bool:
    """Whether a v3 kernel can read x as 64-bit words of 4 bf16 (else v3 runs v2)."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and x.shape[1] % 4 == 0
        and x.stride(0) % 4 == 0
        and x.data_ptr() % 8 == 0
    )


def _mx_launch_v3(x, fmt, row, col):
    """v3: x as int64 words [M, K/4], data and columnwise scales written as int32 words."""
    impl = _impl()
    m, k = x.shape
    xw = x.view(torch.int64)
    cfg = MX_BOTH_V3 if row is not None else MX_COL_V3
    grid = (triton_cdiv(m, 32), triton_cdiv(k // 4, cfg["G"] * cfg["CW"]))
    dummy = col.scale.new_empty(1)
    impl._mxfp8_kernel_v3[grid](
        xw,
        m,
        k // 4,
        x.stride(0) // 4,
        row.data.view(torch.int32) if row else dummy,
        row.scale if row else dummy,
        col.data.view(torch.int32),
        col.scale.view(torch.int32),
        **_fp8_constants(fmt),
        HW_FP8=_hw_fp8_for(x),
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        DO_ROW=row is not None,
        **cfg,
        **_V2_OPTIONS,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mxfp8_quantize(
    x: torch.Tensor, axis: int = -1, fmt: str = "e4m3", variant: str | None = None
) -> _mx.MXFP8Tensor:
    """One direction of MXFP8 (TE rule) with the Triton kernel."""
    _mx._check_args(x, axis, fmt)
    row, col = _mx_launch(x, fmt, axis != 0, axis == 0, _variant(variant))
    return col if axis == 0 else row


def mxfp8_quantize_both(x: torch.Tensor, fmt: str = "e4m3", variant: str | None = None):
    """Rowwise and columnwise MXFP8 from one read of x."""
    _mx._check_args(x, -1, fmt)
    _mx._check_args(x, 0, fmt)
    return _mx_launch(x, fmt, True, True, _variant(variant))


def global_amax(x: torch.Tensor, variant: str | None = None) -> torch.Tensor:
    """max |x| ignoring NaN into a fresh float32 0-dim device buffer (no host sync)."""
    impl = _impl()
    flat = x.contiguous().view(-1)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    n = flat.numel()
    block, iters = (AMAX_V2_BLOCK, AMAX_V2_ITERS) if _variant(variant) == "v2" else AMAX_V3
    iters = iters if n >= block * iters * 64 else 1
    grid = (triton_cdiv(n, block * iters),)
    impl.amax_kernel_v2[grid](flat, n, amax, BLOCK=block, ITERS=iters, num_warps=8)
    return amax


def nvfp4_quantize(
    x: torch.Tensor,
    axis: int = -1,
    block_2d: bool = False,
    order: str = "current",
    rht: bool = False,
    generator: torch.Generator | None = None,
    amax: torch.Tensor | None = None,
    variant: str | None = None,
) -> _nv.NVFP4Tensor:
    """NVFP4 with the Triton kernels; same arguments and bytes as `nvfp4.quantize_reference`.

    `amax` may pass a precomputed global amax buffer (valid only without RHT).
    """
    _nv._check_args(x, axis, block_2d, order, rht, generator)
    variant = _variant(variant)
    _impl()  # a clear error where Triton is unavailable, before any work
    src = x.t() if axis == 0 else x
    if rht:
        src = apply_rht(src).contiguous()
        amax = global_amax(src, variant)
    elif amax is None:
        amax = global_amax(x, variant)
    r, c = src.shape
    dev = x.device
    data = torch.empty(r, c // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(r, c // 16, dtype=torch.uint8, device=dev)
    if generator is not None:
        rbits = _nv.random_bits(src.shape, generator, dev)
    else:
        rbits = torch.empty(1, dtype=torch.uint8, device=dev)
    if variant == "v3" and (axis != 0 or rht) and _words_fit(src):
        _nv_launch_row_v3(x, src, amax, rbits, data, scale, order, block_2d, generator)
    elif variant == "v3" and axis == 0 and generator is None and _words_fit(x):
        _nv_launch_col_v3(x, amax, data, scale, order, block_2d)
    else:
        _nv_launch_v2(x, src, axis, rht, amax, rbits, data, scale, order, block_2d, generator)
    return _nv.NVFP4Tensor(data, scale, amax, 0 if axis == 0 else -1, block_2d, rht)


def _nv_launch_v2(x, src, axis, rht, amax, rbits, data, scale, order, block_2d, generator):
    """v2: the row kernel for rowwise and for the contiguous RHT copy; otherwise the columnwise
    kernel reads x in its own order (blocks down its columns) and writes the transposed layout."""
    impl = _impl()
    common = {
        "INV_6": _nv.INV_6,
        "LEGACY": order == "legacy",
        "BLOCK_2D": block_2d,
        "SR": generator is not None,
        "HW_FP8": _hw_fp8_for(x),
        **_V2_OPTIONS,
    }
    if axis == 0 and not rht:
        m, k = x.shape
        grid = (triton_cdiv(m, NV_COL_V2["BM"]), triton_cdiv(k, NV_COL_V2["BK"]))
        impl._nvfp4_col_kernel_v2[grid](
            x, m, k, x.stride(0), x.stride(1), amax, rbits, data, scale, **common, **NV_COL_V2
        )
        return
    r, c = src.shape
    grid = (triton_cdiv(r, NV_ROW_V2["BR"]), triton_cdiv(c, NV_ROW_V2["BC"]))
    impl._nvfp4_row_kernel_v2[grid](
        src, r, c, src.stride(0), src.stride(1), amax, rbits, data, scale, **common, **NV_ROW_V2
    )


def _nv_launch_row_v3(x, src, amax, rbits, data, scale, order, block_2d, generator):
    """v3 row kernel: src as int64 words [R, C/4], data written as int16 words (4 nibbles)."""
    impl = _impl()
    r, c = src.shape
    grid = (triton_cdiv(r, NV_ROW_V3["BR"]), triton_cdiv(c // 4, NV_ROW_V3["CW"]))
    impl._nvfp4_row_kernel_v3[grid](
        src.view(torch.int64),
        r,
        c // 4,
        src.stride(0) // 4,
        amax,
        rbits.view(torch.int32) if generator is not None else rbits,
        data.view(torch.int16),
        scale,
        INV_6=_nv.INV_6,
        LEGACY=order == "legacy",
        BLOCK_2D=block_2d,
        SR=generator is not None,
        HW_FP8=_hw_fp8_for(x),
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        **NV_ROW_V3,
        **_V2_OPTIONS,
    )


def _nv_launch_col_v3(x, amax, data, scale, order, block_2d):
    """v3 columnwise kernel (no RHT, no SR): x as int64 words [M, K/4], the transposed data
    written as int64 words [K, M/16] (one per column and 16-row block)."""
    impl = _impl()
    m, k = x.shape
    grid = (triton_cdiv(m // 16, NV_COL_V3["NB"]), triton_cdiv(k // 4, NV_COL_V3["CW"]))
    impl._nvfp4_col_kernel_v3[grid](
        x.view(torch.int64),
        m,
        k // 4,
        x.stride(0) // 4,
        amax,
        data.view(torch.int64),
        scale,
        INV_6=_nv.INV_6,
        LEGACY=order == "legacy",
        BLOCK_2D=block_2d,
        HW_FP8=_hw_fp8_for(x),
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        **NV_COL_V3,
        **_V2_OPTIONS,
    )

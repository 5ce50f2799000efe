"""MXFP8: FP8 elements (E4M3 or E5M2) with one E8M0 power-of-two scale per 32 elements.

Plain torch, step for step as docs/numerics.md states it (TE's "round up" scale rule). Works on
CPU and CUDA with no host synchronisation.

    q = quantize(x, axis=-1, fmt="e4m3")   # axis -1: 1x32 blocks along the last dim
    q = quantize(x, axis=0)                # axis 0: 32x1 blocks along the first dim
    q.data    # uint8 element bytes, shape of x (TE keeps columnwise data in the [M, K] layout)
    q.scale   # uint8 E8M0 bytes: [M, K/32] rowwise, [M/32, K] columnwise
    dequantize(q)                          # float32, shape of x

On CUDA, `quantize` and `quantize_both` run the Triton kernels (`graphsan.lab.quant.kernels`)
when Triton is importable; this reference is their fallback and their oracle
(`quantize_reference`).
"""

from __future__ import annotations

import torch

from . import kernels
from .elements import (
    check_blocked,
    check_fp8_format,
    e8m0_round_up,
    exp2_biased,
    fp8_encode,
    nan_to_zero_abs,
)
from .formats import FP8_MAX, MXFP8_BLOCK, fp32_reciprocal
from .tensors import MXFP8Tensor

BLOCK = MXFP8_BLOCK


def quantize(x: torch.Tensor, axis: int = -1, fmt: str = "e4m3") -> MXFP8Tensor:
    """Quantize a 2-D tensor to MXFP8 along `axis`; Triton on CUDA, the reference elsewhere."""
    _check_args(x, (axis,), fmt)
    fast = kernels.mxfp8_launcher(x)
    if fast is not None:
        return fast.mxfp8_quantize(x, axis, fmt)
    return _reference(x, axis, fmt)


def quantize_both(x: torch.Tensor, fmt: str = "e4m3") -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Rowwise and columnwise MXFP8 of x; on CUDA one Triton kernel reads x once for both."""
    _check_args(x, (-1, 0), fmt)
    fast = kernels.mxfp8_launcher(x)
    if fast is not None:
        return fast.mxfp8_quantize_both(x, fmt)
    return _reference(x, -1, fmt), _reference(x, 0, fmt)


def quantize_reference(x: torch.Tensor, axis: int = -1, fmt: str = "e4m3") -> MXFP8Tensor:
    """The torch reference on any device."""
    _check_args(x, (axis,), fmt)
    return _reference(x, axis, fmt)


def dequantize(q: MXFP8Tensor) -> torch.Tensor:
    """element * 2^(e-127) in float32, shape of the source (scale byte 0xFF gives NaN)."""
    return q.dequantize()


def _reference(x: torch.Tensor, axis: int, fmt: str) -> MXFP8Tensor:
    """Blocks along the last dim of `src` (x, or x transposed); arguments already checked."""
    src = x.t() if axis == 0 else x
    rows, cols = src.shape
    x32 = src.to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)

    # Block amax: max |x| over the block, ignoring NaN.
    amax = nan_to_zero_abs(x32).amax(dim=-1)

    # Scale: v = amax * fl(1/max_elem) rounded up to a power of two.
    scale = e8m0_round_up(amax * fp32_reciprocal(FP8_MAX[fmt]))

    # Elements: x * 2^(127-e), then nearest even with saturation.
    data = fp8_encode(x32 * exp2_biased(scale, negate=True).unsqueeze(-1), fmt)
    data = data.reshape(rows, cols)
    if axis == 0:
        return MXFP8Tensor(data.t().contiguous(), scale.t().contiguous(), 0, fmt)
    return MXFP8Tensor(data, scale, -1, fmt)


def _check_args(x: torch.Tensor, axes: tuple[int, ...], fmt: str) -> None:
    check_fp8_format(fmt)
    for axis in axes:
        check_blocked(x, axis, BLOCK, "MXFP8")

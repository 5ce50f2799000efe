"""MXFP8: FP8 elements (E4M3 or E5M2) with one E8M0 power-of-two scale per 32 elements.

Plain torch, step for step as docs/numerics.md states it (TE's "round up" scale rule). Works on
CPU and CUDA with no host synchronisation.

    q = quantize(x, axis=-1, fmt="e4m3")   # axis -1: 1x32 blocks along the last dim
    q = quantize(x, axis=0)                # axis 0: 32x1 blocks along the first dim
    q.data    # uint8 element bytes, shape of x (TE keeps columnwise data in the [M, K] layout)
    q.scale   # uint8 E8M0 bytes: [M, K/32] rowwise, [M/32, K] columnwise
    dequantize(q)                          # float32, shape of x

On CUDA, `quantize` uses the Triton kernel (`graphsan.lab.quant.triton_kernels`) when Triton is
importable; this reference is its fallback and its oracle (`quantize_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .elements import (
    FP8_MAX,
    check_fp8_format,
    e8m0_round_up,
    exp2_biased,
    fp8_decode,
    fp8_encode,
    fp32_reciprocal,
    nan_to_zero_abs,
)

BLOCK = 32


@dataclass
class MXFP8Tensor:
    """One direction of an MXFP8-quantized 2-D tensor.

    data: uint8 [M, K] element bytes (both directions keep the source layout).
    scale: uint8 E8M0 bytes, [M, K/32] for axis -1 (rowwise), [M/32, K] for axis 0 (columnwise).
    axis: -1 (rowwise, 1x32 blocks) or 0 (columnwise, 32x1 blocks).
    fmt: "e4m3" or "e5m2".
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    fmt: str = "e4m3"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The device tensors that hold this quantization (for in-place workspace updates)."""
        return (self.data, self.scale)


def check_shape(x: torch.Tensor, axis: int, block: int = BLOCK, what: str = "MXFP8") -> None:
    """Raise a ValueError unless x is 2-D and the blocked dimension is a multiple of `block`."""
    if axis not in (-1, 0, 1):
        raise ValueError(f"{what}: axis={axis!r}; expected -1 (rowwise) or 0 (columnwise)")
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    dim = 0 if axis == 0 else 1
    if x.shape[dim] % block:
        direction = "columnwise (axis=0)" if dim == 0 else "rowwise (axis=-1)"
        raise ValueError(
            f"{what} {direction}: dimension {dim} of shape {tuple(x.shape)} is {x.shape[dim]}, "
            f"expected a multiple of {block}"
        )


def quantize(x: torch.Tensor, axis: int = -1, fmt: str = "e4m3") -> MXFP8Tensor:
    """Quantize a 2-D tensor to MXFP8 along `axis`; Triton on CUDA, the reference elsewhere."""
    _check_args(x, axis, fmt)
    if x.is_cuda:
        from . import triton_kernels

        if triton_kernels.available():
            return triton_kernels.mxfp8_quantize(x, axis=axis, fmt=fmt)
    return quantize_reference(x, axis=axis, fmt=fmt)


def quantize_both(x: torch.Tensor, fmt: str = "e4m3") -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Rowwise and columnwise MXFP8 of x; on CUDA one Triton kernel reads x once for both."""
    _check_args(x, -1, fmt)
    _check_args(x, 0, fmt)
    if x.is_cuda:
        from . import triton_kernels

        if triton_kernels.available():
            return triton_kernels.mxfp8_quantize_both(x, fmt=fmt)
    return quantize_reference(x, -1, fmt), quantize_reference(x, 0, fmt)


def quantize_reference(x: torch.Tensor, axis: int = -1, fmt: str = "e4m3") -> MXFP8Tensor:
    """The torch reference: blocks along the last dim of `src` (x, or x transposed)."""
    _check_args(x, axis, fmt)
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


def dequantize(q: MXFP8Tensor) -> torch.Tensor:
    """element * 2^(e-127) in float32, shape of the source (scale byte 0xFF gives NaN)."""
    values = fp8_decode(q.data, q.fmt)
    if q.axis == 0:
        factor = exp2_biased(q.scale).repeat_interleave(BLOCK, dim=0)
    else:
        factor = exp2_biased(q.scale).repeat_interleave(BLOCK, dim=1)
    return values * factor


def _check_args(x: torch.Tensor, axis: int, fmt: str) -> None:
    check_fp8_format(fmt)
    check_shape(x, axis)

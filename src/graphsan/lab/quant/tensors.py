"""The quantized tensors: what one direction of a quantized 2-D tensor holds, and how it reads
back to float32 (docs/numerics.md). `mxfp8`, `nvfp4` and `fp8` make them (torch reference or
Triton kernels, the same bytes); the quantized Linear reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .elements import e2m1_decode, exp2_biased, fp8_decode, unpack_nibbles
from .formats import INV_2688, MXFP8_BLOCK, NVFP4_BLOCK


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
        """element * 2^(e-127) in float32, shape of the source (scale byte 0xFF gives NaN)."""
        values = fp8_decode(self.data, self.fmt)
        dim = 0 if self.axis == 0 else 1
        return values * exp2_biased(self.scale).repeat_interleave(MXFP8_BLOCK, dim=dim)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The device tensors that hold this quantization (for in-place workspace updates)."""
        return (self.data, self.scale)


@dataclass
class NVFP4Tensor:
    """One direction of an NVFP4-quantized 2-D tensor of logical shape `shape` ([M, K]).

    data: uint8, two E2M1 codes per byte, low nibble first: [M, K/2] rowwise, [K, M/2] columnwise.
    scale: uint8 E4M3 bytes per 16 elements, [M, K/16] rowwise, [K, M/16] columnwise.
    amax: float32 0-dim tensor, the global amax of this direction (after the RHT, if any).
    axis: -1 (rowwise) or 0 (columnwise, stored transposed).
    block_2d, rht: how it was made (RHT data dequantizes to the transformed values).
    """

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    axis: int
    block_2d: bool = False
    rht: bool = False

    @property
    def shape(self) -> torch.Size:
        rows, half = self.data.shape
        return torch.Size((half * 2, rows) if self.axis == 0 else (rows, half * 2))

    def dequantize(self) -> torch.Tensor:
        """Step 6: q * (fp32(s_e4m3) * amax * fl(1/2688)), float32 in the logical shape."""
        values = e2m1_decode(unpack_nibbles(self.data))
        factor = (fp8_decode(self.scale, "e4m3") * self.amax) * INV_2688
        out = values * factor.repeat_interleave(NVFP4_BLOCK, dim=1)
        return out.t() if self.axis == 0 else out

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The device tensors that hold this quantization (for in-place workspace updates)."""
        return (self.data, self.scale, self.amax)


@dataclass
class FP8Tensor:
    """One direction of a per-tensor-scaled E4M3 tensor of logical shape [M, K].

    data: uint8 E4M3 bytes, [M, K] rowwise or [K, M] columnwise (transposed).
    scale_inv: float32 0-dim, the dequantization factor 1/scale.
    amax: float32 0-dim.
    axis: -1 (rowwise) or 0 (columnwise).
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    amax: torch.Tensor
    axis: int

    @property
    def shape(self) -> torch.Size:
        return self.data.t().shape if self.axis == 0 else self.data.shape

    def dequantize(self) -> torch.Tensor:
        out = fp8_decode(self.data, "e4m3") * self.scale_inv
        return out.t() if self.axis == 0 else out

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.data, self.scale_inv, self.amax)


QTensor = MXFP8Tensor | NVFP4Tensor | FP8Tensor

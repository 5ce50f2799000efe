"""FP8 per-tensor current scaling (E4M3) and BF16 passthrough: the simple control recipes.

FP8 current scaling, as TE's Float8CurrentScaling does it: amax = max |x| (NaN ignored),
scale = 448 / amax in float32 (1 when amax is 0 or the quotient is not finite, FLT_MAX when it
overflows), data = E4M3(clamp(x * scale)), scale_inv = 1 / scale. Both directions hold the same
values; columnwise data is stored transposed ([K, M]) like TE's FP8 transpose on Hopper.
`quantize_grouped` gives each row group (expert) its own scale.
"""

from __future__ import annotations

import torch

from .elements import check_groups, div, fp8_encode, group_amax, nan_to_zero_abs
from .formats import E4M3_MAX, FLT_MAX
from .tensors import FP8Tensor


def quantize(x: torch.Tensor, axis: int = -1) -> FP8Tensor:
    """Quantize a 2-D tensor with one E4M3 scale computed from its current amax."""
    if x.dim() != 2 or axis not in (-1, 0, 1):
        raise ValueError(
            f"FP8: expected a 2-D tensor and axis -1 or 0, got shape {tuple(x.shape)}, axis={axis}"
        )
    x32 = x.to(torch.float32)
    amax = nan_to_zero_abs(x32).amax()
    scale = scale_from_amax(amax)
    data = fp8_encode(x32 * scale, "e4m3")
    if axis == 0:
        data = data.t().contiguous()
    return FP8Tensor(data, div(1.0, scale), amax, 0 if axis == 0 else -1)


def quantize_grouped(
    x: torch.Tensor, groups: torch.Tensor, num_groups: int, axis: int = -1
) -> FP8Tensor:
    """FP8 of a tensor whose rows form groups (experts), one scale per group: the bytes equal
    quantizing each group's rows alone. groups: int64 [rows], the group of each row (`num_groups`
    for rows in no group: they get scale 1). `scale_inv` and `amax` are float32 [num_groups]."""
    if x.dim() != 2 or axis not in (-1, 0, 1):
        raise ValueError(
            f"FP8: expected a 2-D tensor and axis -1 or 0, got shape {tuple(x.shape)}, axis={axis}"
        )
    check_groups(x, groups, "FP8")
    x32 = x.to(torch.float32)
    amax = group_amax(nan_to_zero_abs(x32).amax(dim=1), groups, num_groups)
    scale = scale_from_amax(amax)
    data = fp8_encode(x32 * scale[groups].unsqueeze(1), "e4m3")
    if axis == 0:
        data = data.t().contiguous()
    return FP8Tensor(data, div(1.0, scale[:num_groups]), amax[:num_groups], 0 if axis == 0 else -1)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """448 / amax in float32; FLT_MAX when that overflows; 1 for amax 0, inf or NaN."""
    scale = div(E4M3_MAX, amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    bad = (amax == 0) | (scale == 0) | torch.isnan(scale)  # all zeros, amax inf, amax NaN
    return torch.where(bad, torch.ones_like(scale), scale)


def dequantize(q: FP8Tensor) -> torch.Tensor:
    return q.dequantize()

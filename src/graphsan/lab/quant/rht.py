"""Random Hadamard transform (RHT) for NVFP4 wgrad operands.

M = diag(s) * H16 * 0.25 with the Sylvester 16x16 Hadamard matrix H16 and TE's fixed sign vector
s. A row block b (16 consecutive values along the token dimension) becomes b @ M. M is orthogonal
(M M^T = I), so applying it to both wgrad operands along the shared token dimension leaves
dY^T X unchanged while spreading outliers over the block.

`rht` accumulates in float32 with a fixed butterfly order (signs and the 0.25 first, both exact,
then four add/subtract stages) and rounds the result to bf16, as the spec requires before amax
and quantization. Elementwise ops only, so CPU and CUDA give identical bits.
"""

from __future__ import annotations

import torch

RHT_SIZE = 16
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard16(dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Sylvester H16 (entries +-1, unnormalised)."""
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rht_matrix(dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """M = diag(s) * H16 * 0.25."""
    s = torch.tensor(RHT_SIGNS, dtype=dtype, device=device)
    return s[:, None] * hadamard16(dtype, device) * 0.25


# Bit i set where RHT_SIGNS[i] == -1, so the sign vector can be built on the device by kernels
# alone (no host-to-device copy: capturable in a CUDA graph and free of host syncs).
_NEG_MASK = sum(1 << i for i, s in enumerate(RHT_SIGNS) if s < 0)


def _signs(device) -> torch.Tensor:
    bits = torch.bitwise_right_shift(
        torch.full((RHT_SIZE,), _NEG_MASK, dtype=torch.int32, device=device),
        torch.arange(RHT_SIZE, dtype=torch.int32, device=device),
    )
    return 1.0 - 2.0 * (bits & 1).to(torch.float32)


def rht(x: torch.Tensor) -> torch.Tensor:
    """Apply M to every 16-wide block along the last dim of `x`; returns bf16.

    The last dim must be a multiple of 16.
    """
    if x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"RHT: last dimension {x.shape[-1]} of shape {tuple(x.shape)} must be a multiple of 16"
        )
    shape = x.shape
    signs = _signs(x.device) * 0.25
    y = x.to(torch.float32).reshape(-1, RHT_SIZE) * signs  # rows of diag(s) scaled by 0.25
    # Fast Walsh-Hadamard transform: y @ H16, one butterfly stage per bit of the column index.
    h = 1
    while h < RHT_SIZE:
        y = y.reshape(-1, RHT_SIZE // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape).to(torch.bfloat16)

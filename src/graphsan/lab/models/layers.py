"""Small building blocks: RMSNorm, gated RMSNorm (Mamba-2), the squared-ReLU MLP and its grouped
(routed experts) form."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphsan.lab.quant import GroupedQuantLinear, QuantLinear


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, computed in fp32, returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, *, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """Mamba-2's norm: rmsnorm(y * silu(z)) over groups of `group_size` channels."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5, *, device=None):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.bfloat16))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = y.float() * F.silu(z.float())
        shape = g.shape
        g = g.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (g.reshape(shape) * self.weight.float()).to(y.dtype)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class MLP(nn.Module):
    """fc1 -> squared ReLU -> fc2 (Nemotron-H's MLP; also the MoE's shared expert)."""

    def __init__(self, dim: int, ffn: int, *, device=None):
        super().__init__()
        self.fc1 = QuantLinear(dim, ffn, bias=False, device=device)
        self.fc2 = QuantLinear(ffn, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(squared_relu(self.fc1(x)))


class GroupedMLP(nn.Module):
    """The routed experts: fc1 -> squared ReLU -> fc2 of every expert, each on its own rows.

    fc1, fc2: `GroupedQuantLinear` holding all experts' weights ([E, ffn, dim] and [E, dim, ffn]),
    one recipe for all experts. forward(x [rows, dim] grouped expert-major, offsets int32 [E]: the
    cumulative padded row counts) -> [rows, dim]; rows past offsets[-1] give zeros.
    """

    def __init__(self, num_experts: int, dim: int, ffn: int, *, row_multiple: int, device=None):
        super().__init__()
        self.num_experts = num_experts
        self.fc1 = GroupedQuantLinear(
            num_experts, dim, ffn, row_multiple=row_multiple, device=device
        )
        self.fc2 = GroupedQuantLinear(
            num_experts, ffn, dim, row_multiple=row_multiple, device=device
        )

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc2(squared_relu(self.fc1(x, offsets)), offsets)

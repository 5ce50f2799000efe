"""Mamba-2 mixer (as in Megatron Core's MambaMixer, single rank, no inference cache).

in_proj -> [z, x, B, C, dt]; causal depthwise conv1d + SiLU over xBC; dt = softplus(dt + dt_bias);
A = -exp(A_log); chunked SSD scan (fp32); D skip; gated RMSNorm with z; out_proj.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from graphsan.lab.models.args import ModelArgs
from graphsan.lab.models.layers import GatedRMSNorm
from graphsan.lab.models.ssd import ssd_chunked
from graphsan.lab.quant import QuantLinear


class Mamba2Mixer(nn.Module):
    def __init__(self, args: ModelArgs, *, device=None):
        super().__init__()
        self.args = args
        h, gn = args.mamba_num_heads, args.mamba_num_groups * args.mamba_state_dim
        self.conv_dim = args.mamba_inner + 2 * gn
        self.in_proj = QuantLinear(args.hidden_size, args.mamba_in_proj_size, device=device)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            args.mamba_conv_kernel,
            groups=self.conv_dim,
            padding=args.mamba_conv_kernel - 1,
            device=device,
            dtype=torch.bfloat16,
        )
        # dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]; A in [1, 16] (Mamba-2 init)
        dt = torch.exp(
            torch.rand(h, device=device) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
        ).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.empty(h, device=device).uniform_(1, 16)))
        self.D = nn.Parameter(torch.ones(h, device=device))
        self.norm = GatedRMSNorm(
            args.mamba_inner, args.mamba_inner // args.mamba_num_groups, device=device
        )
        self.out_proj = QuantLinear(args.mamba_inner, args.hidden_size, device=device)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        a = self.args
        b, seq, _ = u.shape
        h, p, g, n = a.mamba_num_heads, a.mamba_head_dim, a.mamba_num_groups, a.mamba_state_dim
        zxbcdt = self.in_proj(u)
        z, xbc, dt = torch.split(zxbcdt, [a.mamba_inner, self.conv_dim, h], dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :seq].transpose(1, 2))
        x, B, C = torch.split(xbc, [a.mamba_inner, g * n, g * n], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias)
        A = -torch.exp(self.A_log.float())
        x = x.reshape(b, seq, h, p)
        y = ssd_chunked(
            x, dt, A, B.reshape(b, seq, g, n), C.reshape(b, seq, g, n), a.mamba_chunk_size
        )
        y = y + x.float() * self.D.float()[:, None]
        y = self.norm(y.reshape(b, seq, h * p).to(u.dtype), z)
        return self.out_proj(y)

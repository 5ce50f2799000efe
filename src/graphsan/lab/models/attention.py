"""Self-attention with grouped query heads (GQA), no positional embedding, SDPA (causal)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphsan.lab.models.args import ModelArgs
from graphsan.lab.quant import QuantLinear


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, *, device=None):
        super().__init__()
        self.nh, self.ng, self.hd = (
            args.num_attention_heads,
            args.num_query_groups,
            args.kv_channels,
        )
        qkv = (self.nh + 2 * self.ng) * self.hd
        self.linear_qkv = QuantLinear(args.hidden_size, qkv, device=device)
        self.linear_proj = QuantLinear(self.nh * self.hd, args.hidden_size, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, _ = x.shape
        q, k, v = torch.split(
            self.linear_qkv(x), [self.nh * self.hd, self.ng * self.hd, self.ng * self.hd], dim=-1
        )
        q = q.reshape(b, seq, self.nh, self.hd).transpose(1, 2)
        k = k.reshape(b, seq, self.ng, self.hd).transpose(1, 2)
        v = v.reshape(b, seq, self.ng, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.linear_proj(y.transpose(1, 2).reshape(b, seq, self.nh * self.hd))

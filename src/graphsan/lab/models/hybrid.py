"""The hybrid language model: embedding (BF16) -> pre-norm layers from a pattern -> final norm ->
untied output layer, plus one multi-token-prediction (MTP) depth that shares the embedding and
the output layer.

Module paths (the precision configs match on them): `layers.{i}`, `layers.{i}.mixer` (Mamba:
`in_proj`, `out_proj`; attention: `linear_qkv`, `linear_proj`; MoE: `router`, `fc1_latent`,
`fc2_latent`, `experts.fc1/fc2` (each one GroupedQuantLinear holding every expert's weight),
`shared_expert.fc1/fc2`; MLP: `fc1`, `fc2`),
`mtp.eh_proj`, `mtp.layers.{i}...`, `output_layer`.

A layer's forward is built from stage methods (`layer_stage`, `router_stage`, `front_stage`,
`shared_stage`) so that training code can replace a stage from the outside; the model itself
knows nothing of how.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from graphsan.lab.models.args import ModelArgs
from graphsan.lab.models.attention import Attention
from graphsan.lab.models.layers import MLP, RMSNorm
from graphsan.lab.models.mamba2 import Mamba2Mixer
from graphsan.lab.models.moe import LatentMoE
from graphsan.lab.quant import QuantLinear, QuantModule

IGNORE_INDEX = -100


class HybridLayer(nn.Module):
    """RMSNorm -> mixer -> residual. `kind` is the pattern character."""

    def __init__(self, kind: str, args: ModelArgs, *, device=None):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(args.hidden_size, args.norm_eps, device=device)
        if kind == "M":
            self.mixer = Mamba2Mixer(args, device=device)
        elif kind == "*":
            self.mixer = Attention(args, device=device)
        elif kind == "E":
            self.mixer = LatentMoE(args, device=device)
        else:
            self.mixer = MLP(args.hidden_size, args.ffn_hidden_size, device=device)

    def layer_stage(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.norm(h))

    def router_stage(self, h: torch.Tensor):
        normed = self.norm(h)
        probs, idx = self.mixer.router(normed)
        return normed, probs, idx

    def front_stage(self, h: torch.Tensor):
        normed, probs, idx = self.router_stage(h)
        return (normed, *self.mixer.preprocess(normed, probs, idx))

    def shared_stage(self, normed: torch.Tensor) -> torch.Tensor:
        return self.mixer.shared_expert(normed)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind != "E":
            return self.layer_stage(h)
        normed, *pre = self.front_stage(h)
        return h + self.mixer.combine_output(normed, pre, self.shared_stage(normed))


class MTP(nn.Module):
    """One MTP depth: combine h_t with the embedding of token t+1 to predict token t+2."""

    def __init__(self, args: ModelArgs, *, device=None):
        super().__init__()
        self.enorm = RMSNorm(args.hidden_size, args.norm_eps, device=device)
        self.hnorm = RMSNorm(args.hidden_size, args.norm_eps, device=device)
        self.eh_proj = QuantLinear(2 * args.hidden_size, args.hidden_size, device=device)
        self.layers = nn.ModuleList(HybridLayer(k, args, device=device) for k in args.mtp_pattern)
        self.final_norm = RMSNorm(args.hidden_size, args.norm_eps, device=device)

    def forward(self, h: torch.Tensor, emb_next: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(emb_next)], dim=-1))
        for layer in self.layers:
            x = layer(x)
        return self.final_norm(x)


class HybridLM(nn.Module):
    def __init__(self, args: ModelArgs, *, device=None):
        super().__init__()
        self.args = args.validate()
        self.embedding = nn.Embedding(
            args.vocab_size, args.hidden_size, device=device, dtype=torch.bfloat16
        )
        self.layers = nn.ModuleList(HybridLayer(k, args, device=device) for k in args.pattern)
        self.final_norm = RMSNorm(args.hidden_size, args.norm_eps, device=device)
        self.output_layer = QuantLinear(args.hidden_size, args.vocab_size, device=device)
        self.mtp = MTP(args, device=device) if args.mtp_num_layers else None
        if torch.device(device or "cpu").type != "meta":
            self.init_weights()

    @property
    def layer_pattern(self) -> str:
        """The hybrid pattern (apply_precision counts layers for first/last-N-BF16 on it)."""
        return self.args.pattern

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, std) for embedding and Linear weights; output projections of each block
        scaled by 1/sqrt(2 * layers) (Megatron's output_layer_init_method)."""
        std = self.args.init_std
        scaled = std / math.sqrt(2 * len(self.args.pattern))
        self.embedding.weight.normal_(0, std)
        for name, m in self.named_modules():
            if isinstance(m, QuantModule):  # QuantLinear and the experts' GroupedQuantLinear
                last = name.rsplit(".", 1)[-1]
                is_out = last in ("out_proj", "linear_proj", "fc2", "fc2_latent")
                m.weight.normal_(0, scaled if is_out else std)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        for layer in self.layers:
            h = layer(h)
        return h

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):
        """Logits if `labels` is None; else a dict with `loss` (LM + scaled MTP), `lm_loss`,
        `mtp_loss` (fp32 scalars; MTP only in training mode)."""
        h = self.hidden_states(tokens)
        logits = self.output_layer(self.final_norm(h))
        if labels is None:
            return logits
        lm_loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        out = {"loss": lm_loss, "lm_loss": lm_loss.detach()}
        if self.mtp is not None and self.training:
            emb_next = self.embedding(F.pad(tokens[:, 1:], (0, 1)))
            mtp_logits = self.output_layer(self.mtp(h, emb_next))
            mtp_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            mtp_loss = F.cross_entropy(
                mtp_logits.float().flatten(0, 1), mtp_labels.flatten(), ignore_index=IGNORE_INDEX
            )
            out["loss"] = lm_loss + self.args.mtp_loss_scaling_factor * mtp_loss
            out["mtp_loss"] = mtp_loss.detach()
        return out

    def update_expert_bias(self) -> None:
        for m in self.modules():
            if isinstance(m, LatentMoE):
                m.router.update_expert_bias(self.args.moe_router_bias_update_rate)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, active per token): active leaves out the routed experts a token does not use."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for m in model.modules():
        if isinstance(m, LatentMoE):
            per_expert = sum(p.numel() for p in m.experts.parameters()) // m.args.num_experts
            inactive += (m.args.num_experts - m.args.moe_router_topk) * per_expert
    return total, total - inactive


def build_model(args: ModelArgs, *, device=None, seed: int | None = None) -> HybridLM:
    """Build the model; with `seed`, parameter init is reproducible (device-independent: weights
    are drawn on the CPU generator and then moved)."""
    dev = torch.device(device or "cpu")
    if dev.type == "meta":
        return HybridLM(args, device="meta")
    if seed is not None:
        torch.manual_seed(seed)
    return HybridLM(args, device="cpu").to(dev)

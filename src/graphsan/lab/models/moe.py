"""Latent mixture of experts (Nemotron 3 Super's LatentMoE), dropless.

    router (full hidden state, fp32 logits, sigmoid, expert bias for selection only, top-k,
            normalise, scale)
    preprocess: fc1_latent (hidden -> latent), routing-map padding so each expert's token count is
            a multiple of `moe_pad_multiple`, permutation of token copies grouped by expert
    experts (squared-ReLU MLPs in the latent space, all experts in one `GroupedMLP`: grouped GEMMs),
    combine with the routing probabilities, fc2_latent (latent -> hidden); plus a shared expert on
    the full hidden state.

Router and preprocess have static shapes and no host sync, so they can be captured in a CUDA
graph: the permuted buffer has a fixed `capacity` rows (the largest padded total possible), rows
past the real total are zero with probability 0. The experts take the padded per-expert counts as
device offsets (their cumulative sum) and run grouped GEMMs over the whole buffer: no host sync
there either (rows past the total contribute nothing; tests/lab/test_capture_safety.py checks
the path for syncs). They run eagerly, as Megatron's routed experts do; no sync stands in the way
of capturing them later. With expert parallelism (`ep`, set by `shard_experts`) the experts are
this rank's share and the rows travel by all-to-all (lab/models/dispatch.py), which needs the
split sizes on the host: that part stays eager, as Megatron's token dispatcher does.
"""

from __future__ import annotations

import torch
from torch import nn

from graphsan.lab.models.args import ModelArgs
from graphsan.lab.models.dispatch import ExpertParallel, dispatch_and_run
from graphsan.lab.models.layers import MLP, GroupedMLP
from graphsan.lab.quant import QuantLinear


def route(logits: torch.Tensor, expert_bias: torch.Tensor, topk: int, scale: float):
    """Sigmoid top-k routing with an aux-loss-free expert bias (used for selection only).

    Returns (probs [N, k] fp32, normalised over the k chosen and scaled; indices [N, k] int64).
    """
    scores = torch.sigmoid(logits.float())
    idx = torch.topk(scores + expert_bias, topk, dim=-1).indices
    probs = scores.gather(-1, idx)
    if topk > 1:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    return probs * scale, idx


def pad_routing_map(routing_map: torch.Tensor, multiple: int) -> torch.Tensor:
    """Add tokens (the lowest-index ones not yet routed there) to each expert until its count is a
    multiple of `multiple`. Added tokens get probability 0, so they change no output or gradient.
    Needs N % multiple == 0 (so a padded count never exceeds N)."""
    counts = routing_map.sum(0)
    need = (-counts) % multiple
    free = ~routing_map
    return routing_map | (free & (free.cumsum(0) <= need))


def permute_capacity(num_tokens: int, num_experts: int, topk: int, multiple: int) -> int:
    """Largest possible number of rows after padding: sum_e roundup(c_e) with sum_e c_e = N*k."""
    bound = (num_tokens * topk + num_experts * (multiple - 1)) // multiple * multiple
    return min(bound, num_tokens * num_experts)


def permute(x, padded_map, probs_dense, capacity: int):
    """Group token copies by expert (expert-major, token order kept) into `capacity` rows.

    Returns (permuted [capacity, D], probs [capacity] fp32, token index [capacity] int64,
    tokens per expert [E] int64 padded counts). Rows past the total are zero, prob 0, token 0.
    """
    n, e = padded_map.shape
    flat = padded_map.t().reshape(-1)  # index = expert * N + token
    order = torch.sort((~flat).to(torch.int32), stable=True).indices[:capacity]
    valid = flat[order]
    token = torch.where(valid, order % n, 0)
    expert = order // n
    probs = torch.where(valid, probs_dense[token, expert], 0.0)
    permuted = x[token] * valid.unsqueeze(-1).to(x.dtype)
    return permuted, probs, token, padded_map.sum(0)


class Router(nn.Module):
    """fp32 router weight [E, H] (not quantized), expert bias and per-expert token counts."""

    def __init__(self, args: ModelArgs, *, device=None):
        super().__init__()
        self.topk, self.scale = args.moe_router_topk, args.moe_router_topk_scaling_factor
        self.weight = nn.Parameter(
            torch.randn(args.num_experts, args.hidden_size, device=device) * args.init_std
        )
        self.register_buffer("expert_bias", torch.zeros(args.num_experts, device=device))
        self.register_buffer(
            "local_tokens_per_expert", torch.zeros(args.num_experts, device=device)
        )

    def forward(self, x: torch.Tensor):
        logits = x.reshape(-1, x.shape[-1]).float() @ self.weight.t()
        probs, idx = route(logits, self.expert_bias, self.topk, self.scale)
        if self.training:  # counted in place, so a captured graph keeps counting
            ones = torch.ones_like(idx, dtype=torch.float32).reshape(-1)
            self.local_tokens_per_expert.index_add_(0, idx.reshape(-1), ones)
        return probs, idx

    @torch.no_grad()
    def update_expert_bias(self, rate: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded."""
        load = self.local_tokens_per_expert
        self.expert_bias.add_(torch.sign(load.mean() - load) * rate)
        load.zero_()


class LatentMoE(nn.Module):
    def __init__(self, args: ModelArgs, *, device=None):
        super().__init__()
        self.args = args
        self.router = Router(args, device=device)
        self.fc1_latent = QuantLinear(args.hidden_size, args.moe_latent_size, device=device)
        self.experts = GroupedMLP(
            args.num_experts,
            args.moe_latent_size,
            args.moe_ffn_hidden_size,
            row_multiple=args.moe_pad_multiple,
            device=device,
        )
        self.shared_expert = MLP(
            args.hidden_size, args.moe_shared_expert_intermediate_size, device=device
        )
        self.fc2_latent = QuantLinear(args.moe_latent_size, args.hidden_size, device=device)
        self.ep = None  # an ExpertParallel when the experts are split across ranks

    def preprocess(self, x: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor):
        """fc1_latent, routing-map padding and permutation (static shapes, graph-capturable)."""
        a = self.args
        n = probs.shape[0]
        if n % a.moe_pad_multiple:
            raise ValueError(
                f"MoE: {n} tokens per microbatch is not a multiple of moe_pad_multiple="
                f"{a.moe_pad_multiple}; choose micro-batch-size * seq-length accordingly"
            )
        latent = self.fc1_latent(x.reshape(n, -1))
        probs_dense = torch.zeros(n, a.num_experts, device=x.device).scatter(1, idx, probs)
        routing_map = torch.zeros_like(probs_dense, dtype=torch.bool).scatter(1, idx, True)
        padded = pad_routing_map(routing_map, a.moe_pad_multiple)
        cap = permute_capacity(n, a.num_experts, a.moe_router_topk, a.moe_pad_multiple)
        return permute(latent, padded, probs_dense, cap)

    def experts_and_combine(self, permuted, probs, token, tokens_per_expert, num_tokens: int):
        """Run the experts on their rows (grouped GEMMs, no host sync), weight by prob, sum per
        token."""
        if self.ep is not None:
            out, total = dispatch_and_run(
                self.ep, self.experts, permuted, tokens_per_expert, self.args.moe_pad_multiple
            )
            token, probs = token[:total], probs[:total]
        else:
            offsets = tokens_per_expert.cumsum(0).to(torch.int32)
            out = self.experts(permuted, offsets)
        combined = torch.zeros(num_tokens, out.shape[1], device=out.device)
        return combined.index_add_(0, token, out.float() * probs.unsqueeze(-1)).to(permuted.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, idx = self.router(x)
        return self.combine_output(x, self.preprocess(x, probs, idx), self.shared_expert(x))

    def combine_output(self, x, pre, shared):
        """Experts + combine + fc2_latent + shared expert: the part that always runs eagerly."""
        n = x.shape[0] * x.shape[1]
        routed = self.experts_and_combine(*pre, num_tokens=n)
        return self.fc2_latent(routed).reshape(x.shape) + shared


def shard_experts(model: nn.Module, ep: ExpertParallel) -> None:
    """Keep only this rank's experts in every LatentMoE of `model` (weights copied from the
    full model's, so a run with EP starts from the same weights as one without)."""
    for m in model.modules():
        if not isinstance(m, LatentMoE):
            continue
        a, full = m.args, m.experts
        if a.num_experts % ep.size:
            raise ValueError(
                f"--expert-model-parallel-size {ep.size}: the model has {a.num_experts} experts; "
                "expected a divisor of the expert count"
            )
        lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
        local = GroupedMLP(
            ep.local_experts,
            a.moe_latent_size,
            a.moe_ffn_hidden_size,
            row_multiple=a.moe_pad_multiple,
            device=full.fc1.weight.device,
        )
        with torch.no_grad():
            local.fc1.weight.copy_(full.fc1.weight[lo:hi])
            local.fc2.weight.copy_(full.fc2.weight[lo:hi])
        m.experts, m.ep = local, ep

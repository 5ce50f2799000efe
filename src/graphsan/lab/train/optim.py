"""AdamW over fp32 master copies, fed from each parameter's fp32 `main_grad`.

QuantLinear weights accumulate into `weight.main_grad` themselves (weight.grad stays None); every
other parameter gets a `main_grad` here and a post-accumulate hook that adds its .grad into it and
drops the .grad. `main_grad` buffers are zeroed in place (`zero_()`, never reallocated: captured
backward graphs hold their addresses), and parameters are updated in place (`copy_`) for the same
reason.

Data parallel (`dist`, lab/train/distributed.py): the main_grads become views into one
contiguous fp32 buffer per group, as Megatron's grad buffer (allocated once, before any capture,
so the backward graphs accumulate into it), and `reduce_grads()` averages each buffer over its
ranks after the last backward of a step, eagerly, in one all-reduce: the dense parameters over
every rank, the routed experts (when split across ranks) over the ranks that hold the same
experts. Every rank then holds the gradient of the global batch's loss and takes the same step.
With experts split, the clipping norm adds the other ranks' experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _accumulate_into_main_grad(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad)
    p.grad = None


class MainGradAdamW:
    def __init__(
        self,
        model: nn.Module,
        lr: float,
        *,
        weight_decay: float = 0.01,
        betas=(0.9, 0.95),
        eps: float = 1e-8,
        clip_grad: float = 1.0,
        dist=None,
    ):
        self.dist = dist
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if not hasattr(p, "main_grad"):
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
        expert_ids = {id(p) for p in _split_expert_params(model)}
        self.is_expert = [id(p) in expert_ids for p in self.params]
        self.buffers = self._grad_buffers() if dist is not None and dist.enabled else []
        self.masters = [p.detach().float().clone() for p in self.params]
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = p.main_grad  # the optimizer reads main_grad directly
        decay = [m for m in self.masters if m.dim() >= 2]
        no_decay = [m for m in self.masters if m.dim() < 2]
        self.opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
        )
        self.clip_grad = clip_grad

    @torch.no_grad()
    def _grad_buffers(self) -> list[tuple[torch.Tensor, object]]:
        """[(buffer, process group)]: the dense main_grads in one buffer (every rank), the split
        experts' in another (the ranks holding the same experts); main_grads become views."""
        out = []
        for expert, group in ((False, None), (True, self.dist.expert_dp_group)):
            params = [p for p, e in zip(self.params, self.is_expert, strict=True) if e == expert]
            if not params:
                continue
            numel = sum(p.main_grad.numel() for p in params)
            buf = torch.zeros(numel, device=params[0].main_grad.device, dtype=torch.float32)
            offset = 0
            for p in params:
                n = p.main_grad.numel()
                view = buf[offset : offset + n].view_as(p.main_grad)
                view.copy_(p.main_grad)
                p.main_grad, offset = view, offset + n
            out.append((buf, group))
        return out

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Average every main_grad over the data-parallel ranks, in place (no-op on one rank)."""
        for buf, group in self.buffers:
            dist.all_reduce(buf, group=group)
            # each expert's gradient already sums the tokens of its whole EP group
            buf.div_(self.dist.world)

    def _clip(self) -> torch.Tensor:
        """Clip the masters' gradients to `clip_grad` (global L2 norm); returns the norm."""
        d = self.dist
        if d is None or d.ep_size == 1 or not any(self.is_expert):
            return torch.nn.utils.clip_grad_norm_(self.masters, self.clip_grad, foreach=True)
        grads = [m.grad for m in self.masters]
        sq = torch.stack(torch._foreach_norm(grads)).square()
        expert = torch.tensor(self.is_expert, device=sq.device)
        dense_sq, expert_sq = sq[~expert].sum(), sq[expert].sum()
        dist.all_reduce(expert_sq, group=d.ep_group)  # the other ranks' experts
        norm = (dense_sq + expert_sq).sqrt()
        coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return norm

    def zero_grad(self) -> None:
        torch._foreach_zero_([p.main_grad for p in self.params])

    @torch.no_grad()
    def step(self, lr: float) -> torch.Tensor:
        """Clip, update the masters, copy them into the parameters; returns the grad norm (device)."""
        norm = self._clip()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        torch._foreach_copy_(self.params, self.masters)
        return norm

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(), "masters": [m.detach() for m in self.masters]}


def _split_expert_params(model: nn.Module) -> list:
    """The parameters of routed experts that are split across ranks (their MoE has `ep`)."""
    out = []
    for m in model.modules():
        if getattr(m, "ep", None) is not None and hasattr(m, "experts"):
            out.extend(m.experts.parameters())
    return out

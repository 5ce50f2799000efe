"""AdamW over fp32 master copies, fed from each parameter's fp32 `main_grad`.

QuantLinear weights accumulate into `weight.main_grad` themselves (weight.grad stays None); every
other parameter gets a `main_grad` here and a post-accumulate hook that adds its .grad into it and
drops the .grad. `main_grad` buffers are zeroed in place (`zero_()`, never reallocated: captured
backward graphs hold their addresses), and parameters are updated in place (`copy_`) for the same
reason.
"""

from __future__ import annotations

import torch
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
    ):
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if not hasattr(p, "main_grad"):
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
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

    def zero_grad(self) -> None:
        torch._foreach_zero_([p.main_grad for p in self.params])

    @torch.no_grad()
    def step(self, lr: float) -> torch.Tensor:
        """Clip, update the masters, copy them into the parameters; returns the grad norm (device)."""
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.clip_grad, foreach=True)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        torch._foreach_copy_(self.params, self.masters)
        return norm

    def state_dict(self) -> dict:
        return {"adamw": self.opt.state_dict(), "masters": [m.detach() for m in self.masters]}

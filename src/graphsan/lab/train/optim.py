"""AdamW over fp32 master copies, fed from each parameter's fp32 `main_grad`.

QuantLinear weights accumulate into `weight.main_grad` themselves (weight.grad stays None); every
other parameter gets a `main_grad` here and a post-accumulate hook that adds its .grad into it and
drops the .grad. `main_grad` buffers are zeroed in place (`zero_()`, never reallocated: captured
backward graphs hold their addresses), and parameters are updated in place (`copy_`) for the same
reason.

Data parallel (`dist`, lab/train/distributed.py): the main_grads become views into one
contiguous fp32 buffer per group, as Megatron's grad buffer (allocated once, before any capture,
so the backward graphs accumulate into it): the dense parameters (reduced over every rank) and
the routed experts when split across ranks (reduced over the ranks that hold the same experts).
`reduce_grads()` runs eagerly after the last backward of a step, in one collective per buffer:
- without `distributed_optimizer`: an all-reduce; every rank then holds the gradient of the
  global batch's loss and takes the same step on its own fp32 masters and Adam states;
- with it (Megatron's distributed optimizer): the buffer is padded to a multiple of its group's
  size and cut into one contiguous shard per rank; a reduce-scatter leaves each rank the summed
  gradient of its shard only; each rank keeps fp32 masters and Adam states for the pieces of
  parameters inside its shard, steps them, writes them into its shard of the grad buffer (no
  longer needed until the next step zeroes it) and an all-gather brings every updated
  parameter back, copied into the model's bf16/fp32 parameters.
Either way the buffers are divided by the number of ranks (an expert's gradient already sums
the tokens of its whole EP group), and the clipping norm covers every parameter once: with
experts split, the other ranks' experts are added; with shards, the squared norms of the
shards are summed over every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


def _accumulate_into_main_grad(p: torch.Tensor) -> None:
    p.main_grad.add_(p.grad)
    p.grad = None


# torch >= 2.13 names the tensor forms of these collectives *_single (the old names warn)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def linear_warmup(lr: float, warmup_iters: int, it: int) -> float:
    """The learning rate of iteration `it` (1-based): rising linearly to `lr` over
    `warmup_iters` iterations, then constant (no warm-up when 0)."""
    return lr * min(1.0, it / warmup_iters) if warmup_iters else lr


def shard_bounds(numel: int, size: int, rank: int) -> tuple[int, int, int]:
    """(padded length, start, end) of rank `rank`'s shard of a buffer of `numel` elements cut
    into `size` equal contiguous shards (the buffer is padded up to a multiple of `size`)."""
    padded = -(-numel // size) * size
    per = padded // size
    return padded, rank * per, (rank + 1) * per


@dataclass
class GradBuffer:
    """One group's main_grads as views of one fp32 buffer, and this rank's shard of it."""

    data: torch.Tensor  # padded with zeros when sharded
    group: object  # the process group reducing it (None: every rank)
    params: list  # in buffer order
    offsets: list[int]
    size: int = 1  # ranks in the group
    rank: int = 0  # this rank's index in the group
    sharded: bool = False
    # sharded only: (index into params, first, last) of every param piece in this rank's shard,
    # the fp32 masters of the shard (flat, padding included) and the pieces as views of them
    pieces: list = field(default_factory=list)
    master: torch.Tensor | None = None
    master_pieces: list = field(default_factory=list)

    @property
    def shard(self) -> torch.Tensor:
        per = self.data.numel() // self.size
        return self.data[self.rank * per : (self.rank + 1) * per]

    @property
    def shard_start(self) -> int:
        return self.rank * (self.data.numel() // self.size)


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
        distributed_optimizer: bool = False,
    ):
        self.dist = dist
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if not hasattr(p, "main_grad"):
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
        expert_ids = {id(p) for p in _split_expert_params(model)}
        self.is_expert = [id(p) in expert_ids for p in self.params]
        enabled = dist is not None and dist.enabled
        self.sharded = distributed_optimizer and enabled
        self.buffers = self._grad_buffers() if enabled else []
        if self.sharded:
            self.masters = [m for b in self.buffers for m in b.master_pieces]
            dims = [b.params[i].dim() for b in self.buffers for i, _, _ in b.pieces]
        else:
            self.masters = [p.detach().float().clone() for p in self.params]
            for m, p in zip(self.masters, self.params, strict=True):
                m.grad = p.main_grad  # the optimizer reads main_grad directly
            dims = [p.dim() for p in self.params]
        # decay by the whole parameter's shape (a shard's piece of a matrix is 1-D)
        decay = [m for m, d in zip(self.masters, dims, strict=True) if d >= 2]
        no_decay = [m for m, d in zip(self.masters, dims, strict=True) if d < 2]
        if not decay and not no_decay:  # a rank whose shards hold only padding steps nothing
            no_decay = [torch.zeros(0, device=self.params[0].device)]
            no_decay[0].grad = torch.zeros_like(no_decay[0])
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
    def _grad_buffers(self) -> list[GradBuffer]:
        """The dense main_grads in one buffer (every rank), the split experts' in another (the
        ranks holding the same experts); main_grads become views. Sharded: each rank's masters
        for its shard."""
        d, out = self.dist, []
        for expert in (False, True):
            index = [i for i, e in enumerate(self.is_expert) if e == expert]
            if not index:
                continue
            params = [self.params[i] for i in index]
            group, size, rank = None, d.world, d.rank
            if expert:  # ranks k, k + ep, ... hold the same experts
                group, size, rank = d.expert_dp_group, d.world // d.ep_size, d.rank // d.ep_size
            numel = sum(p.numel() for p in params)
            padded = shard_bounds(numel, size, rank)[0] if self.sharded else numel
            device = params[0].main_grad.device
            buf = GradBuffer(
                torch.zeros(padded, device=device, dtype=torch.float32),
                group,
                params,
                [],
                size,
                rank,
                self.sharded,
            )
            offset = 0
            for p in params:
                n = p.numel()
                view = buf.data[offset : offset + n].view_as(p.main_grad)
                view.copy_(p.main_grad)
                p.main_grad = view
                buf.offsets.append(offset)
                offset += n
            if self.sharded:
                self._shard(buf)
            out.append(buf)
        return out

    @torch.no_grad()
    def _shard(self, buf: GradBuffer) -> None:
        """This rank's fp32 masters: the parameters' values over its shard, one piece (a flat
        view of `buf.master`, whose .grad is the same range of the grad buffer) per parameter
        that reaches into the shard."""
        start = buf.shard_start
        end = start + buf.shard.numel()
        buf.master = torch.zeros(end - start, device=buf.data.device, dtype=torch.float32)
        for i, (p, off) in enumerate(zip(buf.params, buf.offsets, strict=True)):
            lo, hi = max(off, start), min(off + p.numel(), end)
            if lo >= hi:
                continue
            piece = buf.master[lo - start : hi - start]
            piece.copy_(p.detach().reshape(-1)[lo - off : hi - off])
            piece.grad = buf.data[lo:hi]
            buf.pieces.append((i, lo - off, hi - off))
            buf.master_pieces.append(piece)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Average every main_grad over the data-parallel ranks, in place (no-op on one rank);
        sharded, only this rank's shard of each buffer is reduced."""
        for buf in self.buffers:
            if buf.sharded:
                _reduce_scatter(buf.shard, buf.data, group=buf.group)
                target = buf.shard
            else:
                dist.all_reduce(buf.data, group=buf.group)
                target = buf.data
            # each expert's gradient already sums the tokens of its whole EP group
            target.div_(self.dist.world)

    def _clip(self) -> torch.Tensor:
        """Clip the masters' gradients to `clip_grad` (global L2 norm); returns the norm."""
        d = self.dist
        grads = [m.grad for m in self.masters]
        if self.sharded:  # every element of every buffer lies in exactly one rank's shard
            sq = _sum_of_squares(grads, self.buffers[0].data)
            dist.all_reduce(sq)
            norm = sq.sqrt()
        elif d is None or d.ep_size == 1 or not any(self.is_expert):
            return torch.nn.utils.clip_grad_norm_(self.masters, self.clip_grad, foreach=True)
        else:
            sq = torch.stack(torch._foreach_norm(grads)).square()
            expert = torch.tensor(self.is_expert, device=sq.device)
            dense_sq, expert_sq = sq[~expert].sum(), sq[expert].sum()
            dist.all_reduce(expert_sq, group=d.ep_group)  # the other ranks' experts
            norm = (dense_sq + expert_sq).sqrt()
        coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        return norm

    def zero_grad(self) -> None:
        if self.buffers:  # the whole buffer: sharded, it holds the last gathered parameters
            torch._foreach_zero_([b.data for b in self.buffers])
        else:
            torch._foreach_zero_([p.main_grad for p in self.params])

    @torch.no_grad()
    def step(self, lr: float) -> torch.Tensor:
        """Clip, update the masters, copy them into the parameters; returns the grad norm (device)."""
        norm = self._clip()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        if not self.sharded:
            torch._foreach_copy_(self.params, self.masters)
            return norm
        for buf in self.buffers:
            buf.shard.copy_(buf.master)  # the gradients are spent: the buffer carries the values
            _all_gather(buf.data, buf.shard, group=buf.group)
            torch._foreach_copy_(buf.params, [p.main_grad for p in buf.params])
        return norm

    # ---- full (unsharded) views, for tests and checkpoints ----
    @torch.no_grad()
    def reduced_main_grads(self) -> list[torch.Tensor]:
        """Every parameter's averaged main_grad (after `reduce_grads`); sharded, the shards are
        gathered into new tensors (one all-gather per buffer)."""
        if not self.sharded:
            return [p.main_grad for p in self.params]
        out = {}
        for buf in self.buffers:
            full = torch.empty_like(buf.data)
            _all_gather(full, buf.shard.clone(), group=buf.group)
            for p, off in zip(buf.params, buf.offsets, strict=True):
                out[id(p)] = full[off : off + p.numel()].view_as(p)
        return [out[id(p)] for p in self.params]

    @torch.no_grad()
    def state_dict(self) -> dict:
        """The full state of every parameter, in `self.params` order, whether sharded or not:
        fp32 masters, Adam moments and the step count (sharded, gathered with one all-gather
        per buffer and state on every rank of the group: a collective, so every rank calls it;
        unsharded, the live tensors themselves: write or copy them before the next step).
        The same format either way, so a checkpoint loads with or without the distributed
        optimizer."""
        keys = ("exp_avg", "exp_avg_sq")
        state = self.opt.state
        step = max((float(s["step"]) for s in state.values() if "step" in s), default=0.0)
        if not self.sharded:  # references, no copies: a save allocates nothing on the device
            full = {"masters": [m.detach() for m in self.masters]}
            for k in keys:
                full[k] = [
                    state[m][k] if k in state[m] else torch.zeros_like(m) for m in self.masters
                ]
            return {"step": step, **full}
        full = {k: [None] * len(self.params) for k in ("masters", *keys)}
        index = {id(p): i for i, p in enumerate(self.params)}
        for buf in self.buffers:
            flats = {"masters": buf.master}
            for k in keys:
                flat = torch.zeros_like(buf.master)
                for m, (i, lo, hi) in zip(buf.master_pieces, buf.pieces, strict=True):
                    if k in state[m]:
                        start = buf.offsets[i] + lo - buf.shard_start
                        flat[start : start + hi - lo] = state[m][k]
                flats[k] = flat
            for k, flat in flats.items():
                whole = torch.empty_like(buf.data)
                _all_gather(whole, flat, group=buf.group)
                for p, off in zip(buf.params, buf.offsets, strict=True):
                    full[k][index[id(p)]] = whole[off : off + p.numel()].view_as(p).clone()
        return {"step": step, **full}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Restore a `state_dict()` (of a sharded or an unsharded optimizer); each rank takes
        its shard. The parameters are set from the masters."""
        n = len(self.params)
        for k in ("masters", "exp_avg", "exp_avg_sq"):
            if len(sd.get(k, ())) != n:
                raise ValueError(
                    f"optimizer state: {len(sd.get(k, ()))} {k}; expected {n} (one per "
                    "trainable parameter of this model)"
                )
        pieces = []  # (master, parameter index, first, last) in optimizer order
        if self.sharded:
            for buf in self.buffers:
                index = {id(p): i for i, p in enumerate(self.params)}
                for m, (i, lo, hi) in zip(buf.master_pieces, buf.pieces, strict=True):
                    pieces.append((m, index[id(buf.params[i])], lo, hi))
        else:
            pieces = [(m, i, 0, m.numel()) for i, m in enumerate(self.masters)]
        ids = {
            id(m): k for k, m in enumerate(m for g in self.opt.param_groups for m in g["params"])
        }
        torch_state = {}
        for m, i, lo, hi in pieces:
            if sd["masters"][i].shape != self.params[i].shape:
                raise ValueError(
                    f"optimizer state: parameter {i} has shape {tuple(sd['masters'][i].shape)}; "
                    f"expected {tuple(self.params[i].shape)}"
                )

            def part(t, lo=lo, hi=hi, m=m):
                return t.reshape(-1)[lo:hi].to(m.device, torch.float32).view_as(m)

            m.copy_(part(sd["masters"][i]))
            if sd["step"]:
                torch_state[ids[id(m)]] = {
                    "step": torch.tensor(float(sd["step"])),
                    "exp_avg": part(sd["exp_avg"][i]).clone(),
                    "exp_avg_sq": part(sd["exp_avg_sq"][i]).clone(),
                }
        self.opt.load_state_dict(
            {"state": torch_state, "param_groups": self.opt.state_dict()["param_groups"]}
        )
        for p, m in zip(self.params, sd["masters"], strict=True):
            p.copy_(m.to(p.device))


def _sum_of_squares(tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if not tensors:  # a rank whose shards hold only padding
        return torch.zeros((), device=like.device, dtype=torch.float32)
    return torch.stack(torch._foreach_norm(tensors)).square().sum()


def _split_expert_params(model: nn.Module) -> list:
    """The parameters of routed experts that are split across ranks (their MoE has `ep`)."""
    out = []
    for m in model.modules():
        if getattr(m, "ep", None) is not None and hasattr(m, "experts"):
            out.extend(m.experts.parameters())
    return out

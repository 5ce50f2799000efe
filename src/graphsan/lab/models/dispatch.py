"""Expert parallelism for the routed experts: each rank of an expert-parallel (EP) group holds
`num_experts / ep_size` consecutive experts, and the permuted token copies travel to the rank
that holds their expert and back (all-to-all with split sizes), as Megatron's alltoall token
dispatcher does.

    permuted rows (expert-major over all E experts, each expert's count padded)
      -> exchange the per-expert counts (all-to-all, equal splits)
      -> host sync: the split sizes (so this part never runs inside a CUDA graph)
      -> dispatch: rows for experts of rank s go to rank s (all-to-all, split sizes)
      -> sort the received chunks (source, expert) into expert-major order
      -> local experts (grouped GEMMs)
      -> unsort, combine all-to-all back to the source rank

Every (source rank, expert) chunk is padded to `moe_pad_multiple` rows before it leaves its
rank, so an expert's rows on its rank stay a multiple of the quantization block and no block
crosses two experts. The model's graphed scopes end before the dispatch (the router and the
preprocess), the same place where Megatron's `moe_preprocess` capture stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's place in its expert-parallel group."""

    group: object  # a torch.distributed ProcessGroup (None: the default group)
    rank: int  # rank within the EP group
    size: int  # ranks in the EP group
    num_experts: int  # experts of the whole model

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def first_expert(self) -> int:
        return self.rank * self.local_experts


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes; its backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    # gloo has no bfloat16 all-to-all: CPU runs carry it as float32 (exact for bf16 values)
    wire = torch.float32 if x.device.type == "cpu" and x.dtype == torch.bfloat16 else x.dtype
    src = x.to(wire).contiguous()
    out = src.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, src, out_splits, in_splits, group=group)
    return out.to(x.dtype)


def _reorder(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """The chunks of `x` (rows, of `sizes`) in the order `order` (differentiable)."""
    chunks = x.split(sizes)
    return torch.cat([chunks[i] for i in order]) if chunks else x


def dispatch_and_run(
    ep: ExpertParallel,
    experts: nn.Module,
    permuted: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    row_multiple: int,
) -> tuple[torch.Tensor, int]:
    """Send the permuted rows to their experts' ranks, run the local experts, bring the rows
    back. Returns (expert output rows in `permuted`'s order, [total, D]; total rows sent)."""
    n, size = ep.local_experts, ep.size
    counts = tokens_per_expert.to(torch.int64)
    recv_counts = _all_to_all(counts, [n] * size, [n] * size, ep.group)
    # the one host sync of the layer: split sizes must be known on the host
    both = torch.cat([counts, recv_counts]).tolist()
    send, recv = both[: ep.num_experts], both[ep.num_experts :]
    send_splits = [sum(send[s * n : (s + 1) * n]) for s in range(size)]
    recv_splits = [sum(recv[s * n : (s + 1) * n]) for s in range(size)]
    total = sum(send_splits)
    received = _AllToAll.apply(permuted[:total], recv_splits, send_splits, ep.group)
    # received chunks are (source, local expert); the experts want (local expert, source)
    by_source = recv  # chunk k = s * n + e has recv[k] rows
    order = [s * n + e for e in range(n) for s in range(size)]
    rows = _reorder(received, by_source, order)
    local_counts = [sum(recv[s * n + e] for s in range(size)) for e in range(n)]
    used = sum(local_counts)
    if used == 0:
        # nothing came: a block of padding rows keeps the GEMM shapes legal, and `received`
        # stays in the autograd graph so this rank joins the backward all-to-all like the others
        rows = torch.cat([rows, rows.new_zeros((row_multiple, rows.shape[1]))])
    offsets = torch.tensor(local_counts, device=rows.device).cumsum(0).to(torch.int32)
    out = experts(rows, offsets)[:used]
    # back to (source, local expert) order, then to the source ranks
    sizes_sorted = [by_source[k] for k in order]
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    out = _reorder(out, sizes_sorted, inverse)
    return _AllToAll.apply(out, send_splits, recv_splits, ep.group), total

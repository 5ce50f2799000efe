"""The lab on several processes: torch.distributed as torchrun sets it up.

    torchrun --nproc-per-node 2 -m graphsan.cli train --preset small ...

Environment (torchrun's, single or multi node): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT. Without WORLD_SIZE > 1 the lab runs in one process, exactly as before.

Process groups (all ranks are data parallel, Megatron's layout with tensor and pipeline
parallelism 1):
    world       every rank: the dense parameters' gradients, the loss, the router's token counts
    ep          `expert_model_parallel_size` consecutive ranks share the routed experts, each
                holding `num_experts / ep` of them; tokens travel by all-to-all inside it
    expert_dp   the ranks holding the same experts (one per EP group): the expert gradients

What runs where (docs/architecture.md, "Distributed"): every collective is eager. The graphed
scopes (attention, Mamba, router, preprocess, MLP) hold no collective, as in Megatron's
per-module graphs: the token dispatch needs split sizes on the host, and the data-parallel
gradient reduction runs once per step after the last backward, over main_grad buffers that the
backward graphs accumulate into in place.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from graphsan.lab.models.dispatch import ExpertParallel

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class DistributedError(ValueError):
    """A distributed setting that cannot work; the message names it and what was expected."""


@dataclass
class Dist:
    """This process's place in the job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    expert_dp_group: object = None
    owns_group: bool = False  # this object initialised the default group (and destroys it)

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def expert_parallel(self, num_experts: int) -> ExpertParallel | None:
        """This rank's share of `num_experts` routed experts (None: every rank holds all)."""
        if self.ep_size == 1:
            return None
        return ExpertParallel(self.ep_group, self.rank % self.ep_size, self.ep_size, num_experts)

    def all_reduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        """Average `t` over every rank, in place."""
        if self.enabled:
            dist.all_reduce(t)
            t.div_(self.world)
        return t

    def all_reduce_sum_(self, t: torch.Tensor, group=None) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, group=group)
        return t

    def max_(self, value: int, device: torch.device) -> int:
        """The largest of every rank's `value` (this rank's own when not distributed)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)  # NCCL reduces device tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def world_from_env(environ=None) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it.
    A malformed or inconsistent variable raises DistributedError naming it."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return 0, 1, 0
    values = {}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        raw = env.get(name, "0" if name != "WORLD_SIZE" else "1")
        try:
            values[name] = int(raw)
        except ValueError:
            raise DistributedError(
                f"environment {name}={raw!r}: expected an integer (as torchrun sets it)"
            ) from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise DistributedError(
            f"environment RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local}: expected "
            "0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0 (as torchrun sets them)"
        )
    if world > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if missing:
            raise DistributedError(
                f"WORLD_SIZE={world} but {' and '.join(missing)} not set; launch with torchrun "
                "(or set every one of " + ", ".join(ENV) + ")"
            )
    return rank, world, local


def check_device_for_rank(device_name: str, local_rank: int) -> str:
    """The device this rank trains on: `auto` and `cuda` become cuda:LOCAL_RANK when CUDA is
    there; a rank without a GPU of its own is refused."""
    if device_name in ("auto", "cuda") and (device_name == "cuda" or torch.cuda.is_available()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= n:
            raise DistributedError(
                f"LOCAL_RANK {local_rank} needs GPU cuda:{local_rank}, but this machine has {n} "
                f"GPU(s); expected --nproc-per-node <= {n} (or --device cpu)"
            )
        return f"cuda:{local_rank}"
    if device_name.startswith("cuda:"):
        raise DistributedError(
            f"--device {device_name}: under torchrun each rank trains on cuda:LOCAL_RANK; "
            "expected --device cuda (or auto)"
        )
    return device_name


def setup(device: torch.device, ep_size: int, timeout_minutes: float, environ=None) -> Dist:
    """Join the job torchrun started (a no-op for one process) and build the EP groups."""
    rank, world, local = world_from_env(environ)
    if world == 1:
        return Dist()
    if world % ep_size:  # TrainConfig.validate says so first; this guards other callers
        raise DistributedError(
            f"--expert-model-parallel-size {ep_size}: {world} processes; expected a divisor of "
            "the number of processes"
        )
    out = Dist(rank=rank, world=world, local_rank=local, ep_size=ep_size)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            **kwargs,
        )
        out.owns_group = True
    ep_group = dp_group = None
    # every rank creates every group, in the same order (torch.distributed requires it)
    for first in range(0, world, ep_size):
        g = dist.new_group(list(range(first, first + ep_size)))
        if first <= rank < first + ep_size:
            ep_group = g
    for k in range(ep_size):
        g = dist.new_group(list(range(k, world, ep_size)))
        if rank % ep_size == k:
            dp_group = g
    out.ep_group, out.expert_dp_group = ep_group, dp_group
    return out

"""An out-of-memory error during `graphsan train`, told in one line: how much the failed
allocation asked for (or, for a step found too large before allocating, what it needs and what
the machine has), and the options of this run that size its memory, with their values."""

from __future__ import annotations

import re

from graphsan.lab.models.args import PRESETS
from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.device import StepTooLarge

# the CPU allocator's, the CUDA caching allocator's and cuBLAS's words for a failed allocation
_OOM_TEXT = re.compile(r"can't allocate memory|not enough memory|out of memory|ALLOC_FAILED")
_ASKED = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)? ?[KMGT]i?B|\d+ bytes)")


def is_out_of_memory(err: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda's is the same class), a step found too large before
    allocating (StepTooLarge), or a RuntimeError whose message says an allocation failed (the
    CPU allocator raises a plain RuntimeError)."""
    import torch

    if isinstance(err, (torch.OutOfMemoryError, StepTooLarge)):
        return True
    return isinstance(err, RuntimeError) and bool(_OOM_TEXT.search(str(err)))


def _asked(err: BaseException) -> str:
    """ " (tried to allocate 2.00 GiB)" from the error's message ("" where it does not say); for
    a step found too large before allocating, what it needs against what the machine has."""
    if isinstance(err, StepTooLarge):
        return f" ({err.detail})"
    m = _ASKED.search(str(err))
    if m is None:
        return ""
    amount = m.group(1)
    if amount.endswith(" bytes"):
        amount = f"{int(amount.split()[0]) / 2**30:,.2f} GiB"
    return f" (tried to allocate {amount})"


def out_of_memory_line(err: BaseException, cfg: TrainConfig) -> str:
    """The error line: what was asked for, then the knobs to lower with their values now."""
    lower = [
        f"--micro-batch-size (now {cfg.micro_batch_size})",
        f"--seq-length (now {cfg.seq_length})",
    ]
    if cfg.microbatch_schedule == "1f1b":  # the forwards in flight keep their activations
        lower.append(f"--microbatches-in-flight (now {cfg.microbatches_in_flight})")
    advice = [f"lower {', '.join(lower[:-1])} or {lower[-1]}"]
    if cfg.cuda_graph_modules:  # each microbatch's graphs keep buffers of their own
        advice.append(f"graph fewer --cuda-graph-modules (now {' '.join(cfg.cuda_graph_modules)})")
    names = list(PRESETS)
    smaller = names[: names.index(cfg.preset)] if cfg.preset in names else []
    if smaller:
        advice.append(f"pick a smaller --preset than {cfg.preset} ({', '.join(smaller)})")
    if (cfg.world_size or 1) > 1 and not cfg.use_distributed_optimizer:
        advice.append("--use-distributed-optimizer shards the optimizer state over the ranks")
    return f"out of memory{_asked(err)}; {'; '.join(advice)}"

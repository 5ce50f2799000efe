"""A train step's microbatches: every forward and backward in the order of a microbatch
schedule (`graphsan.lab.choices.schedule_order`: sequential, or 1F1B with N in flight)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphsan.lab.choices import Pass
from graphsan.lab.quant import SkipFlag
from graphsan.lab.train.graphs import MicrobatchCounter


def run_microbatches(
    model,
    order: list[Pass],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    skip: SkipFlag,
    counter: MicrobatchCounter,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward every microbatch as `order` says; `batch(mb)` is microbatch mb's
    (tokens, labels) on the device. The first forward refreshes the quantized weights (skip
    flag 0), the others reuse them (1), as TE's `is_first_microbatch`; each backward's loss is
    divided by the number of microbatches (gradient accumulation). Returns the LM and MTP
    losses, averaged over the microbatches, as device tensors."""
    num_mb = len({mb for _, mb in order})
    device = next(model.parameters()).device
    lm, mtp = torch.zeros((), device=device), torch.zeros((), device=device)
    pending = {}  # microbatch -> its forward's outputs, until its backward
    for kind, mb in order:
        if kind == "F":
            skip.set(0 if mb == 0 else 1)
            counter.index = mb  # the graphs the forward replays; backward follows it
            pending[mb] = model(*batch(mb))
            continue
        out = pending.pop(mb)
        (out["loss"] / num_mb).backward()
        lm += out["lm_loss"] / num_mb
        if "mtp_loss" in out:
            mtp += out["mtp_loss"] / num_mb
        # a live autograd graph would keep grad accumulators alive into a later capture
        del out
    return lm, mtp

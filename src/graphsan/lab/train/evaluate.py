"""Validation: eager (model.eval() + no_grad, so the graphed stages run their eager methods),
tagged as graphsan's "eval" phase, between manual collections where --manual-gc-interval is on
(Megatron collects before and after evaluation)."""

from __future__ import annotations

import gc

import torch

import graphsan
from graphsan.lab.quant import SkipFlag
from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.data import RankBatches
from graphsan.lab.train.distributed import Dist


def evaluate(
    model, batches: RankBatches, cfg: TrainConfig, skip: SkipFlag, dist: Dist, it: int
) -> float:
    """The validation loss at iteration `it`: the mean LM loss over `cfg.eval_iters`
    iterations of every microbatch, averaged over the ranks."""
    num_mb = cfg.num_microbatches
    if cfg.manual_gc_interval:
        gc.collect()
    with graphsan.phase("eval", step=it):  # frees are tagged "eval, step it"
        model.eval()
        total = torch.zeros((), device=batches.device)
        with torch.no_grad():
            for k in range(cfg.eval_iters):
                for mb in range(num_mb):
                    skip.set(0 if k == 0 and mb == 0 else 1)
                    total += model(*batches.get("valid", k, mb))["lm_loss"]
        model.train()
        total = dist.all_reduce_mean_(total)
        loss = (total / max(1, cfg.eval_iters * num_mb)).item()
    if cfg.manual_gc_interval:
        gc.collect()
    return loss

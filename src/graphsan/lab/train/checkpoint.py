"""Checkpoint save (torch.save of model, optimizer and iteration), written atomically.

Megatron Core 0.19 calls `torch.cuda.empty_cache()` after every save; `empty_cache=True` does the
same (under expandable segments that unmaps freed memory, which is how TE #3316 turns a stale
pointer into an illegal address).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def save_checkpoint(
    directory: str | Path,
    iteration: int,
    model,
    optimizer,
    *,
    empty_cache: bool,
    name: str = "latest.pt",
    write: bool = True,
):
    """Write `name` in `directory` (unless `write` is False: a rank whose copy another rank
    writes), then empty the CUDA cache if asked; returns the path."""
    directory = Path(directory)
    path = directory / name
    if not write:
        if empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return path
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f"{name}.tmp"
    state = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_args": vars(model.args),
    }
    torch.save(state, tmp)
    os.replace(tmp, path)
    if empty_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path

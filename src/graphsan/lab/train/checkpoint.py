"""Checkpoints: save (torch.save of model, optimizer and iteration, written atomically) and load.

Megatron Core 0.19 calls `torch.cuda.empty_cache()` after every save; `empty_cache=True` does the
same (under expandable segments that unmaps freed memory, which is how TE #3316 turns a stale
pointer into an illegal address).

The optimizer's state is the full state of every parameter (`MainGradAdamW.state_dict`): with
the distributed optimizer the ranks' shards are gathered before the write, so one file holds it
all and loads with or without sharding (each rank then takes its own shard).

`Checkpointer` is the trainer's side: which ranks write, the file of each expert shard, and a
checkpoint that cannot resume this run as one ConfigError line.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.distributed import Dist


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what was expected."""


def save_checkpoint(
    directory: str | Path,
    iteration: int,
    model,
    optimizer_state: dict | None,
    *,
    empty_cache: bool,
    name: str = "latest.pt",
    write: bool = True,
    extra: dict | None = None,
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
        "optimizer": optimizer_state,
        "model_args": vars(model.args),
        **(extra or {}),
    }
    torch.save(state, tmp)
    os.replace(tmp, path)
    if empty_cache and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def load_checkpoint(directory: str | Path, name: str, model_args: dict) -> dict:
    """The checkpoint `name` in `directory`, checked against this run's model arguments."""
    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(
            f"--load {directory}: no {name} there; expected a directory written by --save "
            "(with the same --expert-model-parallel-size)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file: say which, not a traceback
        raise CheckpointError(f"--load {path}: cannot be read ({err})") from None
    keys = ("iteration", "model", "optimizer", "model_args")
    missing = [k for k in keys if k not in state] if isinstance(state, dict) else list(keys)
    if missing or state["optimizer"] is None:
        raise CheckpointError(
            f"--load {path}: keys {missing or ['optimizer']} missing; expected a checkpoint of "
            "graphsan train"
        )
    if state["model_args"] != model_args:
        diff = sorted(
            k
            for k in set(model_args) | set(state["model_args"])
            if state["model_args"].get(k) != model_args.get(k)
        )
        k = diff[0]
        raise CheckpointError(
            f"--load {path}: model argument {k} is {state['model_args'].get(k)!r} there; "
            f"expected {model_args.get(k)!r} (the same --preset and model settings)"
        )
    return state


class Checkpointer:
    """Saves and loads one run's model, optimizer and iteration for --save and --load."""

    def __init__(self, cfg: TrainConfig, dist: Dist, model, opt):
        self.cfg, self.dist, self.model, self.opt = cfg, dist, model, opt

    @property
    def name(self) -> str:
        """This rank's file: one per expert shard, the data-parallel copies share it."""
        d = self.dist
        return "latest.pt" if d.ep_size == 1 else f"latest.ep{d.rank % d.ep_size}.pt"

    def save(self, it: int) -> Path:
        """Every rank calls this; returns the path of this rank's file."""
        cfg, d = self.cfg, self.dist
        # data-parallel ranks hold the same weights: the first EP group writes, one file per
        # expert shard (every rank empties its cache, as every Megatron rank does); a sharded
        # optimizer's state is gathered first, which every rank of its groups takes part in
        write = d.rank < d.ep_size
        state = self.opt.state_dict() if write or self.opt.sharded else None
        return save_checkpoint(
            cfg.save,
            it,
            self.model,
            state if write else None,
            empty_cache=cfg.empty_cache_on_save,
            name=self.name,
            write=write,
            extra={"expert_model_parallel_size": d.ep_size},
        )

    def load(self, directory: str) -> int:
        """Restore the model, the optimizer (each rank its shard) and the iteration of a
        checkpoint in `directory` (--load); returns the iteration it was saved at."""
        try:
            state = load_checkpoint(directory, self.name, vars(self.model.args))
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
        except (CheckpointError, RuntimeError, ValueError) as err:
            raise ConfigError(str(err).splitlines()[0]) from None
        it = int(state["iteration"])
        if it >= self.cfg.train_iters:
            raise ConfigError(
                f"--load {directory}: the checkpoint is at iteration {it}; expected "
                f"--train-iters above it (now {self.cfg.train_iters})"
            )
        return it

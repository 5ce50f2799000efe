"""Checkpoints: save (torch.save of model, optimizer and iteration, written atomically) and load.

A save writes `NAME.tmp` beside the file and renames it over `NAME` once the whole of it is on
disk: a save that fails (a full disk, a file-size limit, an I/O error, a signal) removes the
temporary file and leaves the previous `NAME` as it was; a failed write is a CheckpointWriteError
naming the file and the system's reason.

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

import contextlib
import os
from pathlib import Path

import torch

from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.distributed import Dist


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what was expected."""


class CheckpointWriteError(Exception):
    """A checkpoint the system would not let us write: `path` the file it was to become,
    `reason` the system's words (`strerror`: "No space left on device")."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"cannot write {path} ({reason})")
        self.path, self.reason = Path(path), reason


class SaveFailed(Exception):
    """Training stopped because a checkpoint could not be written; the message is the whole
    line: the option, the file, the iteration, the reason and where the last good checkpoint
    is."""


def _os_error(err: BaseException) -> OSError | None:
    """The OSError behind `err`: itself, or one it was raised from or while handling (torch's
    zip writer turns a failed write into a RuntimeError whose context is the OSError)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


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
    writes), then empty the CUDA cache if asked; returns the path. Raises CheckpointWriteError
    where the system refuses the write; the previous file of that name is then kept."""
    directory = Path(directory)
    path = directory / name
    if not write:
        if empty_cache and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return path
    tmp = directory / f"{name}.tmp"
    state = {
        "iteration": iteration,
        "model": model.state_dict(),
        "optimizer": optimizer_state,
        "model_args": vars(model.args),
        **(extra or {}),
    }
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # through a Python file: a failed write keeps its errno (torch's own file writer says
        # only "iostream error"), and the data is on disk before the rename
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        cause = _os_error(err)
        if cause is None or isinstance(err, KeyboardInterrupt):
            raise
        raise CheckpointWriteError(path, cause.strerror or str(cause)) from err
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

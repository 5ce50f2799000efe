"""Where a run trains and whether it fits there: the device named by --device, and the memory a
model needs (counted on the meta device) against what the machine has free."""

from __future__ import annotations

import os

import torch

from graphsan.lab.models import build_model
from graphsan.lab.train.config import ConfigError, TrainConfig

# Bytes per trainable parameter besides the weight itself: fp32 main_grad, fp32 master copy and
# AdamW's two fp32 moments (activations and workspaces come on top).
TRAIN_STATE_BYTES = 16
SHARDED_STATE_BYTES = 12  # the master and the moments, which the distributed optimizer shards


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ValueError(f"--device {name}: this machine has {n} GPU(s); expected cuda:0-{n - 1}")
    return dev


def memory_needed(cfg: TrainConfig) -> tuple[int, int, int]:
    """(bytes needed on the device at least, bytes of the weights, trainable parameters), from
    the model built on the meta device, as `--dry-run` does. With the distributed optimizer each
    rank holds 1/ranks of the masters and moments (the experts' too: 1/E of the experts over
    ranks/E shards)."""
    model = build_model(cfg.model_args(), device="meta")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = TRAIN_STATE_BYTES * trainable
    if cfg.use_distributed_optimizer and (cfg.world_size or 1) > 1:
        state -= SHARDED_STATE_BYTES * trainable * (cfg.world_size - 1) // cfg.world_size
    return weights + state, weights, trainable


def free_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device, or the RAM available to a new allocation (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_memory(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse a model the machine cannot hold before allocating any of it (a too-large build
    would run for a long time and then die)."""
    need, weights, trainable = memory_needed(cfg)
    # the weights are drawn on the CPU and then moved, so CPU memory must hold them too
    places = [(device, need)] + ([(torch.device("cpu"), weights)] if device.type != "cpu" else [])
    for where, nbytes in places:
        free = free_memory(where)
        if free is not None and nbytes > free:
            what = "training" if where == device else "building the weights (on the CPU)"
            raise ConfigError(
                f"--preset {cfg.preset}: {what} needs at least {_gib(nbytes)} "
                f"({trainable / 1e9:.2f} B trainable parameters); {where} has {_gib(free)} free. "
                "`--dry-run` shows its counts without allocating; try a smaller --preset"
            )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"

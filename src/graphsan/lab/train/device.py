"""Where a run trains and whether it fits there: the device named by --device, and the memory a
run needs against what the machine has free, both counted on the meta device before anything is
allocated:

- the model's state (weights, gradients, optimizer): a preset too large for the machine is a bad
  option (ConfigError);
- a training step's tensors: one microbatch's forward and backward run on the meta device at
  this run's shapes, every tensor's bytes counted while it lives (`step_memory`); a step too large
  is out of memory (StepTooLarge), one line naming the options to lower, rather than a process
  the kernel kills half-way through its first step.

What the machine has: the CUDA device's free memory, or for the CPU the smaller of the kernel's
MemAvailable and what the process's cgroups leave (`available_ram`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


class StepTooLarge(RuntimeError):
    """A training step that cannot fit in what the machine has, found before allocating: the
    command's out-of-memory line (lab/train/oom.py) tells `detail`."""

    def __init__(self, detail: str):
        super().__init__(f"out of memory: {detail}")
        self.detail = detail


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors that operations create, from their creation until their
    storage dies, and the peak of that sum (`peak`); `now` is the sum at this moment."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._live: dict[int, tuple[int, weakref.ref]] = {}

    def _died(self, key: int) -> None:
        nbytes, _ = self._live.pop(key, (0, None))
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata  # the storage itself: views of it count once
            if key not in self._live:
                ref = weakref.ref(storage, lambda _, key=key: self._died(key))
                self._live[key] = (storage.nbytes(), ref)
                self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


# (the model's arguments, micro-batch size, sequence length) -> step_memory's answer: runs of
# one process (tests, the repro matrix) count each shape once
_STEPS: dict[tuple[str, int, int], tuple[int, int] | None] = {}


def step_memory(cfg: TrainConfig) -> tuple[int, int] | None:
    """(peak bytes of one microbatch's forward and backward, bytes its forward keeps for the
    backward), counted on the meta device at this run's micro-batch size and sequence length,
    in BF16 (a recipe's quantized copies come on top); None where the meta device cannot run the
    model. Nothing is allocated, and the count takes the same time at any size."""
    args = cfg.model_args()
    key = (repr(args), cfg.micro_batch_size, cfg.seq_length)
    if key not in _STEPS:
        _STEPS[key] = _count_step(args, cfg.micro_batch_size, cfg.seq_length)
    return _STEPS[key]


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel (flash or memory-efficient, on CPU and CUDA) allocates: the
    output and a float32 log-sum-exp per query, kept for the backward with the inputs, and the
    three gradients. On the meta device torch takes the math path instead, which holds the
    sequence-by-sequence scores that the real kernels never make."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fused_attention(q, k, v, *args, **kwargs):
    return _FusedAttention.apply(q, k, v)


def _count_step(args, micro_batch_size: int, seq_length: int) -> tuple[int, int] | None:
    model = build_model(args, device="meta")
    model.train()
    tokens = torch.zeros(micro_batch_size, seq_length, dtype=torch.long, device="meta")
    try:
        # the model calls F.scaled_dot_product_attention: counted as the fused kernels allocate
        with (
            mock.patch.object(F, "scaled_dot_product_attention", _fused_attention),
            _LiveBytes() as count,
        ):
            out = model(tokens, tokens)
            held = count.now  # what the forward keeps for the backward
            out["loss"].backward()
    except Exception:  # an operation the meta device cannot run: not counted, not refused
        return None
    return count.peak, held


def free_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device, or the RAM available to a new allocation (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_ram()


def available_ram(
    meminfo: str = "/proc/meminfo",
    cgroups: str = "/proc/self/cgroup",
    cgroup_root: str = "/sys/fs/cgroup",
) -> int | None:
    """The RAM a new allocation can have: the kernel's MemAvailable, or less where a cgroup of
    this process (a container's, a job's) limits memory: its limit less what it uses, page cache
    not counted as used (the kernel reclaims it before it kills). None: neither is known."""
    found = []
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not found:
        with contextlib.suppress(ValueError, OSError):
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    left = _cgroup_left(cgroups, cgroup_root)
    if left is not None:
        found.append(left)
    return min(found) if found else None


def _cgroup_left(cgroups: str, root: str) -> int | None:
    """The least memory any cgroup of this process, or a cgroup above it, has left under its
    limit (cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`); None where none sets one."""
    try:
        lines = Path(cgroups).read_text().splitlines()
    except OSError:
        return None
    left = []
    for line in lines:
        hierarchy, _, path = line.partition(":")[2].partition(":")
        if hierarchy == "":  # cgroup v2: one unified hierarchy (under unified/ beside v1)
            files = ("memory.max", "memory.current", "file")
            folders = [Path(root), Path(root) / "unified"]
        elif "memory" in hierarchy.split(","):  # cgroup v1's memory controller
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
            folders = [Path(root) / "memory"]
        else:
            continue
        parts = [p for p in path.strip().split("/") if p]
        # the process's cgroup, then each above it; in a container the path names the host's
        # cgroup and the container's own is mounted at the top
        for folder in folders:
            for depth in range(len(parts), -1, -1):
                n = _left_in(folder.joinpath(*parts[:depth]), *files)
                if n is not None:
                    left.append(n)
    return min(left) if left else None


def _left_in(folder: Path, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    try:
        limit = (folder / limit_file).read_text().strip()
        if limit == "max" or int(limit) >= 2**60:  # no limit (v1 writes a huge number)
            return None
        used = int((folder / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    cache = 0
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == cache_key:
                cache = int(value)
    except (OSError, ValueError):
        pass
    return max(int(limit) - max(used - cache, 0), 0)


def check_memory(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse a model the machine cannot hold (ConfigError), or a training step it cannot hold
    (StepTooLarge), before allocating any of it: a too-large build would run for a long time
    and then die, a too-large step be killed by the kernel."""
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
    free = free_memory(device)
    step = step_memory(cfg) if free is not None else None
    if step is None:
        return
    peak, held = step
    # the 1F1B schedule runs forwards ahead: each keeps what its backward needs
    ahead = min(cfg.microbatches_in_flight, cfg.num_microbatches) - 1
    if cfg.microbatch_schedule != "1f1b":
        ahead = 0
    acts = peak + ahead * held
    # processes of one torchrun job on one machine share its RAM
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) if device.type == "cpu" else 1
    total = (need + acts) * max(sharing, 1)
    if total <= free:
        return
    tokens = cfg.micro_batch_size * cfg.seq_length
    batches = (
        f"{ahead + 1} microbatches of {tokens:,} tokens each"
        if ahead
        else (f"1 microbatch of {tokens:,} tokens")
    )
    per = f", in each of {sharing} processes" if sharing > 1 else ""
    raise StepTooLarge(
        f"a training step needs about {_gib(total)}: {_gib(acts)} for {batches} and "
        f"{_gib(need)} for the weights and optimizer{per}; {device} has {_gib(free)} "
        "available; counted before allocating"
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"

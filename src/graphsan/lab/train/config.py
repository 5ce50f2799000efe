"""TrainConfig: every knob of `graphsan train` (Megatron names where they exist), validated."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from dataclasses import dataclass, field

from graphsan.lab.choices import Schedule, StatePolicy, check_scopes
from graphsan.lab.models.args import PRESETS, ModelArgs, get_preset

_DEVICE = re.compile(r"(auto|cpu|cuda(:\d+)?)")


class ConfigError(ValueError):
    """A bad option; the message names the option and what was expected."""


@dataclass
class TrainConfig:
    preset: str = "tiny"
    train_iters: int = 20
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # default: micro_batch_size x data-parallel ranks
    seq_length: int = 64
    lr: float = 3e-3
    lr_warmup_iters: int = 0
    eval_interval: int = 0  # 0: no validation
    eval_iters: int = 2
    manual_gc_interval: int = 0  # >0: automatic GC off, gc.collect() every N iterations
    save_interval: int = 0
    save: str = "out/checkpoints"
    load: str | None = None  # a --save directory to resume from
    empty_cache_on_save: bool = False
    cuda_graph_modules: tuple = ()
    cuda_graph_warmup_steps: int = 3
    state_policy: StatePolicy = StatePolicy.FIXED  # a string names one too (validate parses it)
    microbatch_schedule: str = "sequential"  # graphsan.lab.choices.Schedule
    microbatches_in_flight: int = 2  # 1F1B: forwards before the first backward
    capture_schedule: str | None = None  # the graphs' capture order; None: the step's schedule
    reuse_graph_buffers: bool = False  # TE's _reuse_graph_input_output_buffers (graphs.py)
    precision_config: str | None = None  # file or built-in name; None: BF16 everywhere
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
    seed: int = 1234
    device: str = "auto"
    data_path: str | None = None
    log_interval: int = 10
    dry_run: bool = False
    quiet: bool = False
    expert_model_parallel_size: int = 1  # ranks that share the routed experts (torchrun)
    distributed_timeout_minutes: float = 10.0  # a collective waiting longer fails
    use_distributed_optimizer: bool = False  # shard masters and Adam states over the ranks
    world_size: int | None = None  # data-parallel ranks; default: WORLD_SIZE (torchrun) or 1
    model_overrides: dict = field(default_factory=dict)  # ModelArgs fields (tests, benches)
    capture_grads: tuple = ()  # parameter names whose main_grad is returned for every step

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def validate(self) -> TrainConfig:
        if self.world_size is None:
            from graphsan.lab.train.distributed import DistributedError, world_from_env

            try:
                self.world_size = world_from_env()[1]
            except DistributedError as err:
                raise ConfigError(str(err)) from None
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * self.world_size
        if self.preset not in PRESETS:
            raise ConfigError(f"--preset {self.preset}: expected one of {', '.join(PRESETS)}")
        positive = (
            "train_iters",
            "micro_batch_size",
            "global_batch_size",
            "seq_length",
            "log_interval",
            "world_size",
            "expert_model_parallel_size",
            "distributed_timeout_minutes",
            "microbatches_in_flight",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected > 0")
        non_negative = (
            "eval_interval",
            "eval_iters",
            "manual_gc_interval",
            "save_interval",
            "cuda_graph_warmup_steps",
            "num_layers_at_start_in_bf16",
            "num_layers_at_end_in_bf16",
            "lr_warmup_iters",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: expected >= 0"
                )
        if self.global_batch_size % (self.micro_batch_size * self.world_size):
            ranks = f" x {self.world_size} ranks" if self.world_size > 1 else ""
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not a multiple of "
                f"--micro-batch-size {self.micro_batch_size}{ranks}"
            )
        ep = self.expert_model_parallel_size
        if self.world_size % ep:
            raise ConfigError(
                f"--expert-model-parallel-size {ep}: {self.world_size} process(es); expected a "
                "divisor of the number of processes (torchrun --nproc-per-node x --nnodes)"
            )
        if (self.micro_batch_size * self.seq_length) % 32:
            raise ConfigError(
                f"--micro-batch-size x --seq-length = {self.micro_batch_size * self.seq_length} "
                "tokens; expected a multiple of 32 (quantization blocks along the token dim)"
            )
        try:
            self.cuda_graph_modules = check_scopes(self.cuda_graph_modules)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for name in ("microbatch_schedule", "capture_schedule"):
            value = getattr(self, name)
            if value is not None:
                try:
                    setattr(self, name, Schedule.parse(value, f"--{name.replace('_', '-')}"))
                except ValueError as err:
                    raise ConfigError(str(err)) from None
        try:
            self.state_policy = StatePolicy.parse(self.state_policy)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                f"--device {self.device}: expected auto, cpu, cuda or cuda:N (N a GPU index >= 0)"
            )
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)):
            raise ConfigError(f"--lr {self.lr!r}: expected a finite number >= 0")
        if not math.isfinite(self.lr) or self.lr < 0:
            raise ConfigError(f"--lr {self.lr}: expected a finite number >= 0")
        if self.eval_interval and not self.eval_iters:
            raise ConfigError(
                f"--eval-iters 0 with --eval-interval {self.eval_interval}: validation needs "
                "--eval-iters >= 1 (--eval-interval 0 turns validation off)"
            )
        try:
            args = self.model_args()
        except (TypeError, ValueError) as err:
            raise ConfigError(f"model_overrides {self.model_overrides}: {err}") from None
        layers, experts = len(args.pattern), args.num_experts
        if experts % ep:
            raise ConfigError(
                f"--expert-model-parallel-size {ep}: the {self.preset} model has {experts} "
                "routed experts; expected a divisor of the expert count"
            )
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            if getattr(self, name) > layers:
                raise ConfigError(
                    f"--{name.replace('_', '-')} {getattr(self, name)}: the {self.preset} model "
                    f"has {layers} layers; expected at most {layers}"
                )
        for name in ("data_path", "precision_config", "load"):
            value = getattr(self, name)
            if value is not None and not str(value).strip():
                raise ConfigError(
                    f"--{name.replace('_', '-')} '': expected a file (or leave it out)"
                )
        if self.save_interval and not self.dry_run:
            _check_writable_dir(self.save, "--save")
        return self

    def model_args(self) -> ModelArgs:
        """The model this run builds: the preset with `model_overrides` applied."""
        return get_preset(self.preset).replace(**self.model_overrides)

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes).validate()


def _check_writable_dir(path: str, option: str) -> None:
    """Raise ConfigError unless a directory can be created (or written) at `path`: checked up
    front, so that a typo fails before training rather than at the first checkpoint. Leaves
    nothing behind."""
    if not str(path).strip():
        raise ConfigError(f"{option} '': expected a directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{option} {path}: is a file; expected a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{option} {path}: {existing} is a file; expected a directory")
    try:  # a real write: permissions, read-only mounts and quotas all show here
        with tempfile.TemporaryDirectory(dir=existing, prefix=".graphsan-probe-"):
            pass
    except OSError as err:
        raise ConfigError(f"{option} {path}: cannot write in {existing} ({err.strerror})") from None

"""The training loop of `graphsan train`, read top to bottom.

    build model -> bind precision recipes -> optimizer, data
    for each iteration:
        (after the warm-up steps) capture per-scope CUDA graphs once
        train step: microbatches (skip flag 0 for the first, 1 after), backward, optimizer step
        log; validation (eager, model.eval() + no_grad); checkpoint (+ empty_cache); manual GC
    summary; a TrainResult for callers that compare runs

Megatron's order within an iteration is kept: train step, then validation, then save, then the
manual GC, so they all fall on the same iteration when their intervals coincide.

Under torchrun (lab/train/distributed.py) each rank trains its share of every global batch
(micro x accumulation x ranks = the same global batch as one process), the main_grads are
averaged after the last backward (reduce-scattered into shards with the distributed optimizer,
--use-distributed-optimizer), the routed experts may be split across ranks
(--expert-model-parallel-size), losses are averaged over the ranks, and only rank 0 prints.
"""

from __future__ import annotations

import gc
import math
import os
import re
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

import graphsan
from graphsan.lab.models import build_model, count_parameters, get_preset
from graphsan.lab.models.moe import shard_experts
from graphsan.lab.quant import (
    PrecisionConfig,
    PrecisionConfigError,
    QuantModule,
    SkipFlag,
    apply_precision,
    get_recipe,
)
from graphsan.lab.quant.precision import CONFIG_DIR
from graphsan.lab.train import graphs as cuda_graphs
from graphsan.lab.train.callbacks import Callback
from graphsan.lab.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.data import build_data
from graphsan.lab.train.distributed import Dist, DistributedError, check_device_for_rank, setup
from graphsan.lab.train.metrics import Metrics, memory_gib
from graphsan.lab.train.optim import MainGradAdamW
from graphsan.lab.vocab import Schedule, schedule_order


@dataclass
class TrainResult:
    """What a run produced, for numerical comparison of runs (e.g. graphed vs eager)."""

    losses: list[float] = field(default_factory=list)  # LM loss per step (mean over microbatches)
    mtp_losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (iteration, loss)
    main_grads: list[dict] = field(default_factory=list)  # per step: {param name: fp32 cpu}
    recipe_table: list[tuple[str, str]] = field(default_factory=list)
    graphed_stages: list[str] = field(default_factory=list)
    device: str = "cpu"
    tokens_per_s: float = 0.0  # steady state: iterations after graph capture / the first one
    step_ms: float = 0.0
    peak_mem_gib: float = 0.0


class TrainingDiverged(Exception):
    """The loss became NaN or infinite at `iteration`; `losses` are the step losses so far."""

    def __init__(self, iteration: int, loss: float, losses: list[float]):
        super().__init__(f"loss is {loss} at iteration {iteration}")
        self.iteration, self.loss, self.losses = iteration, loss, losses


class TrainingInterrupted(Exception):
    """Ctrl-C stopped training after `iteration` (the one in flight was finished first);
    `checkpoint` is where it was saved (None without --save)."""

    def __init__(self, iteration: int, checkpoint: str | None):
        saved = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted after iteration {iteration}{saved}")
        self.iteration, self.checkpoint = iteration, checkpoint


@contextmanager
def _stop_after_iteration():
    """Ctrl-C during training asks to stop once the iteration in flight is done (a second one
    stops at once); yields a one-item list that holds True once asked."""
    import signal
    import threading

    asked = [False]
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def handler(signum, frame):
        if asked[0]:
            raise KeyboardInterrupt
        asked[0] = True

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield asked
    finally:
        signal.signal(signal.SIGINT, old)


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


# Bytes per trainable parameter besides the weight itself: fp32 main_grad, fp32 master copy and
# AdamW's two fp32 moments (activations and workspaces come on top).
TRAIN_STATE_BYTES = 16
SHARDED_STATE_BYTES = 12  # the master and the moments, which the distributed optimizer shards


def memory_needed(cfg: TrainConfig) -> tuple[int, int, int]:
    """(bytes needed on the device at least, bytes of the weights, trainable parameters), from
    the model built on the meta device, as `--dry-run` does. With the distributed optimizer each
    rank holds 1/ranks of the masters and moments (the experts' too: 1/E of the experts over
    ranks/E shards)."""
    model = build_model(model_args(cfg), device="meta")
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


def model_args(cfg: TrainConfig):
    return get_preset(cfg.preset).replace(**cfg.model_overrides)


def bind_precision(model, cfg: TrainConfig):
    """Apply the precision config; returns (table, ambient recipe). The output layer stays BF16:
    in Megatron it is not a TE module, so no recipe applies to it."""
    config = (
        PrecisionConfig.uniform(get_recipe("bf16"))
        if cfg.precision_config is None
        else PrecisionConfig.from_yaml(cfg.precision_config)
    )
    table = apply_precision(
        model,
        config,
        layer_pattern=model.args.pattern,
        first_bf16=cfg.num_layers_at_start_in_bf16 or None,
        last_bf16=cfg.num_layers_at_end_in_bf16 or None,
    )
    check_rules_match(config, [p for p, _ in table], cfg.preset)
    model.output_layer.set_recipe(get_recipe("bf16"))
    table = [(p, "bf16 [output layer]" if p == "output_layer" else d) for p, d in table]
    return table, config.base


def check_rules_match(config: PrecisionConfig, paths: list[str], preset: str) -> None:
    """A rule that matches no module is a typo or a file written for another model: refuse it.
    The built-in files are exempt: `super-mixed` keeps Megatron's `*.mtp.*` rule, which no
    module path of the lab's model has."""
    if config.source.startswith(str(CONFIG_DIR)):
        return
    for i, rule in enumerate(config.rules):
        if not any(rule.matches(p) for p in paths):
            examples = ", ".join(paths[:2] + paths[-1:])
            raise PrecisionConfigError(
                f"{config.source}: key 'rules[{i}].match' {rule.pattern!r} (recipe {rule.name}) "
                f"matches no module of the {preset} model; expected a glob over module paths "
                f"such as {examples}"
            )


def summarize_table(table: list[tuple[str, str]]) -> str:
    """The recipe table with layer indices folded: one row per (module kind, recipe)."""
    rows: dict[tuple[str, str], list[int]] = {}
    for path, desc in table:
        m = re.match(r"^(mtp\.)?layers\.(\d+)\.(.*)$", path)
        key_path = path if not m else f"{m.group(1) or ''}layers.{{i}}.{m.group(3)}"
        rows.setdefault((key_path, desc), []).append(int(m.group(2)) if m else -1)
    out = []
    width = max(len(p) for p, _ in rows) if rows else 6
    for (path, desc), idx in rows.items():
        layers = sorted({i for i in idx if i >= 0})
        where = f"  layers {_ranges(layers)}" if layers else ""
        out.append(f"{path:<{width}}  {desc:<28} x{len(idx)}{where}")
    return "\n".join([f"{'module':<{width}}  recipe", *out])


def _ranges(xs: list[int]) -> str:
    parts, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(parts)


def dry_run(cfg: TrainConfig, metrics: Metrics) -> None:
    """Build on the meta device (no memory), print parameter counts and the recipe table."""
    model = build_model(model_args(cfg), device="meta")
    total, active = count_parameters(model)
    table, base = bind_precision(model, cfg)
    metrics.print(
        f"preset {cfg.preset}: pattern {model.args.pattern} ({len(model.args.pattern)} layers)"
    )
    metrics.print(
        f"parameters: total {total:,} ({total / 1e9:.2f} B), active {active:,} "
        f"({active / 1e9:.2f} B)"
    )
    metrics.print(
        f"precision: {cfg.precision_config or 'bf16 everywhere'} (base {base.describe()})"
    )
    metrics.print(summarize_table(table))


def train(cfg: TrainConfig, console=None, callbacks: Sequence[Callback] = ()) -> TrainResult:
    """Train as `cfg` says; `callbacks` are told when the model is built and each step ends.
    Under torchrun every rank calls this; rank 0 prints, every rank returns the same losses."""
    cfg.validate()
    if cfg.dry_run:  # nothing to share: under torchrun rank 0 alone prints it
        quiet = cfg.quiet or os.environ.get("RANK", "0") != "0"
        with Metrics(cfg.train_iters, quiet=quiet, console=console) as metrics:
            dry_run(cfg, metrics)
        return TrainResult()
    dist = join(cfg)
    try:
        quiet = cfg.quiet or not dist.is_main
        with Metrics(cfg.train_iters, quiet=quiet, console=console) as metrics:
            return _train(cfg, metrics, callbacks, dist)
    finally:
        dist.close()


def join(cfg: TrainConfig) -> Dist:
    """This process's place in the job (torchrun's environment; one process without it)."""
    if cfg.world_size == 1:
        return Dist()
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = resolve_device(check_device_for_rank(cfg.device, local_rank))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return setup(device, cfg.expert_model_parallel_size, cfg.distributed_timeout_minutes)
    except DistributedError as err:
        raise ConfigError(str(err)) from None


def _train(
    cfg: TrainConfig, metrics: Metrics, callbacks: Sequence[Callback], dist: Dist | None = None
) -> TrainResult:
    return Trainer(cfg, metrics, callbacks, dist).train()


class _Clock:
    """Wall time of the log interval (for the per-interval throughput) and of the steady state
    (every train step after the first or after graph capture, side work excluded)."""

    def __init__(self, device: torch.device, first: int = 1):
        self.device, self.first = device, first
        self.interval_start: float | None = None
        self.interval_first = first
        self.steady_start: float | None = None
        self.steady_iters = 0
        self.excluded = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def start_iteration(self, it: int) -> None:
        if self.interval_start is None:
            self.interval_start, self.interval_first = self.now(), it
        if self.steady_start is None and it > self.first:
            self.steady_start, self.steady_iters, self.excluded = self.now(), 0, 0.0

    def restart_steady(self) -> None:
        """Graph capture is a one-off: the steady state starts after it."""
        self.steady_start = None

    def interval(self, it: int) -> tuple[float, int]:
        """(seconds, iterations) since the interval began; the next iteration starts another."""
        dt, n = self.now() - self.interval_start, it - self.interval_first + 1
        self.interval_start = None
        return dt, n

    @contextmanager
    def side_work(self):
        """Validation, checkpoints and GC: not a train step, so not steady-state time; the log
        interval restarts after them."""
        t0 = self.now()
        yield
        self.excluded += self.now() - t0

    def steady_seconds(self) -> float:
        return self.now() - self.steady_start - self.excluded if self.steady_start else 0.0


class Trainer:
    """One run: the model with its recipes and graphs, the optimizer, the data."""

    def __init__(
        self,
        cfg: TrainConfig,
        metrics: Metrics,
        callbacks: Sequence[Callback] = (),
        dist: Dist | None = None,
    ):
        self.cfg, self.metrics, self.callbacks = cfg, metrics, list(callbacks)
        self.dist = dist = dist or Dist()
        name = check_device_for_rank(cfg.device, dist.local_rank) if dist.enabled else cfg.device
        self.device = device = resolve_device(name)
        check_memory(cfg, device)
        self.result = TrainResult(device=str(device))
        self.model = model = build_model(model_args(cfg), device=device, seed=cfg.seed)
        self.param_counts = count_parameters(model)  # of the whole model, before any split
        ep = dist.expert_parallel(model.args.num_experts)
        if ep is not None:
            shard_experts(model, ep)
        for cb in self.callbacks:
            cb.on_model_built(model)
        self.result.recipe_table, self.ambient = bind_precision(model, cfg)
        self.skip = SkipFlag(device)  # the shared weight-workspace skip flag
        for m in model.modules():
            if isinstance(m, QuantModule):  # QuantLinear and the experts' GroupedQuantLinear
                m.skip_weight_update = self.skip
                m.state_policy = cfg.state_policy
        self.opt = MainGradAdamW(
            model, cfg.lr, dist=dist, distributed_optimizer=cfg.use_distributed_optimizer
        )
        self.start_iteration = 1  # the first iteration this run trains (after --load: later)
        if cfg.load is not None:
            self.start_iteration = self.load(cfg.load) + 1
        self.data = build_data(cfg.data_path, model.args.vocab_size, cfg.seq_length, cfg.seed)
        self.params = dict(model.named_parameters())
        self._trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name in cfg.capture_grads:
            if name not in self.params:
                raise ValueError(f"capture_grads: no parameter {name!r} in the model")
        self.use_graphs = bool(cfg.cuda_graph_modules)
        if self.use_graphs and device.type != "cuda":
            metrics.print(
                f"note: CUDA graphs need CUDA; on {device} the graphed scopes "
                f"({', '.join(cfg.cuda_graph_modules)}) run eagerly"
            )
            self.use_graphs = False
        self.counter = cuda_graphs.MicrobatchCounter()
        self.clock = _Clock(device, self.start_iteration)

    # ---- the loop ----
    def train(self) -> TrainResult:
        cfg, result = self.cfg, self.result
        self._print_header()
        losses, mtp_losses, norms = [], [], []
        with _manual_gc(cfg.manual_gc_interval), _stop_after_iteration() as stop:
            self.model.train()
            first = self.start_iteration
            for it in range(first, cfg.train_iters + 1):
                if stop[0]:
                    self._interrupted(it - 1)
                if self.use_graphs and it == first + cfg.cuda_graph_warmup_steps:
                    self.capture_graphs()
                self.clock.start_iteration(it)
                lm, mtp, norm = self.train_step(it)
                losses.append(lm)
                mtp_losses.append(mtp)
                norms.append(norm)
                for cb in self.callbacks:
                    cb.on_step_end(it)
                self._log(it, losses, mtp, norm)
                with self.clock.side_work():
                    self._side_work(it)
            steady_s = self.clock.steady_seconds()
        result.losses = [x.item() for x in losses]
        result.mtp_losses = [x.item() for x in mtp_losses if x is not None]
        result.grad_norms = [float(x) for x in norms]
        steady_iters = self.clock.steady_iters
        if steady_iters and steady_s > 0:
            result.step_ms = 1000 * steady_s / steady_iters
            result.tokens_per_s = steady_iters * self._tokens_per_step() / steady_s
        result.peak_mem_gib = memory_gib(self.device)
        self._print_summary()
        return result

    def _interrupted(self, done: int) -> None:
        """Stop after iteration `done`, saving it first where --save asks for checkpoints."""
        path = None
        if self.cfg.save and done >= self.start_iteration:
            self.save(done)
            path = self.cfg.save
        raise TrainingInterrupted(done, path)

    def _side_work(self, it: int) -> None:
        """Megatron's order after a train step: validation, checkpoint, manual GC."""
        cfg = self.cfg
        if cfg.eval_interval and it % cfg.eval_interval == 0:
            self.evaluate(it)
        if cfg.save_interval and it % cfg.save_interval == 0:
            self.save(it)
        if cfg.manual_gc_interval and it % cfg.manual_gc_interval == 0:
            gc.collect()

    # ---- the steps ----
    def capture_graphs(self) -> None:
        """Capture the per-scope CUDA graphs once, after the eager warm-up steps."""
        cfg, model = self.cfg, self.model
        t0 = self.clock.now()
        stages = cuda_graphs.plan_stages(
            model, cfg.cuda_graph_modules, self.counter, cfg.state_policy, self.ambient
        )
        cuda_graphs.capture(
            stages,
            model,
            num_microbatches=cfg.num_microbatches,
            sample_shape=(cfg.micro_batch_size, cfg.seq_length, model.args.hidden_size),
            order=schedule_order(
                cfg.capture_schedule or cfg.microbatch_schedule,
                cfg.num_microbatches,
                cfg.microbatches_in_flight,
            ),
        )
        self.result.graphed_stages = [s.name for s in stages]
        self.metrics.print(
            f"captured {len(stages)} graphed stage(s) x {cfg.num_microbatches} microbatch(es) "
            f"(forward + backward) in {time.perf_counter() - t0:.1f} s"
        )
        self.clock.restart_steady()

    def train_step(self, it: int):
        """Microbatches (skip flag 0 for the first, 1 after), backward, optimizer step; returns
        (LM loss, MTP loss or None, gradient norm) as device tensors."""
        cfg, model, device = self.cfg, self.model, self.device
        num_mb, mbs = cfg.num_microbatches, cfg.micro_batch_size
        self.opt.zero_grad()
        lm, mtp = torch.zeros((), device=device), torch.zeros((), device=device)
        pending = {}  # microbatch -> its forward's outputs, until its backward
        order = schedule_order(cfg.microbatch_schedule, num_mb, cfg.microbatches_in_flight)
        for kind, mb in order:
            if kind == "F":
                self.skip.set(0 if mb == 0 else 1)
                self.counter.index = mb  # the graphs the forward replays; backward follows it
                tokens, labels = self.data.batch("train", self._sample("train", it, mb), mbs)
                pending[mb] = model(
                    tokens.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                )
                continue
            out = pending.pop(mb)
            (out["loss"] / num_mb).backward()
            lm += out["lm_loss"] / num_mb
            if "mtp_loss" in out:
                mtp += out["mtp_loss"] / num_mb
            # a live autograd graph would keep grad accumulators alive into a later capture
            del out
        self.opt.reduce_grads()
        if cfg.capture_grads:
            # a sharded optimizer holds only its shard reduced: gather the whole (a collective)
            grads = dict(zip(self._trainable_names, self.opt.reduced_main_grads(), strict=True))
            self.result.main_grads.append(
                {n: grads[n].detach().float().cpu().clone() for n in cfg.capture_grads}
            )
        norm = self.opt.step(self._lr_at(it))
        self._reduce_router_counts()
        model.update_expert_bias()
        self.clock.steady_iters += 1
        losses = self.dist.all_reduce_mean_(torch.stack([lm, mtp]))
        return losses[0], (losses[1] if model.mtp is not None else None), norm

    def _sample(self, split: str, step: int, mb: int) -> int:
        """The first sample of microbatch `mb` of this rank in `step` (1-based for training,
        0-based eval iteration): the global batch is split across the ranks in rank order."""
        cfg = self.cfg
        per_rank = cfg.num_microbatches
        first_step = step - 1 if split == "train" else step
        index = (first_step * cfg.world_size + self.dist.rank) * per_rank + mb
        return index * cfg.micro_batch_size

    def _reduce_router_counts(self) -> None:
        """The aux-loss-free bias follows the whole batch's expert load: sum it over the ranks."""
        if not self.dist.enabled:
            return
        for name, buf in self.model.named_buffers():
            if name.endswith("local_tokens_per_expert"):
                self.dist.all_reduce_sum_(buf)

    def evaluate(self, it: int) -> float:
        """Eager validation (model.eval() + no_grad), between manual collections."""
        cfg, model, device = self.cfg, self.model, self.device
        num_mb, mbs = cfg.num_microbatches, cfg.micro_batch_size
        if cfg.manual_gc_interval:
            gc.collect()
        with graphsan.phase("eval", step=it):  # frees are tagged "eval, step it"
            model.eval()
            total = torch.zeros((), device=device)
            with torch.no_grad():
                for k in range(cfg.eval_iters):
                    for mb in range(num_mb):
                        self.skip.set(0 if k == 0 and mb == 0 else 1)
                        tokens, labels = self.data.batch("valid", self._sample("valid", k, mb), mbs)
                        total += model(tokens.to(device), labels.to(device))["lm_loss"]
            model.train()
            total = self.dist.all_reduce_mean_(total)
            loss = (total / max(1, cfg.eval_iters * num_mb)).item()
        if cfg.manual_gc_interval:
            gc.collect()
        self.result.eval_losses.append((it, loss))
        self.metrics.print(
            f"validation at iteration {it}: loss {loss:.4f} ({cfg.eval_iters} iteration(s))"
        )
        self.clock.interval_start = None
        return loss

    def _checkpoint_name(self) -> str:
        d = self.dist
        return "latest.pt" if d.ep_size == 1 else f"latest.ep{d.rank % d.ep_size}.pt"

    def save(self, it: int) -> None:
        cfg, d = self.cfg, self.dist
        # data-parallel ranks hold the same weights: the first EP group writes, one file per
        # expert shard (every rank empties its cache, as every Megatron rank does); a sharded
        # optimizer's state is gathered first, which every rank of its groups takes part in
        write = d.rank < d.ep_size
        state = self.opt.state_dict() if write or self.opt.sharded else None
        path = save_checkpoint(
            cfg.save,
            it,
            self.model,
            state if write else None,
            empty_cache=cfg.empty_cache_on_save,
            name=self._checkpoint_name(),
            write=write,
            extra={"expert_model_parallel_size": d.ep_size},
        )
        self.metrics.print(
            f"saved checkpoint {path} at iteration {it}"
            + (" (+ empty_cache)" if cfg.empty_cache_on_save else "")
        )
        self.clock.interval_start = None

    def load(self, directory: str) -> int:
        """Restore the model, the optimizer (each rank its shard) and the iteration of a
        checkpoint in `directory` (--load); returns the iteration it was saved at."""
        cfg = self.cfg
        try:
            state = load_checkpoint(directory, self._checkpoint_name(), vars(self.model.args))
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
        except (CheckpointError, RuntimeError, ValueError) as err:
            raise ConfigError(str(err).splitlines()[0]) from None
        it = int(state["iteration"])
        if it >= cfg.train_iters:
            raise ConfigError(
                f"--load {directory}: the checkpoint is at iteration {it}; expected "
                f"--train-iters above it (now {cfg.train_iters})"
            )
        self.metrics.print(f"loaded checkpoint {directory} at iteration {it}")
        return it

    # ---- logging ----
    def _log(self, it: int, losses: list, mtp, norm) -> None:
        cfg = self.cfg
        if it % cfg.log_interval == 0 or it == cfg.train_iters:
            dt, n = self.clock.interval(it)
            loss = losses[-1].item()
            if not math.isfinite(loss):
                raise TrainingDiverged(it, loss, [float(x) for x in losses])
            self.metrics.log(
                it,
                cfg.train_iters,
                loss,
                None if mtp is None else mtp.item(),
                n * self._tokens_per_step() / dt,
                1000 * dt / n,
                memory_gib(self.device),
                norm.item(),
            )
        self.metrics.advance(f"loss {losses[-1].item():.3f}" if it % cfg.log_interval == 0 else "")

    def _print_header(self) -> None:
        cfg, d = self.cfg, self.dist
        total, active = self.param_counts
        graphs = ",".join(cfg.cuda_graph_modules) if self.use_graphs else "none"
        if d.enabled:
            self.metrics.print(
                f"distributed: {d.world} ranks ({torch.distributed.get_backend()}), data "
                f"parallel {d.world}, expert parallel {d.ep_size} "
                f"({self.model.args.num_experts // d.ep_size} experts per rank)"
                f"{', distributed optimizer' if self.opt.sharded else ''} | global batch "
                f"{cfg.global_batch_size} = {cfg.micro_batch_size} x {cfg.num_microbatches} "
                f"microbatch(es) x {d.world} ranks"
            )
        self.metrics.print(
            f"graphsan train: preset {cfg.preset} ({total / 1e6:.1f} M params, {active / 1e6:.1f} "
            f"M active) on {self.device} | precision {cfg.precision_config or 'bf16'} | graphs "
            f"{graphs} (state {cfg.state_policy}) | {cfg.num_microbatches} microbatch(es) x "
            f"{cfg.micro_batch_size} x {cfg.seq_length}{self._schedule_text()}"
        )

    def _schedule_text(self) -> str:
        cfg = self.cfg
        captured = cfg.capture_schedule or cfg.microbatch_schedule
        if cfg.microbatch_schedule == captured == Schedule.SEQUENTIAL:
            return ""
        text = f", schedule {cfg.microbatch_schedule}"
        if cfg.microbatch_schedule == Schedule.ONE_F_ONE_B:
            text += f" ({cfg.microbatches_in_flight} in flight)"
        if captured != cfg.microbatch_schedule:
            text += f", graphs captured {captured}"
        return text

    def _print_summary(self) -> None:
        r = self.result
        evals = ", ".join(f"{i}: {v:.4f}" for i, v in r.eval_losses) or "none"
        self.metrics.print(
            f"done: {self.cfg.train_iters} iterations | loss {r.losses[0]:.4f} -> "
            f"{r.losses[-1]:.4f} | validation {evals} | steady {r.step_ms:.1f} ms/step, "
            f"{r.tokens_per_s:,.0f} tok/s | peak mem {r.peak_mem_gib:.2f} GiB"
        )

    def _lr_at(self, it: int) -> float:
        cfg = self.cfg
        return cfg.lr * min(1.0, it / cfg.lr_warmup_iters) if cfg.lr_warmup_iters else cfg.lr

    def _tokens_per_step(self) -> int:
        return self.cfg.global_batch_size * self.cfg.seq_length


@contextmanager
def _manual_gc(interval: int):
    """Megatron's --manual-gc: automatic GC off for the run, collections at fixed iterations."""
    was_enabled = gc.isenabled()
    if interval:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()

"""The training loop of `graphsan train`, read top to bottom (`Trainer.train`).

    build model -> bind precision recipes -> optimizer, data (or --load a checkpoint)
    for each iteration:
        (after the warm-up steps) capture per-scope CUDA graphs once
        train step: microbatches (skip flag 0 for the first, 1 after), backward, optimizer step
        log; validation (eager, model.eval() + no_grad); checkpoint (+ empty_cache); manual GC
        a stop signal since the iteration began (Ctrl-C, SIGTERM, ...): save it, stop
    summary; a TrainResult for callers that compare runs

Megatron's order within an iteration is kept: train step, then validation, then save, then the
manual GC, so they all fall on the same iteration when their intervals coincide.

Each piece has a module of its own: device.py (the device, the memory check), recipes.py (the
precision recipes, --dry-run), graphs.py (the per-scope graphs), microbatches.py (a step's
microbatches in a schedule's order), optim.py, evaluate.py, checkpoint.py, interrupt.py
(Ctrl-C and the schedulers' stop signals), metrics.py (console lines, the clock), data.py,
distributed.py.

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
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from graphsan.lab.choices import schedule_order
from graphsan.lab.models import build_model, count_parameters
from graphsan.lab.models.moe import shard_experts
from graphsan.lab.quant import SkipFlag
from graphsan.lab.train import graphs as cuda_graphs
from graphsan.lab.train.callbacks import Callback
from graphsan.lab.train.checkpoint import Checkpointer, CheckpointWriteError, SaveFailed
from graphsan.lab.train.config import ConfigError, TrainConfig
from graphsan.lab.train.data import RankBatches, build_data
from graphsan.lab.train.device import check_memory, resolve_device
from graphsan.lab.train.distributed import Dist, DistributedError, check_device_for_rank, setup
from graphsan.lab.train.evaluate import evaluate
from graphsan.lab.train.interrupt import StoppedAtOnce, StopSignals, TrainingInterrupted
from graphsan.lab.train.metrics import Clock, Metrics, memory_gib
from graphsan.lab.train.microbatches import run_microbatches
from graphsan.lab.train.optim import MainGradAdamW, linear_warmup
from graphsan.lab.train.recipes import bind_precision, dry_run, share_skip_flag

__all__ = ["TrainResult", "Trainer", "TrainingDiverged", "TrainingInterrupted", "train"]


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


def train(
    cfg: TrainConfig,
    console=None,
    callbacks: Sequence[Callback] = (),
    stop: StopSignals | None = None,
) -> TrainResult:
    """Train as `cfg` says; `callbacks` are told when the model is built and each step ends;
    `stop`: the signals that end training after the iteration in flight (default: Ctrl-C).
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
            return Trainer(cfg, metrics, callbacks, dist, stop).train()
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


class Trainer:
    """One run: the model with its recipes and graphs, the optimizer, the data."""

    def __init__(
        self,
        cfg: TrainConfig,
        metrics: Metrics,
        callbacks: Sequence[Callback] = (),
        dist: Dist | None = None,
        stop: StopSignals | None = None,
    ):
        self.cfg, self.metrics, self.callbacks = cfg, metrics, list(callbacks)
        self.dist = dist = dist or Dist()
        self.stop = stop if stop is not None else StopSignals()
        self.saved_at: int | None = None  # the iteration of the last checkpoint
        self.in_flight: int | None = None  # the iteration the loop is in (None: before it)
        name = check_device_for_rank(cfg.device, dist.local_rank) if dist.enabled else cfg.device
        self.device = device = resolve_device(name)
        check_memory(cfg, device)
        self.result = TrainResult(device=str(device))
        self.model = model = build_model(cfg.model_args(), device=device, seed=cfg.seed)
        self.param_counts = count_parameters(model)  # of the whole model, before any split
        ep = dist.expert_parallel(model.args.num_experts)
        if ep is not None:
            shard_experts(model, ep)
        for cb in self.callbacks:
            cb.on_model_built(model)
        self.result.recipe_table, self.ambient = bind_precision(model, cfg)
        self.skip = SkipFlag(device)  # the shared weight-workspace skip flag
        share_skip_flag(model, self.skip, cfg)
        self.opt = MainGradAdamW(
            model, cfg.lr, dist=dist, distributed_optimizer=cfg.use_distributed_optimizer
        )
        self.checkpoints = Checkpointer(cfg, dist, model, self.opt)
        self.start_iteration = 1  # the first iteration this run trains (after --load: later)
        if cfg.load is not None:
            done = self.checkpoints.load(cfg.load)
            metrics.print(f"loaded checkpoint {cfg.load} at iteration {done}")
            self.start_iteration = done + 1
        data = build_data(cfg.data_path, model.args.vocab_size, cfg.seq_length, cfg.seed)
        self.batches = RankBatches(data, cfg, dist.rank, device)
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
        self.clock = Clock(device, self.start_iteration)

    # ---- the loop ----
    def train(self) -> TrainResult:
        cfg, result = self.cfg, self.result
        self.metrics.header(
            cfg,
            self.dist,
            self.device,
            self.param_counts,
            graphed=self.use_graphs,
            num_experts=self.model.args.num_experts,
            sharded=self.opt.sharded,
        )
        losses, mtp_losses, norms = [], [], []
        with _manual_gc(cfg.manual_gc_interval), self.stop.after_iteration():
            self.model.train()
            first = self.start_iteration
            try:
                for it in range(first, cfg.train_iters + 1):
                    self.in_flight = it
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
                        self._stop_if_asked(it)
            except StoppedAtOnce as err:  # a second signal: say what is saved, and where
                raise StoppedAtOnce(err.signum, self._stopped_where()) from None
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

    def _stop_if_asked(self, done: int) -> None:
        """After iteration `done`: where a stop signal came (on any rank: every rank stops after
        the same iteration, so the save's collectives match), save it and stop."""
        signum = self.dist.max_(self.stop.signum or 0, self.device)
        if not signum:
            return
        path = None
        if self.cfg.save:
            if self.saved_at != done:  # --save-interval may have saved it already
                self.save(done)
            path = self.cfg.save
        raise TrainingInterrupted(done, path, signum)

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
        t0 = self.clock.now()
        stages = cuda_graphs.capture_scopes(self.model, self.cfg, self.counter, self.ambient)
        self.result.graphed_stages = [s.name for s in stages]
        self.metrics.print(
            f"captured {len(stages)} graphed stage(s) x {self.cfg.num_microbatches} "
            f"microbatch(es) (forward + backward) in {time.perf_counter() - t0:.1f} s"
        )
        self.clock.restart_steady()

    def train_step(self, it: int):
        """Microbatches (skip flag 0 for the first, 1 after), backward, optimizer step; returns
        (LM loss, MTP loss or None, gradient norm) as device tensors."""
        cfg, model = self.cfg, self.model
        self.opt.zero_grad()
        order = schedule_order(
            cfg.microbatch_schedule, cfg.num_microbatches, cfg.microbatches_in_flight
        )
        lm, mtp = run_microbatches(
            model,
            order,
            lambda mb: self.batches.get("train", it - 1, mb, non_blocking=True),
            self.skip,
            self.counter,
        )
        self.opt.reduce_grads()
        if cfg.capture_grads:
            # a sharded optimizer holds only its shard reduced: gather the whole (a collective)
            grads = dict(zip(self._trainable_names, self.opt.reduced_main_grads(), strict=True))
            self.result.main_grads.append(
                {n: grads[n].detach().float().cpu().clone() for n in cfg.capture_grads}
            )
        norm = self.opt.step(linear_warmup(cfg.lr, cfg.lr_warmup_iters, it))
        self._reduce_router_counts()
        model.update_expert_bias()
        self.clock.end_step()
        losses = self.dist.all_reduce_mean_(torch.stack([lm, mtp]))
        return losses[0], (losses[1] if model.mtp is not None else None), norm

    def _reduce_router_counts(self) -> None:
        """The aux-loss-free bias follows the whole batch's expert load: sum it over the ranks."""
        if not self.dist.enabled:
            return
        for name, buf in self.model.named_buffers():
            if name.endswith("local_tokens_per_expert"):
                self.dist.all_reduce_sum_(buf)

    def evaluate(self, it: int) -> float:
        """Validate (evaluate.py), keep the loss and print it."""
        cfg = self.cfg
        loss = evaluate(self.model, self.batches, cfg, self.skip, self.dist, it)
        self.result.eval_losses.append((it, loss))
        self.metrics.print(
            f"validation at iteration {it}: loss {loss:.4f} ({cfg.eval_iters} iteration(s))"
        )
        self.clock.restart_interval()
        return loss

    def save(self, it: int) -> None:
        """Save a checkpoint of iteration `it` (every rank takes part) and print where; a write
        the system refuses stops training (SaveFailed), the last good checkpoint kept."""
        try:
            with self.stop.holding():  # a second stop signal waits for the file to be whole
                path = self.checkpoints.save(it)
        except CheckpointWriteError as err:
            raise SaveFailed(
                f"--save {self.cfg.save}: cannot write {err.path.name} of iteration {it} "
                f"({err.reason}); {self.last_checkpoint()}"
            ) from None
        self.saved_at = it
        self.metrics.print(
            f"saved checkpoint {path} at iteration {it}"
            + (" (+ empty_cache)" if self.cfg.empty_cache_on_save else "")
        )
        self.clock.restart_interval()

    def _stopped_where(self) -> str:
        """When a run stopped at once stopped, and what of it is on disk."""
        it = self.in_flight
        if it is None:
            return f"before its first iteration; {self.last_checkpoint()}"
        if self.saved_at == it:
            return f"after iteration {it}; checkpoint saved to {self.cfg.save}"
        return f"during iteration {it}, which was not saved; {self.last_checkpoint()}"

    def last_checkpoint(self) -> str:
        """Where the last good checkpoint of this run is, as an error line ends: the one it
        saved last, else the one it loaded, else none (an older file in --save is named)."""
        name = self.checkpoints.name
        file = Path(self.cfg.save or ".") / name
        if self.saved_at is not None:
            return f"the last checkpoint is {file} (iteration {self.saved_at})"
        if self.cfg.load is not None:
            loaded = Path(self.cfg.load) / name
            return (
                f"the last checkpoint is the one this run loaded, {loaded} "
                f"(iteration {self.start_iteration - 1})"
            )
        if not self.cfg.save:
            return "this run saved no checkpoint (no --save)"
        if file.is_file():
            return f"this run saved no checkpoint; {file} is from before it, unchanged"
        return "this run saved no checkpoint"

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

    def _print_summary(self) -> None:
        r = self.result
        evals = ", ".join(f"{i}: {v:.4f}" for i, v in r.eval_losses) or "none"
        self.metrics.print(
            f"done: {self.cfg.train_iters} iterations | loss {r.losses[0]:.4f} -> "
            f"{r.losses[-1]:.4f} | validation {evals} | steady {r.step_ms:.1f} ms/step, "
            f"{r.tokens_per_s:,.0f} tok/s | peak mem {r.peak_mem_gib:.2f} GiB"
        )

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

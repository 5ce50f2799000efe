"""Console output of a training run and the numbers behind it: a rich progress bar, the run's
header, one log line per interval, and the clock that times the intervals and the steady state."""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from graphsan.lab.choices import Schedule
from graphsan.lab.train.config import TrainConfig
from graphsan.lab.train.distributed import Dist


def memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or peak resident set size (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class Metrics:
    def __init__(self, total_iters: int, *, quiet: bool = False, console: Console | None = None):
        self.console = console or Console(stderr=False, highlight=False)
        self.quiet = quiet
        show_bar = not quiet and self.console.is_terminal and sys.stdout.isatty()
        self.progress = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            disable=not show_bar,
            transient=True,
        )
        self.task = self.progress.add_task("train", total=total_iters, status="")

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def print(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, markup=False, soft_wrap=True)

    def advance(self, status: str = "") -> None:
        self.progress.update(self.task, advance=1, status=status)

    def log(self, it, total, loss, mtp, tok_s, step_ms, mem, grad_norm) -> None:
        mtp_s = f" | mtp {mtp:.4f}" if mtp is not None else ""
        self.print(
            f"iter {it:>6}/{total} | loss {loss:.4f}{mtp_s} | grad norm {grad_norm:.3f} | "
            f"{tok_s:,.0f} tok/s | {step_ms:.1f} ms/step | mem {mem:.2f} GiB"
        )

    def header(
        self,
        cfg: TrainConfig,
        dist: Dist,
        device: torch.device,
        param_counts: tuple[int, int],
        *,
        graphed: bool,
        num_experts: int,
        sharded: bool,
    ) -> None:
        """What the run is: its ranks (under torchrun), model, device, precision, graphs and
        microbatches."""
        total, active = param_counts
        graphs = ",".join(cfg.cuda_graph_modules) if graphed else "none"
        if dist.enabled:
            self.print(
                f"distributed: {dist.world} ranks ({torch.distributed.get_backend()}), data "
                f"parallel {dist.world}, expert parallel {dist.ep_size} "
                f"({num_experts // dist.ep_size} experts per rank)"
                f"{', distributed optimizer' if sharded else ''} | global batch "
                f"{cfg.global_batch_size} = {cfg.micro_batch_size} x {cfg.num_microbatches} "
                f"microbatch(es) x {dist.world} ranks"
            )
        self.print(
            f"graphsan train: preset {cfg.preset} ({total / 1e6:.1f} M params, {active / 1e6:.1f} "
            f"M active) on {device} | precision {cfg.precision_config or 'bf16'} | graphs "
            f"{graphs} (state {cfg.state_policy}) | {cfg.num_microbatches} microbatch(es) x "
            f"{cfg.micro_batch_size} x {cfg.seq_length}{_schedule_text(cfg)}"
        )


def _schedule_text(cfg: TrainConfig) -> str:
    captured = cfg.capture_schedule or cfg.microbatch_schedule
    if cfg.microbatch_schedule == captured == Schedule.SEQUENTIAL and not cfg.reuse_graph_buffers:
        return ""
    text = f", schedule {cfg.microbatch_schedule}"
    if cfg.microbatch_schedule == Schedule.ONE_F_ONE_B:
        text += f" ({cfg.microbatches_in_flight} in flight)"
    if captured != cfg.microbatch_schedule:
        text += f", graphs captured {captured}"
    if cfg.reuse_graph_buffers:
        text += ", graph buffers reused"
    return text


class Clock:
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

    def end_step(self) -> None:
        self.steady_iters += 1

    def restart_steady(self) -> None:
        """Graph capture is a one-off: the steady state starts after it."""
        self.steady_start = None

    def restart_interval(self) -> None:
        """Validation and checkpoints print lines of their own: the next log interval starts
        after them."""
        self.interval_start = None

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

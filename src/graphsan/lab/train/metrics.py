"""Console output of a training run: a rich progress bar, one log line per interval, a summary."""

from __future__ import annotations

import resource
import sys

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


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

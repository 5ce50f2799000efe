"""Stop signals during `graphsan train`: Ctrl-C (SIGINT), and the signals schedulers stop jobs with
(SIGTERM from SLURM, Kubernetes and torchrun; SIGHUP; SIGUSR1). Inside the training loop the first
one finishes the iteration in flight, which is saved before training stops; a second one stops at
once, except while a checkpoint is being written: the write is finished first, so that a signal
never leaves a run without the checkpoint it was saving. Outside the loop (building the model,
loading a checkpoint) a signal stops at once. A run stopped at once says what was saved and where
the last good checkpoint is (the trainer adds that to StoppedAtOnce's line).

`StopSignals` holds which signals stop a run and the first one received; `train()` callers other
than the command line get Ctrl-C alone, as a library should not take over a process's signals.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# what SLURM, Kubernetes and torchrun send to stop a job (SIGUSR1: SLURM's --signal, a warning)
SCHEDULER_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1")
COMMAND_LINE_SIGNALS = ("SIGINT", *SCHEDULER_SIGNALS)


def signal_label(signum: int) -> str:
    """The signal's name as a line names it ("Ctrl-C (SIGINT)" for SIGINT)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    return "Ctrl-C (SIGINT)" if name == "SIGINT" else name


class TrainingInterrupted(Exception):
    """A stop signal ended training after `iteration` (the one in flight was finished first);
    `checkpoint` is where it was saved (None: no --save folder). `status` is the exit status a
    shell expects of a process the signal stopped (128 + the signal's number)."""

    def __init__(self, iteration: int, checkpoint: str | None, signum: int = signal.SIGINT):
        saved = (
            f"; checkpoint saved to {checkpoint}" if checkpoint else "; nothing saved (no --save)"
        )
        super().__init__(f"stopped by {signal_label(signum)} after iteration {iteration}{saved}")
        self.iteration, self.checkpoint, self.signum = iteration, checkpoint, int(signum)

    @property
    def status(self) -> int:
        return 128 + self.signum


class StoppedAtOnce(KeyboardInterrupt):
    """A stop signal outside the training loop, or a second one inside it: training stopped
    where it was, the iteration in flight not saved; `where` (the trainer's words) says when it
    stopped and where the last good checkpoint is. A KeyboardInterrupt, so that code which lets
    Ctrl-C through lets these through as well."""

    def __init__(self, signum: int, where: str = ""):
        super().__init__(f"stopped by {signal_label(signum)}" + (f" {where}" if where else ""))
        self.signum = int(signum)

    @property
    def status(self) -> int:
        return 128 + self.signum


@dataclass
class StopSignals:
    """The signals that stop a run (names from the `signal` module; one this platform lacks is
    skipped) and `signum`, the first received inside the training loop (None: none yet)."""

    names: tuple[str, ...] = ("SIGINT",)
    signum: int | None = None
    held: int | None = None  # a later signal that came while holding (a checkpoint's write)
    _holding: bool = field(default=False, init=False, repr=False)

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def _numbers(self) -> list[int]:
        return [getattr(signal, n) for n in self.names if hasattr(signal, n)]

    @contextmanager
    def at_once(self) -> Iterator[StopSignals]:
        """While inside: each signal raises StoppedAtOnce where the program is, unless a stop
        is already under way (the loop received one: the run is ending, and its line will say
        what was saved; a StoppedAtOnce then would replace that line with a poorer one)."""

        def stop(signum, frame):
            if self.signum is not None:
                self.held = signum
                return
            raise StoppedAtOnce(signum)

        with self._handling(stop):
            yield self

    @contextmanager
    def after_iteration(self) -> Iterator[StopSignals]:
        """While inside: the first signal is recorded in `signum` (the loop stops once its
        iteration is done); a second raises StoppedAtOnce, unless `holding`."""

        def record(signum, frame):
            if self.signum is None:
                self.signum = signum
            elif self._holding:
                self.held = signum
            else:
                raise StoppedAtOnce(signum)

        with self._handling(record):
            yield self

    @contextmanager
    def holding(self) -> Iterator[None]:
        """While inside (a checkpoint being written): a signal that would stop at once is kept
        in `held` instead, and the block finishes; the first signal is recorded as ever, so the
        loop stops at the end of the iteration, with the checkpoint on disk."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    @contextmanager
    def _handling(self, handler) -> Iterator[None]:
        """`handler` for each signal, the previous handlers back on the way out; off the main
        thread (where Python cannot set handlers) nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.signal(sig, handler) for sig in self._numbers()}
        try:
            yield
        finally:
            for sig, previous in old.items():
                signal.signal(sig, previous)

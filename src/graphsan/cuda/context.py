"""Phase and step tracking: which part of training a free happened in.

The phase is, in order of precedence: the innermost `graphsan.phase(...)` block; otherwise the
mode of the last `nn.Module.train()` / `.eval()` call ("train" or "eval"), with "no_grad" added
when gradients are off. The step counts optimizer steps (a global optimizer post-hook) unless a
`phase(..., step=N)` block gives it.
"""

from __future__ import annotations

import contextlib
import operator
import os
import threading
import traceback

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from graphsan.core.locations import GRAPHSAN_DIR, location
from graphsan.core.patches import Patches
from graphsan.core.records import Frame

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_SKIP_DIRS = (GRAPHSAN_DIR + os.sep, _TORCH_DIR + os.sep)
_LAB_DIR = os.path.join(GRAPHSAN_DIR, "lab") + os.sep
MAX_FRAMES = 12


def is_user_frame(filename: str) -> bool:
    """Frames of graphsan's sanitizer and of torch itself say nothing about the user's code
    (the lab is user code as far as the sanitizer is concerned)."""
    if filename.startswith(_LAB_DIR):
        return True
    return not filename.startswith(_SKIP_DIRS) and not filename.startswith("<frozen")


def user_frames(frames: list[Frame], limit: int = MAX_FRAMES) -> list[Frame]:
    """Outermost-first frames with sanitizer and torch internals removed, the last `limit` kept,
    each file as its location (`graphsan.core.locations`): a report read on another machine, or
    from another folder, names the same files."""
    kept = [f for f in frames if is_user_frame(f[0])]
    return [(location(f[0]), f[1], f[2]) for f in kept[-limit:]]


def python_stack(limit: int = MAX_FRAMES) -> list[Frame]:
    """The current Python stack, outermost first, user frames only. Cheap: no source lines read."""
    summary = traceback.StackSummary.extract(traceback.walk_stack(None), lookup_lines=False)
    frames = [(fs.filename, fs.lineno or 0, fs.name) for fs in reversed(summary)]
    return user_frames(frames, limit)


def check_count(value, what: str, expected: str = "an integer >= 0") -> int:
    """`value` as an int >= 0; TypeError or ValueError naming `what` and `expected` otherwise."""
    if isinstance(value, bool):  # an int to Python, never a count
        raise TypeError(f"{what} must be {expected}, got {value!r}")
    try:
        n = operator.index(value)  # ints and numpy integers, not floats or strings
    except TypeError:
        raise TypeError(f"{what} must be {expected}, got {value!r}") from None
    if n < 0:
        raise ValueError(f"{what} must be {expected}, got {n}")
    return n


class Phase(contextlib.ContextDecorator):
    """A `with graphsan.phase(...)` block; the same object may be entered again, or nested."""

    def __init__(self, context: Context, name: str, step: int | None) -> None:
        self.context, self.name, self.step = context, name, step

    def __enter__(self) -> Phase:
        self.context._explicit.append((self.name, self.step))
        self.context._notify()
        return self

    def __exit__(self, *exc) -> None:
        # this block's own entry, the last one it pushed: another thread's block may have
        # opened since (phases are process-wide)
        explicit = self.context._explicit
        mine = (self.name, self.step)
        for i in range(len(explicit) - 1, -1, -1):
            if explicit[i] == mine:
                del explicit[i]
                break

    def __repr__(self) -> str:
        return f"graphsan.phase({self.name!r}, step={self.step!r})"


class Context:
    """Process-wide phase and step (frees can happen on autograd's threads, so not thread-local)."""

    def __init__(self) -> None:
        self.module_training: bool | None = None
        self.steps = 0
        self._explicit: list[tuple[str, int | None]] = []
        self._handles: list = []
        self._patches = Patches()  # nn.Module.train, wrapped while started
        # called on every train()/eval() and phase() entry: the moments eager code is about to
        # change state (validation clears caches); the pin policy pins pending graphs here
        self.on_phase_change: list = []
        # called with (module, mode) for every module a train()/eval() call reaches, before it
        # switches: what a graph baked of its mode is watched here (cuda.baked)
        self.on_mode_switch: list = []
        self._switch = threading.local()  # .depth of train() calls, .site of the outermost

    def current(self) -> tuple[str, int]:
        if self._explicit:
            phase, step = self._explicit[-1]
            return phase, self.steps if step is None else step
        grad = torch.is_grad_enabled()
        if self.module_training is None:
            phase = "train" if grad else "no_grad"
        else:
            phase = "train" if self.module_training else "eval"
            if not grad:
                phase += " (no_grad)"
        return phase, self.steps

    def _notify(self) -> None:
        for fn in self.on_phase_change:
            fn()

    def phase(self, name: str, step: int | None = None) -> Phase:
        if not isinstance(name, str):
            raise TypeError(f"graphsan.phase: name must be a string, got {name!r}")
        if not name:
            raise ValueError("graphsan.phase: name must be a non-empty string, got ''")
        if step is not None:
            step = check_count(step, "graphsan.phase: step", "None or an integer >= 0")
        return Phase(self, name, step)

    def switch_site(self) -> tuple[Frame, ...]:
        """The stack of the outermost `train()`/`eval()` call in progress on this thread (user
        frames), read once per call however many modules it switches."""
        switch = self._switch
        if getattr(switch, "site", None) is None:
            switch.site = tuple(python_stack())
        return switch.site

    def start(self) -> None:
        if self._patches:
            return
        orig = torch.nn.Module.train
        ctx = self

        def train(module, mode: bool = True):
            ctx.module_training = bool(mode)
            switch = ctx._switch
            depth = getattr(switch, "depth", 0)
            if depth == 0:
                switch.site = None  # the call's stack, read once where someone asks for it
            if ctx.on_mode_switch:
                for fn in list(ctx.on_mode_switch):
                    fn(module, bool(mode))
            if ctx.on_phase_change:
                ctx._notify()
            switch.depth = depth + 1
            try:
                return orig(module, mode)
            finally:
                switch.depth = depth

        train.__wrapped__ = orig
        self._patches.set(torch.nn.Module, "train", train)

        def count_step(_optimizer, _args, _kwargs):
            ctx.steps += 1

        self._handles.append(register_optimizer_step_post_hook(count_step))

    def stop(self) -> None:
        self._patches.restore()
        for h in self._handles:
            h.remove()
        self._handles.clear()

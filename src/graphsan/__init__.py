"""graphsan: catch stale memory in any CUDA graph before it replays.

A captured CUDA graph bakes raw device addresses into its kernels. When eager code later frees,
resizes or replaces memory a live graph still uses, the next replay silently corrupts data or
dies with "an illegal memory access". graphsan watches every graph captured in the process and,
before a replay that would touch such memory, names the graph, kernel node, argument, buffer,
where it was allocated and where (in which phase and step) it was freed.

Turn it on for a whole program with ``graphsan run script.py`` (or ``-m module``), or in code::

    import graphsan
    san = graphsan.enable(policy="raise")     # "raise" | "warn" | "record" | "pin"
    ...
    with graphsan.watch(policy="warn") as san:
        ...
    with graphsan.phase("eval", step=100):    # optional; train/eval is tracked automatically
        ...

``import graphsan`` itself loads neither torch nor the sanitizer: they load on first use, so the
command line answers quickly and ``graphsan run`` adds nothing to the user's process up front.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from graphsan.core.records import Finding
from graphsan.policies import POLICIES, Policy
from graphsan.report import StaleMemoryError

if TYPE_CHECKING:
    from graphsan.cuda.context import Context, Phase
    from graphsan.runtime.sanitizer import Sanitizer

__all__ = [
    "POLICIES",
    "Finding",
    "Policy",
    "Sanitizer",
    "StaleMemoryError",
    "current",
    "disable",
    "enable",
    "label",
    "phase",
    "step",
    "watch",
]
__version__ = "0.1.0"

_current: Sanitizer | None = None
_enabled = False  # enable() was called and disable() was not called since
_context_obj: Context | None = None


def __getattr__(name: str):
    # the sanitizer's names load torch: only when asked for
    if name == "Sanitizer":
        from graphsan.runtime import sanitizer

        return getattr(sanitizer, name)
    if name == "_context":  # the process-wide phase and step
        return _get_context()
    raise AttributeError(f"module 'graphsan' has no attribute {name!r}")


def _get_context() -> Context:
    global _context_obj
    if _context_obj is None:
        from graphsan.cuda.context import Context

        _context_obj = Context()
    return _context_obj


def enable(policy: str | Policy = Policy.RAISE, *, alloc_stacks: bool = True) -> Sanitizer:
    """Start watching every CUDA graph captured from now on. Idempotent: until `disable()`, a
    second call returns the same sanitizer with the new policy (`alloc_stacks` stays as it was).
    Without CUDA it says so once and stays idle."""
    global _current, _enabled
    policy = Policy.parse(policy)
    _check_environment()
    from graphsan.runtime.sanitizer import Sanitizer

    if _enabled and _current is not None:
        _current.policy = policy
        return _current
    _current = Sanitizer(policy, _get_context(), alloc_stacks)
    _enabled = True
    return _current.start()


def _check_environment() -> None:
    """Say once per process, in one line each, which GRAPHSAN_* variables are wrong or unknown
    (the library never raises for its environment: the CLI refuses a wrong value instead, and
    says the rest itself)."""
    import sys

    from graphsan import environment

    if environment.said:
        return
    environment.said = True
    errors, warnings = environment.problems()
    for line in errors + warnings:
        sys.stderr.write(f"graphsan: {line}\n")


def disable() -> None:
    """Stop watching. Findings stay available on the Sanitizer that `enable` returned."""
    global _enabled
    _enabled = False
    if _current is not None:
        _current.stop()


def current() -> Sanitizer | None:
    """The sanitizer of this process, if one was enabled."""
    return _current


@contextlib.contextmanager
def watch(policy: str | Policy = Policy.WARN, **kwargs) -> Iterator[Sanitizer]:
    """Watch graphs inside the block; the previous state (on or off, policy) is restored after."""
    was = _current if _enabled else None
    old_policy = was.policy if was is not None else None
    san = enable(policy, **kwargs)
    try:
        yield san
    finally:
        if was is None:
            disable()
        else:
            was.policy = old_policy


def phase(name: str, step: int | None = None) -> Phase:
    """Tag frees inside the block with a phase name (and a step, else the optimizer step count).
    The returned object is a reusable context manager (and decorator)."""
    return _get_context().phase(name, step)


def step(count: int = 1) -> int:
    """Count training steps for optimizers that are not `torch.optim.Optimizer` (those are
    counted automatically). Returns the step number that frees are now tagged with."""
    from graphsan.cuda.context import check_count

    ctx = _get_context()
    ctx.steps += check_count(count, "graphsan.step: count")
    return ctx.steps


@contextlib.contextmanager
def label(name: str) -> Iterator[None]:
    """Name the graphs captured inside the block (reports show the label)."""
    san = _current
    if san is None:
        yield
        return
    san.push_label(name)
    try:
        yield
    finally:
        san.pop_label()

"""`graphsan selftest`: does graphsan work with this torch, on this GPU?

A corpus of correct CUDA-graph programs written from public patterns (PyTorch's CUDA-graph
documentation and tests, torch.compile, every `torch.optim` optimizer that captures, Triton,
inference loops, pipeline schedules), each with a broken twin that makes one realistic mistake.
Every program runs in its own process under `graphsan.enable(policy="raise")`:

- a correct program must finish with no finding (a finding there is a false alarm);
- its twin must be stopped before the bad replay, by a finding on the memory it broke
  (a replay that runs, or a finding elsewhere, is a miss).

Kernel argument layouts change between PyTorch releases, which is why this runs on the user's
machine and not only on ours. `selftest --list` needs no GPU.

A program is a function of a `Case` (`graphsan.selftest.case`), registered with `program`; the
corpus lives in `graphsan.selftest.corpus`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

CORRECT, BUG = "correct", "bug"
BUG_SUFFIX = ":bug"
CORPUS = ("optim", "graphed", "elementwise", "kernels", "patterns", "triton_kernels", "baked")


@dataclass(frozen=True)
class Program:
    """One pattern: `run(case)` does the correct program, and its broken twin when
    `case.broken` is True (`bug` says what the twin gets wrong)."""

    name: str
    pattern: str
    source: str  # the public document or test the pattern follows
    bug: str
    run: Callable

    def entries(self) -> list[dict]:
        """The two runs, as `selftest --list --json` writes them."""
        base = {"pattern": self.pattern, "source": self.source}
        return [
            {"name": self.name, "kind": CORRECT, **base},
            {"name": self.name + BUG_SUFFIX, "kind": BUG, **base, "bug": self.bug},
        ]


_REGISTRY: dict[str, Program] = {}


def program(name: str, *, pattern: str, source: str, bug: str) -> Callable:
    """Register `fn(case)` as the corpus program `name`."""

    def register(fn: Callable) -> Callable:
        if name in _REGISTRY:
            raise ValueError(f"selftest program {name!r} is registered twice")
        _REGISTRY[name] = Program(name, pattern, source, bug, fn)
        return fn

    return register


def programs() -> dict[str, Program]:
    """Every program of the corpus, by name (importing the corpus registers them)."""
    for module in CORPUS:
        importlib.import_module(f"graphsan.selftest.corpus.{module}")
    return dict(sorted(_REGISTRY.items()))


def runs() -> list[dict]:
    """Every run (each program and its twin) in listing order."""
    return [e for p in programs().values() for e in p.entries()]


def find(run_name: str) -> tuple[Program, bool]:
    """The program of a run name and whether it is the broken twin; KeyError if unknown."""
    broken = run_name.endswith(BUG_SUFFIX)
    name = run_name[: -len(BUG_SUFFIX)] if broken else run_name
    return programs()[name], broken

"""Every environment variable graphsan reads, checked once at start-up on every path (the CLI's
commands and `graphsan.enable()`), CPU included: a typo baked into a container image shows on
the first run anywhere, not only where the variable is read (the GPU paths).

Loads without torch. The README's table of variables lists the same names (a test holds them
equal).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "GRAPHSAN_"
said = False  # the problems were said in this process (by the CLI or graphsan.enable())
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Variable:
    name: str
    values: tuple[str, ...]  # accepted (compared lower-case, stripped); () = any
    default: str
    effect: str


VARIABLES = (
    Variable(
        "GRAPHSAN_TRACELOG",
        ("", "0", "1"),
        "unset",
        "the compiled allocator tracker: unset, it is used, built by a background process the "
        "first time (that run reads allocator snapshots); 1: a run waits for the build; 0: off, "
        "allocator snapshots and PyTorch's GPU trace",
    ),
    Variable(
        "GRAPHSAN_ATTACH",
        ("", "auto", "wrap"),
        "auto",
        "how graphsan attaches to torch.cuda.CUDAGraph: auto, through PyTorch's per-graph hooks "
        "where the installed torch has them and a raising replay-start hook is seen to stop the "
        "replay (torch 2.14 onwards), by wrapping the class's methods elsewhere; wrap: by "
        "wrapping everywhere",
    ),
    Variable(
        "GRAPHSAN_NO_TRITON",
        _TRUE + _FALSE,
        "unset (Triton on)",
        "the lab's quantize kernels: 1, true, yes or on runs the torch reference instead of "
        "Triton; 0, false, no, off or empty keeps Triton",
    ),
)
# read only by graphsan's own tests
TEST_VARIABLES = (
    "GRAPHSAN",
    "GRAPHSAN_CHROMIUM",
    "GRAPHSAN_ALSO_TRITON",
    "GRAPHSAN_TEST_TORCH_HOOKS",
    "GRAPHSAN_TEST_SANITIZE",
    "GRAPHSAN_SCREENSHOTS",
)


def problems(environ: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings): a known variable with a value it does not take, and a GRAPHSAN_*
    name graphsan does not read; one line each."""
    env = os.environ if environ is None else environ
    known = {v.name: v for v in VARIABLES}
    errors, warnings = [], []
    for name in sorted(env):
        if not name.startswith(PREFIX) or name in TEST_VARIABLES:
            continue
        var = known.get(name)
        if var is None:
            warnings.append(
                f"{name} is set but graphsan reads no such variable (it reads {', '.join(known)})"
            )
            continue
        value = env[name]
        if var.values and value.strip().lower() not in var.values:
            accepted = ", ".join(repr(x) if x else "empty" for x in var.values)
            errors.append(f"{name}={value!r}: expected one of {accepted}")
    return errors, warnings

"""Launching the compiled quantize kernels without Triton's per-call binding.

`kernel[grid](*args, **constexprs)` makes Triton bind every argument, specialize it, build a
cache key and look the compiled kernel up on every call: on the H200's host that is several
times the cost of a torch launch, and an eager NVFP4 QuantLinear step makes about twenty such
launches. `fast(kernel)` wraps a `triton.jit` kernel so that each call computes only the facts
Triton specializes on (`spec`: every tensor's dtype and 16-byte alignment, every integer's
value class: 1, a multiple of 16, or other, and 32 or 64 bits; the constexpr and option values;
the current device), and, for a key seen before, launches the `CompiledKernel` Triton returned the first time, with
the same arguments in parameter order. A key seen for the first time goes through Triton as
before (which compiles if needed), so a new alignment or divisibility still gets its own
specialization. Under Triton's interpreter (CPU tests) the kernel is returned as it is.

This leans on Triton internals: `JITFunction.params` (`.is_constexpr`, `.name`, `.default`) and
`CompiledKernel[grid](*args)` taking every argument, constexprs included, in parameter order. So
it is fenced to the Triton versions where that was checked (`CHECKED_TRITON`): on any other
version `fast(kernel)` returns the kernel itself (Triton's own launch path) and says so once at
debug level. A version is checked by tests/lab/launch_convention.py (on CPU: Triton's path and
`FastKernel`'s reach a stand-in launcher with the same arguments) and, on a GPU, by
tests/lab/test_fastlaunch.py (compiled launches through both paths, byte for byte).
"""

from __future__ import annotations

import logging
import re

import torch

ENABLED = True  # False: every launch goes through Triton's binding (the tests compare the two)

# (major, minor) of the oldest and the newest Triton whose launch convention was checked: 3.6
# on the H200 (GPU test) and by the CPU check, 3.7 to 3.9 by the CPU check.
CHECKED_TRITON = ((3, 6), (3, 9))

log = logging.getLogger(__name__)
_told = False  # whether the one debug line about an unchecked Triton was logged


def triton_version(version: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of Triton's version string (the installed one by default); None where it
    does not start with two numbers."""
    if version is None:
        import triton

        version = triton.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def checked(version: str | None = None) -> bool:
    """Whether the Triton version (the installed one by default) lies in CHECKED_TRITON."""
    v = triton_version(version)
    return v is not None and CHECKED_TRITON[0] <= v <= CHECKED_TRITON[1]


def current_device() -> int:
    """The device a launch goes to (a compiled kernel belongs to one device's context)."""
    return torch.cuda.current_device()


def spec(value):
    """What Triton's launcher specializes on for one argument (the key of a compiled kernel)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return (
            int,
            1 if value == 1 else (16 if value % 16 == 0 else 0),
            -(2**31) <= value < 2**31,
        )
    if isinstance(value, float):
        return float
    return value


class FastKernel:
    """A `triton.jit` kernel whose launches skip Triton's binding once a key has been seen;
    `kernel[grid](*args, **kwargs)` as for the kernel itself. Constexpr and compile options are
    passed by keyword, tensors and integers by position (every call site in the launchers,
    `launch_*.py`)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.params = kernel.params
        self.cache: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._run(grid, args, kwargs)

    def _run(self, grid, args, kwargs):
        if not ENABLED:
            return self.kernel[grid](*args, **kwargs)
        key = (current_device(), tuple(map(spec, args)), tuple(kwargs.items()))
        hit = self.cache.get(key)
        if hit is not None:
            compiled, tail = hit
            compiled[(*grid, 1, 1)[:3]](*args, *tail)
            return compiled
        compiled = self.kernel[grid](*args, **kwargs)
        tail = self._tail(len(args), kwargs)
        if tail is not None and compiled is not None:
            self.cache[key] = (compiled, tail)
        return compiled

    def _tail(self, n_args: int, kwargs: dict) -> tuple | None:
        """The values of the parameters after the positional ones, in order (kwargs or their
        defaults); None where one of them is not a constexpr (its value would then be a launch
        argument that the key does not pin) or a constexpr comes by position (the key holds only
        its value class): such calls keep Triton's path."""
        if any(p.is_constexpr for p in self.params[:n_args]):
            return None
        tail = []
        for p in self.params[n_args:]:
            if not p.is_constexpr:
                return None
            tail.append(kwargs.get(p.name, p.default))
        return tuple(tail)


def fast(kernel):
    """`kernel` wrapped in a `FastKernel` where it is compiled (a JITFunction) and the installed
    Triton is a checked one, else itself (Triton's interpreter has no compiled kernels)."""
    global _told
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        return kernel
    if not checked():
        if not _told:
            import triton

            low, high = (".".join(map(str, v)) for v in CHECKED_TRITON)
            log.debug(
                "fastlaunch: Triton %s is outside the checked versions %s to %s; the kernels "
                "launch through Triton's own path",
                triton.__version__,
                low,
                high,
            )
            _told = True
        return kernel
    return FastKernel(kernel)

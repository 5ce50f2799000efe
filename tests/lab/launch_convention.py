"""The launch convention `kernels/fastlaunch.py` relies on, checked on the installed Triton on
CPU: one of the lab's quantize kernels is compiled for an sm_90 target (no GPU needed), and a
stand-in driver records what reaches the launcher (`CompiledKernel.run`) from Triton's own
`kernel[grid](...)` path and from `FastKernel`'s path for a key seen before. Both must hand it
the same grid, stream, function, metadata and hooks, and every kernel argument (constexprs
included) in parameter order.

Run by tests/lab/test_fastlaunch.py in its own process (the kernels must be compiled, not
interpreted: TRITON_INTERPRET must be off before Triton is imported):

    TRITON_INTERPRET=0 PYTHONPATH=src python3 -m tests.lab.launch_convention

Prints one line, `launch convention: ok on Triton X` or `launch convention: FAILED on Triton X:
<what differs or what could not be set up>`, and exits 0 or 1. A Triton whose internals moved
so that the stand-in cannot be installed fails here too, with the step that did not work.
"""

from __future__ import annotations

import os
import sys
import tempfile

GRID = (3, 2)  # two programs down the rows, two along the words: a 2-D grid, the third dim 1


class ConventionError(Exception):
    """What differs, or the step of the stand-in set-up that did not work."""


class Recorder:
    """The stand-in's launcher (what `driver.active.launcher_cls(src, metadata)` makes): every
    call's arguments, in order."""

    calls: list[tuple] = []

    def __init__(self, src, metadata):
        self.name = getattr(metadata, "name", None)

    def __call__(self, *args):
        Recorder.calls.append(args)


class StandInUtils:
    """The driver utilities a CompiledKernel asks for when it is first launched."""

    def load_binary(self, name, kernel, shared, device):
        return "module", f"function {name}", 32, 0, 1024  # module, function, regs, spills, threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "warpSize": 32}

    def unload_module(self, module):
        pass


class StandInDriver:
    """A driver for one sm_90 device on stream 7 that launches nothing (it records)."""

    launcher_cls = Recorder
    device = 0
    stream = 7

    def __init__(self):
        self.utils = StandInUtils()

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return self.stream

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_capability(self, device=None):
        return (9, 0)


def install_stand_in():
    """Make the stand-in Triton's active driver; a ConventionError where this Triton has no
    place for one."""
    try:
        from triton.runtime import driver
    except ImportError as err:
        raise ConventionError(
            f"no triton.runtime.driver to install a stand-in into ({err})"
        ) from err
    if not hasattr(driver, "set_active"):
        raise ConventionError(
            "triton.runtime.driver has no set_active: the stand-in is not installed"
        )
    stand_in = StandInDriver()
    driver.set_active(stand_in)
    if getattr(driver, "active", None) is not stand_in:
        raise ConventionError("driver.set_active did not make the stand-in the active driver")
    return stand_in


def kernel_arguments():
    """`nvfp4_row_words_kernel`'s arguments as `launch_nvfp4._nvfp4_row_words` passes them for a
    16 x 64 bf16 source with SR, PER_ROW left at its default (so the fast path must supply it)."""
    import torch

    from graphsan.lab.quant.formats import INV_6
    from graphsan.lab.quant.kernels.launch_common import COMPILE_OPTIONS

    rows, words = 16, 16
    args = (
        torch.zeros(rows, words, dtype=torch.int64),  # the source as 64-bit words
        rows,
        words,
        words,  # row stride in words
        torch.ones((), dtype=torch.float32),  # the global amax
        torch.zeros(1, dtype=torch.int64),  # the SR seed
        torch.zeros(rows, words, dtype=torch.int16),  # data
        torch.zeros(rows, words // 4, dtype=torch.uint8),  # scales
    )
    kwargs = dict(INV_6=INV_6, LEGACY=False, BLOCK_2D=False, SR=True, HW_FP8=True, MAXNUM=True)
    kwargs |= dict(BR=16, CW=8, num_warps=2, **COMPILE_OPTIONS)
    return args, kwargs


def same(a, b) -> bool:
    """One launcher argument equal on both paths: tensors the same object, metadata the same
    content, anything else equal."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if hasattr(a, "get") and hasattr(a, "extras"):  # launch metadata (Triton's LazyDict)
        return type(a) is type(b) and a.get() == b.get()
    return a is b or a == b


def check() -> str:
    """The Triton version checked; a ConventionError naming what differs."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise ConventionError("TRITON_INTERPRET is on: the kernels would be interpreted")
    install_stand_in()
    import triton
    from triton.runtime.jit import JITFunction

    from graphsan.lab.quant.kernels import fastlaunch
    from graphsan.lab.quant.kernels import nvfp4_words as jit

    kernel = jit.nvfp4_row_words_kernel
    if not isinstance(kernel, JITFunction):
        raise ConventionError(f"the kernel is a {type(kernel).__name__}, not a JITFunction")
    fastlaunch.current_device = lambda: StandInDriver.device  # torch has no CUDA device here
    args, kwargs = kernel_arguments()

    Recorder.calls.clear()
    try:
        compiled = kernel[GRID](*args, **kwargs)
    except Exception as err:
        raise ConventionError(f"Triton's own launch on the stand-in failed: {err!r}") from err
    if len(Recorder.calls) != 1:
        raise ConventionError(
            f"Triton's own launch reached the launcher {len(Recorder.calls)} times, not once "
            "(the stand-in driver's launcher is not what this Triton calls)"
        )
    theirs = Recorder.calls[0]

    fk = fastlaunch.FastKernel(kernel)
    fk[GRID](*args, **kwargs)  # a key not seen before: Triton's path, which fills the cache
    if not fk.cache:
        raise ConventionError("FastKernel kept no compiled kernel: its fast path never runs")
    through_triton = []
    real_run = JITFunction.run
    JITFunction.run = lambda self, *a, **k: through_triton.append(1) or real_run(self, *a, **k)
    try:
        fk[GRID](*args, **kwargs)  # the key seen: the compiled kernel launched directly
    finally:
        JITFunction.run = real_run
    if through_triton:
        raise ConventionError("the second FastKernel launch went through Triton's binding")
    if len(Recorder.calls) != 3:
        raise ConventionError(f"the launcher was reached {len(Recorder.calls)} times, not 3")
    ours = Recorder.calls[2]
    if compiled is None or fk.cache[next(iter(fk.cache))][0] is not compiled:
        raise ConventionError("FastKernel kept another compiled kernel than Triton launched")

    head = ("grid x", "grid y", "grid z", "stream", "function", "packed metadata")
    head += ("launch metadata", "enter hook", "exit hook")
    n_params = len(kernel.params)
    if len(theirs) != len(head) + n_params:
        raise ConventionError(
            f"Triton passed {len(theirs) - len(head)} kernel arguments to the launcher, the "
            f"kernel has {n_params} parameters (constexprs included): the convention moved"
        )
    if len(ours) != len(theirs):
        raise ConventionError(
            f"FastKernel passed {len(ours)} launcher arguments, Triton {len(theirs)}"
        )
    names = list(head) + [p.name for p in kernel.params]
    for name, a, b in zip(names, theirs, ours, strict=True):
        if not same(a, b):
            raise ConventionError(f"{name}: Triton passed {a!r}, FastKernel {b!r}")
    if tuple(theirs[:3]) != (*GRID, 1):
        raise ConventionError(f"the grid reached the launcher as {theirs[:3]}, not {(*GRID, 1)}")
    return triton.__version__


def main() -> int:
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="launch-convention-"))
    try:
        import triton

        version = triton.__version__
    except ImportError as err:
        print(f"launch convention: FAILED: Triton does not import ({err})")
        return 1
    try:
        check()
    except ConventionError as err:
        print(f"launch convention: FAILED on Triton {version}: {err}")
        return 1
    print(f"launch convention: ok on Triton {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

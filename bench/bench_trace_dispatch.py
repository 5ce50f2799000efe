"""What PyTorch's GPU trace costs per event before graphsan's callback runs, on the CPU.

    PYTHONPATH=src python bench/bench_trace_dispatch.py [--depth 32] [--allocs 400]

Once `torch._C._activate_gpu_trace()` has run (graphsan needs it to see frees), every allocation,
free, event record and wait, and synchronization of the CUDA caching allocator calls into Python:
PyTorch's C++ side takes the GIL, imports `torch.cuda` (`PyImport_Import`, which goes through
`builtins.__import__` with a non-empty from-list), reads `_gpu_trace.<Kind>Callbacks
.fire_callbacks` and calls it, whether or not a callback is registered. Without a GPU that path
cannot be run, so this models it in Python with the same calls; the model leaves out the GIL
hand-over and pybind's own work, so it is a lower bound. The rows: the dispatch alone (every traced
event), then with graphsan's free callback (an unwatched free), and a temporary: the allocation
callback (from a `--depth`-deep stack, site walk included) followed by the free's. Times are this thread's CPU time per event,
median of `--rounds` rounds of `--batch` events.

Beside the model, the compiled replacement is measured for real (where a C++ compiler and CUDA
headers are present): graphsan's own GPU-trace interpreter (gputrace.cpp, gputable.cpp), called from C++ as
the allocator calls it, with the GIL released as PyTorch's operators release it. A temporary
there is an allocation whose site is read in C++, then its free, neither reaching Python.
"""

from __future__ import annotations

import argparse
import builtins
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch  # noqa: F401  (torch.cuda must be importable, as in the traced process)
import torch.cuda._gpu_trace as gpu_trace

from graphsan.core.tracker import Tracker
from graphsan.cuda import tracelog
from graphsan.cuda.allocator import SITE_DEPTH, AllocatorWatch
from graphsan.cuda.context import Context

BASE = 0x7F00_0000_0000
TEMPORARY = "dispatch + graphsan allocation callback, then its free"


def _raise(err: BaseException) -> None:
    raise err


def torch_dispatch(kind: str) -> Callable[[int], None]:
    """What PyTorch's C++ side does for one traced event of `kind`, in Python."""
    caller_globals = {"__name__": "__main__", "__builtins__": builtins}

    def fire(ptr: int) -> None:
        builtins.__import__("torch.cuda", caller_globals, caller_globals, ["__doc__"], 0)
        mod = sys.modules["torch.cuda"]
        getattr(mod._gpu_trace, kind).fire_callbacks(ptr)

    return fire


def nested(depth: int, fn: Callable[[], float]) -> float:
    return fn() if depth <= 0 else nested(depth - 1, fn)


def per_event(
    fire: Callable[[int], None], batch: int, depth: int, then: Callable[[int], None] | None = None
) -> float:
    """us per call of `fire` (followed by `then` on the same pointer: a temporary's free)."""
    ptrs = [BASE + 512 * i for i in range(batch)]

    def run() -> float:
        t = time.thread_time()
        if then is None:
            for p in ptrs:
                fire(p)
        else:
            for p in ptrs:
                fire(p)
                then(p)
        return (time.thread_time() - t) / batch * 1e6

    return nested(depth, run)


def compiled_rows(args) -> dict[str, list[float]] | str:
    """us per temporary through the compiled trace, with and without sites; or why not."""
    try:
        trace = tracelog.build_unattached(tempfile.mkdtemp(prefix="graphsan-bench-")).gpu_trace
    except tracelog.BuildError as err:
        return str(err)
    if isinstance(trace, str):
        return trace
    reason = trace.install()
    if reason is not None:
        return reason
    rows: dict[str, list[float]] = {}
    try:
        trace.callbacks(None, None)
        for sites, name in ((True, "site read in C++"), (False, "no sites")):
            key = f"compiled trace: a temporary, {name}"
            rows[key] = []
            trace.enable(True, sites=sites, depth=SITE_DEPTH)
            for _ in range(args.rounds):

                def run(sites=sites) -> float:
                    t = time.thread_time()
                    trace.fire_temporaries(BASE, args.batch)
                    return (time.thread_time() - t) / args.batch * 1e6

                rows[key].append(nested(args.depth, run))
    finally:
        trace.enable(False)
        trace.uninstall()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=32, help="Python frames below the allocation")
    p.add_argument("--allocs", type=int, default=400, help="eager allocations a step makes")
    p.add_argument("--batch", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    for name in ("depth", "allocs", "batch", "rounds"):
        if getattr(args, name) < (0 if name == "depth" else 1):
            p.error(f"--{name} must be positive, got {getattr(args, name)}")

    watch = AllocatorWatch(Tracker(), Context(), _raise, True)
    watch._active = True  # the callbacks without a GPU
    alloc_fire = torch_dispatch("MemoryAllocationCallbacks")
    free_fire = torch_dispatch("MemoryDeallocationCallbacks")
    rows: dict[str, list[float]] = {
        "dispatch, no callback": [],
        "dispatch + graphsan free callback": [],
        TEMPORARY: [],
    }
    registered = False
    for _ in range(args.rounds):
        if registered:  # callback lists cannot be emptied by API; restore them each round
            gpu_trace.MemoryAllocationCallbacks.callback_list.clear()
            gpu_trace.MemoryDeallocationCallbacks.callback_list.clear()
        rows["dispatch, no callback"].append(per_event(free_fire, args.batch, args.depth))
        gpu_trace.MemoryAllocationCallbacks.add_callback(watch._on_alloc)
        gpu_trace.MemoryDeallocationCallbacks.add_callback(watch._on_free)
        registered = True
        rows[TEMPORARY].append(per_event(alloc_fire, args.batch, args.depth, then=free_fire))
        rows["dispatch + graphsan free callback"].append(
            per_event(free_fire, args.batch, args.depth)
        )
    gpu_trace.MemoryAllocationCallbacks.callback_list.clear()
    gpu_trace.MemoryDeallocationCallbacks.callback_list.clear()

    compiled = compiled_rows(args)
    if isinstance(compiled, str):
        print(f"# the compiled trace is not measured: {compiled}")
    else:
        rows.update(compiled)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"# torch {torch.__version__}, stack depth {args.depth}, CPU only (a model: lower bound)")
    print("| per event | us (median) |")
    print("|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} |")
    step = med[TEMPORARY] * args.allocs
    floor = med["dispatch, no callback"] * 2 * args.allocs
    print(
        f"# a step with {args.allocs} eager allocations and their frees: {step / 1e3:.2f} ms "
        f"under graphsan, of which {floor / 1e3:.2f} ms is PyTorch's dispatch alone"
    )
    key = "compiled trace: a temporary, site read in C++"
    if key in med:
        print(
            f"# the same step through graphsan's compiled trace: "
            f"{med[key] * args.allocs / 1e3:.3f} ms ({med[key] / med[TEMPORARY]:.3f}x)"
        )


if __name__ == "__main__":
    main()

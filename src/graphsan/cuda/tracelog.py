"""The caching allocator's event log through a compiled trace tracker (tracelog.cpp).

torch offers the allocator's event log to Python only inside a memory snapshot, and its C++
snapshot walks every allocator block before it filters by pool, so reading the log that way costs
the blocks alive. A tracker attached with `attachAllocatorTraceTracker` gets each event as it
happens (memory history on or off), and a drain costs the events since the last one.

The tracker is built on first use with the system C++ compiler against the installed torch's
headers (no pybind, no torch extension machinery), cached under `$XDG_CACHE_HOME/graphsan` keyed
by the torch build and the source, and loaded with ctypes. It is on by default: with the library
in the cache it is loaded at once; with a cold cache the run starts the build in a background
process (for the runs after it) and reads snapshots itself, so no run waits for the compiler
unasked. `GRAPHSAN_TRACELOG=1` waits for the build instead, `0` turns the tracker off, and
`python -m graphsan.cuda.tracelog` builds it ahead (an image's build step).
The library is `cuda.tracelib`, its build and cache `cuda.tracebuild`; this module attaches the
process's one tracker and builds ahead from the command line.
Anything that fails on the way (no compiler, no CUDA headers, a build or load error, a missing
symbol, another allocator backend) leaves `open_log()` returning no log and one line saying why;
the caller then reads the log from snapshots as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Sequence

from graphsan.cuda import tracebuild, tracelib
from graphsan.cuda.gputrace import GpuTrace
from graphsan.cuda.tracelib import BuildError, TraceLog

# -- the process's log ------------------------------------------------------------------------
_lock = threading.Lock()
_opened: list[tuple[TraceLog | None, str | None]] = []


def open_log() -> tuple[TraceLog | None, str | None]:
    """The process's tracker, attached to the CUDA caching allocator (built and attached once
    per process; CUDA must be available). Returns (log, None) or (None, why not)."""
    with _lock:
        if not _opened:
            try:
                _opened.append((_open(), None))
            except BuildError as err:
                _opened.append((None, str(err)))
            except Exception as err:  # whatever else goes wrong, the snapshots still work
                line = (str(err).strip().splitlines() or [""])[0][:300]
                _opened.append((None, f"{type(err).__name__}: {line}"))
        return _opened[0]


def _open() -> TraceLog:
    setting = os.environ.get(tracebuild.ENV, "").strip()
    if setting == "0":
        raise BuildError(f"{tracebuild.ENV}=0")
    if setting not in ("", "1"):
        raise BuildError(
            f"{tracebuild.ENV}={setting!r}: expected 0 (off) or 1 (on, waiting for the build)"
        )
    import torch

    if not torch.version.cuda:
        raise BuildError("torch is not built with CUDA")
    backend = torch.cuda.get_allocator_backend()
    if backend != "native":
        raise BuildError(f"the allocator backend is {backend}, not native")
    log, c10_cuda = for_this_torch(wait=setting == "1")
    torch.cuda.init()  # the allocator makes its per-device state here; trackers attach to it
    err = ctypes.create_string_buffer(512)
    if log.lib.gs_tracelog_attach(c10_cuda.encode(), err, len(err)) != 0:
        raise BuildError(err.value.decode("utf-8", "replace"))
    return log


def torch_lib_dir() -> str:
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "lib")


def for_this_torch(wait: bool = True) -> tuple[TraceLog, str]:
    """The library for the installed torch and this Python, from the cache or built into it now
    (no GPU needed; `wait=False`: built by a background process, raising BuildError(BUILDING)),
    and the path of the libc10_cuda it attaches to. Raises BuildError."""
    import torch

    if not torch.version.cuda:
        raise BuildError("torch is not built with CUDA")
    lib_dir = torch_lib_dir()
    c10_cuda = os.path.join(lib_dir, "libc10_cuda.so")
    if not os.path.isfile(c10_cuda):
        raise BuildError(f"no libc10_cuda.so in {lib_dir}")
    abi = int(torch.compiled_with_cxx11_abi())
    python = "py{}.{}".format(*sys.version_info[:2])  # the GPU trace links to the interpreter
    key = f"{torch.__version__} {torch.version.git_version} abi{abi} {python}"
    return tracebuild.obtain(key, lib_dir, wait=wait), c10_cuda


def build_unattached(folder: str, extra: Sequence[str] = ()) -> TraceLog:
    """The library built against this torch into `folder`, linked to libc10 only and not
    attached (tests and benchmarks without a GPU; `extra` compiler flags, such as the
    sanitizers'); its `gpu_trace` says why where this Python cannot have it. Raises BuildError."""
    import torch

    cxx, cuda = tracebuild.find_compiler(), tracebuild.cuda_include_dirs()
    if cxx is None or not cuda:
        raise BuildError("needs a C++ compiler and CUDA headers (cuda_runtime_api.h)")
    torch_flags = tracebuild.TorchFlags.of_torch()
    includes = [*torch_flags.include_dirs, *cuda]
    if not os.path.isfile(os.path.join(includes[0], "c10/cuda/impl/cuda_cmake_macros.h")):
        # CPU wheels ship c10/cuda's headers without this generated one
        stub = os.path.join(folder, "stub", "c10", "cuda", "impl")
        os.makedirs(stub, exist_ok=True)
        with open(os.path.join(stub, "cuda_cmake_macros.h"), "w") as fh:
            fh.write("#pragma once\n")
        includes.append(os.path.join(folder, "stub"))
    target = os.path.join(folder, "tracelog-unattached.so")
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    why = tracebuild.why_no_trace()
    sources = tracebuild.SOURCES if why is None else tracebuild.TRACKER_SOURCES
    flags = tracebuild.TorchFlags(torch_flags.std, torch_flags.defines, tuple(includes))
    tracebuild.build(target, cxx, flags, lib_dir, ["c10"], sources, extra)
    return tracelib.load(target, why)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m graphsan.cuda.tracelog`: build the library for the installed torch and this
    Python into the cache now, so that no run pays the compile on its first `enable()` (a
    container image can do it once, without a GPU); one line says where it is, or why not."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m graphsan.cuda.tracelog", description=main.__doc__.split(":", 1)[1].strip()
    )
    parser.add_argument(
        "--marker", help=argparse.SUPPRESS
    )  # a background build's, removed at the end
    args = parser.parse_args(argv)
    try:
        log, _ = for_this_torch()
    except BuildError as err:
        print(f"graphsan tracelog: error: {err}", file=sys.stderr)
        return 1
    finally:
        if args.marker:
            with contextlib.suppress(OSError):
                os.unlink(args.marker)
    trace = log.gpu_trace
    with_trace = "with" if isinstance(trace, GpuTrace) else f"without ({trace})"
    print(f"graphsan tracelog: {log.path}, {with_trace} the GPU trace")
    return 0


if __name__ == "__main__":
    sys.exit(main())

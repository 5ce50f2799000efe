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
Anything that fails on the way (no compiler, no CUDA headers, a build or load error, a missing
symbol, another allocator backend) leaves `open_log()` returning no log and one line saying why;
the caller then reads the log from snapshots as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from graphsan.cuda import gputrace, graphwalk
from graphsan.cuda.gputrace import GpuTrace
from graphsan.cuda.graphwalk import GraphWalk

ENV = "GRAPHSAN_TRACELOG"
# the reason of a run that found the cache cold and left the compile to a background process
BUILDING = (
    "the compiled tracker is being built for the runs after this one "
    f"(python -m graphsan.cuda.tracelog builds it ahead; {ENV}=1 waits for it)"
)
HERE = os.path.dirname(os.path.abspath(__file__))
# built into one library: the tracker, the graph walk (graphwalk.cpp, needing only cuda.h) and
# the GPU trace, which is left out where PyTorch's headers do not fit it (TRACKER_SOURCES)
SOURCES = tuple(os.path.join(HERE, f) for f in ("tracelog.cpp", "graphwalk.cpp", "gputrace.cpp"))
TRACKER_SOURCES = SOURCES[:2]
# The events tracelog.cpp keeps, by its action code (the others change nothing the view holds).
ACTIONS = (
    "alloc",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
)
RECORD = struct.Struct("<QQQqQQiiii")  # tracelog.cpp's Record
BUILD_TIMEOUT_S = 300


class BuildError(Exception):
    """The tracker could not be built; the message is one line."""


class TraceLog:
    """The loaded tracker: turn it on and off, drain its events."""

    def __init__(self, lib: ctypes.CDLL, gpu_trace: GpuTrace | str, path: str = "") -> None:
        self.lib = lib
        self.path = path
        # the same library's GPU-trace interpreter (gputrace.cpp), or why it was built without
        self.gpu_trace = gpu_trace
        self._lock = threading.Lock()  # a drain's batch lives in the library until the next drain
        self._walk: GraphWalk | str | None = None

    def graph_walk(self) -> tuple[GraphWalk | None, str | None]:
        """The same library's walk of a graph being captured (graphwalk.cpp), bound on first
        use (it looks the driver's functions up then); or why not."""
        if self._walk is None:
            self._walk = graphwalk.bind(self.lib)
        if isinstance(self._walk, str):
            return None, self._walk
        return self._walk, None

    def enable(self, on: bool) -> None:
        """Start recording from an empty buffer, or stop (the buffer is emptied)."""
        self.lib.gs_tracelog_enable(1 if on else 0)

    def set_cap(self, records: int) -> None:
        """Past this many undrained events the tracker drops events and the drain says so."""
        self.lib.gs_tracelog_set_cap(records)

    def drain(self) -> tuple[dict[int, list[dict[str, Any]]], bool]:
        """The events since the last drain, per device, as snapshot trace entries; and whether
        some were dropped (the buffer was full)."""
        raw, tags, overflow = self.drain_raw()
        return entries_from_records(raw, tags), overflow

    def drain_raw(self) -> tuple[bytes, list[str], bool]:
        """The events since the last drain as packed records (RECORD) and the tags they name;
        and whether some were dropped."""
        with self._lock:
            n = self.lib.gs_tracelog_drain()
            overflow = bool(self.lib.gs_tracelog_overflowed())
            if n == 0:
                return b"", [], overflow
            raw = ctypes.string_at(self.lib.gs_tracelog_records(), n * RECORD.size)
            tags = [
                self.lib.gs_tracelog_tag(i).decode("utf-8", "replace")
                for i in range(self.lib.gs_tracelog_tag_count())
            ]
        return raw, tags, overflow

    def feed(
        self,
        action: str,
        addr: int,
        size: int,
        stream: int = 0,
        pool: tuple[int, int] = (0, 0),
        user_metadata: str = "",
        device: int = 0,
    ) -> None:
        """Hand the tracker one event as the allocator would (tests without a GPU)."""
        rc = self.lib.gs_tracelog_feed(
            action.encode(), device, addr, size, stream, pool[0], pool[1], user_metadata.encode()
        )
        if rc != 0:
            raise ValueError(f"unknown allocator action {action!r}")


def entries_from_records(
    raw: bytes, tags: Sequence[str], tagged_allocs_only: bool = False
) -> dict[int, list[dict[str, Any]]]:
    """Drained records as the entries of a snapshot's `device_traces` (action, addr, size,
    stream, time_us, user_metadata), plus the segment's pool as the allocator named it.
    `tagged_allocs_only`: only allocations made under user metadata or into a private pool (a
    view that is reseeded needs no more than a capture's carves; the autograd engine's worker
    thread allocates for a captured backward without the tag)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for addr, size, stream, time_us, pool_a, pool_b, action, device, tag, _ in RECORD.iter_unpack(
        raw
    ):
        if tagged_allocs_only and (action != 0 or (tag < 0 and pool_a == 0 and pool_b == 0)):
            continue
        entries = out.get(device)
        if entries is None:
            entries = out[device] = []
        entries.append(
            {
                "action": ACTIONS[action],
                "addr": addr,
                "size": size,
                "stream": stream,
                "time_us": time_us,
                "user_metadata": tags[tag] if tag >= 0 else "",
                "pool": (pool_a, pool_b),
            }
        )
    return out


# -- building ----------------------------------------------------------------------------------
def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphsan")


def library_name(source: bytes, torch_build: str) -> str:
    """The cached library's file name: the torch build (version, commit, C++ ABI) and the
    source, hashed; the version stays readable."""
    digest = hashlib.sha256(torch_build.encode() + b"\0" + source).hexdigest()[:16]
    version = re.sub(r"[^A-Za-z0-9.+-]", "_", torch_build.split(" ")[0])
    return f"tracelog-{version}-{digest}.so"


def find_compiler() -> str | None:
    """`$CXX`, else `c++` or `g++` on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return shutil.which("c++") or shutil.which("g++")


def cuda_include_dirs() -> list[str]:
    """Where cuda_runtime_api.h is: CUDA_HOME or CUDA_PATH, nvcc's toolkit, /usr/local/cuda,
    then the NVIDIA pip packages next to torch."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    found = [os.path.join(r, "include") for r in roots if r]
    for base in sys.path:
        nvidia = os.path.join(base or ".", "nvidia")
        if os.path.isdir(nvidia):
            found.append(os.path.join(nvidia, "cuda_runtime", "include"))
            found += sorted(
                os.path.dirname(p) for p in glob.glob(f"{nvidia}/*/include/cuda_runtime_api.h")
            )
    out: list[str] = []
    for d in found:
        if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")) and d not in out:
            out.append(d)
    return out[:1]


def build(
    target: str,
    cxx: str,
    include_dirs: Sequence[str],
    lib_dir: str,
    libs: Sequence[str],
    defines: Sequence[str] = (),
    sources: Sequence[str] = SOURCES,
) -> None:
    """Compile `sources` into `target`: into a temporary file next to it, renamed into place, so
    a process that loads `target` never sees half a file (two processes may build at once; the
    later rename wins with an equal file). Raises BuildError."""
    folder = os.path.dirname(target) or "."
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=".tmp", dir=folder)
        os.close(fd)
    except OSError as err:
        raise BuildError(f"cannot write to {folder}: {err.strerror or err}") from None
    cmd = [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", *(f"-D{d}" for d in defines)]
    cmd += [f"-I{d}" for d in include_dirs]
    cmd += [*sources, "-o", tmp, f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}"]
    cmd += [f"-l{lib}" for lib in libs] + ["-ldl"]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
        )
        if proc.returncode != 0:
            raise BuildError(f"{os.path.basename(cxx)} failed: {_first_error(proc.stderr)}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired:
        raise BuildError(f"{os.path.basename(cxx)} ran past {BUILD_TIMEOUT_S} s") from None
    except OSError as err:
        raise BuildError(f"{os.path.basename(cxx)}: {err.strerror or err}") from None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _first_error(stderr: str) -> str:
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    line = next((x for x in lines if "error" in x), lines[-1] if lines else "no message")
    return line[:300]


def load(path: str, without_trace: str | None = None) -> TraceLog:
    """Load a built tracker (`without_trace`: it was built without gputrace.cpp, for that
    reason); raises BuildError (one line) when it cannot be used."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        raise BuildError(f"cannot load {os.path.basename(path)}: {str(err)[:300]}") from None
    try:
        lib.gs_tracelog_record_size.restype = ctypes.c_int32
        lib.gs_tracelog_attach.restype = ctypes.c_int32
        lib.gs_tracelog_attach.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.gs_tracelog_enable.argtypes = [ctypes.c_int32]
        lib.gs_tracelog_enable.restype = None
        lib.gs_tracelog_set_cap.argtypes = [ctypes.c_uint64]
        lib.gs_tracelog_set_cap.restype = None
        lib.gs_tracelog_drain.restype = ctypes.c_int64
        lib.gs_tracelog_records.restype = ctypes.c_void_p
        lib.gs_tracelog_overflowed.restype = ctypes.c_int32
        lib.gs_tracelog_tag_count.restype = ctypes.c_int32
        lib.gs_tracelog_tag.restype = ctypes.c_char_p
        lib.gs_tracelog_tag.argtypes = [ctypes.c_int32]
        lib.gs_tracelog_feed.restype = ctypes.c_int32
        lib.gs_tracelog_feed.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int32,
            *[ctypes.c_uint64] * 5,
            ctypes.c_char_p,
        ]
        trace = (
            f"built without the GPU trace: {without_trace}"
            if without_trace is not None
            else gputrace.bind(lib, ctypes.PyDLL(path))
        )
    except (AttributeError, OSError) as err:
        raise BuildError(f"{os.path.basename(path)} lacks a symbol: {err}") from None
    if lib.gs_tracelog_record_size() != RECORD.size:
        raise BuildError(f"{os.path.basename(path)}: record layout differs from tracelog.py")
    return TraceLog(lib, trace, path)


def build_unattached(folder: str) -> TraceLog:
    """The library built against this torch into `folder`, linked to libc10 only and not
    attached (tests and benchmarks without a GPU); its `gpu_trace` says why where this Python
    cannot have it. Raises BuildError."""
    import torch
    from torch.utils.cpp_extension import include_paths

    cxx, cuda = find_compiler(), cuda_include_dirs()
    if cxx is None or not cuda:
        raise BuildError("needs a C++ compiler and CUDA headers (cuda_runtime_api.h)")
    includes = [*include_paths(), *cuda]
    if not os.path.isfile(os.path.join(includes[0], "c10/cuda/impl/cuda_cmake_macros.h")):
        # CPU wheels ship c10/cuda's headers without this generated one
        stub = os.path.join(folder, "stub", "c10", "cuda", "impl")
        os.makedirs(stub, exist_ok=True)
        with open(os.path.join(stub, "cuda_cmake_macros.h"), "w") as fh:
            fh.write("#pragma once\n")
        includes.append(os.path.join(folder, "stub"))
    target = os.path.join(folder, "tracelog-unattached.so")
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch.compiled_with_cxx11_abi())
    why = _without_trace()
    sources = SOURCES if why is None else TRACKER_SOURCES
    build(target, cxx, includes, lib_dir, ["c10"], [f"_GLIBCXX_USE_CXX11_ABI={abi}"], sources)
    return load(target, why)


# -- the process's log -------------------------------------------------------------------------
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
    setting = os.environ.get(ENV, "").strip()
    if setting == "0":
        raise BuildError(f"{ENV}=0")
    if setting not in ("", "1"):
        raise BuildError(f"{ENV}={setting!r}: expected 0 (off) or 1 (on, waiting for the build)")
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
    return obtain(key, lib_dir, abi, wait=wait), c10_cuda


def obtain(
    torch_build: str,
    lib_dir: str,
    abi: int,
    libs: Sequence[str] = ("c10_cuda", "c10"),
    wait: bool = True,
) -> TraceLog:
    """The tracker for this torch build, from the cache or built into it now, loaded (not
    attached); `wait=False` leaves a build to a background process (`start_background_build`)
    and raises BuildError(BUILDING). A failed build is remembered beside the library, so that
    later runs say why instead of compiling again. Raises BuildError."""
    source = b""
    for path in SOURCES:
        try:
            with open(path, "rb") as fh:
                source += fh.read()
        except OSError as err:
            raise BuildError(f"cannot read {path}: {err.strerror}") from None
    target = os.path.join(cache_dir(), library_name(source, torch_build))
    # the tracker and the walk alone where the GPU trace failed to build; the .why file says why
    partial = target[: -len(".so")] + "-notrace.so"
    if os.path.isfile(target):
        return load(target)
    if os.path.isfile(partial):
        return load(partial, _read_why(partial))
    cxx = find_compiler()
    if cxx is None:
        raise BuildError("no C++ compiler ($CXX, c++ or g++)")
    cuda = cuda_include_dirs()
    if not cuda:
        raise BuildError("no CUDA headers (cuda_runtime_api.h): set CUDA_HOME")
    if not wait:
        failed = _read_failed(target)
        if failed:
            raise BuildError(
                f"the compiled tracker's build failed: {failed} "
                "(python -m graphsan.cuda.tracelog tries again)"
            )
        start_background_build(target)
        raise BuildError(BUILDING)
    try:
        log = _build_and_load(target, partial, cxx, cuda, lib_dir, abi, libs)
    except BuildError as err:
        with contextlib.suppress(OSError), open(target + ".failed", "w") as fh:
            fh.write(str(err))
        raise
    with contextlib.suppress(OSError):
        os.unlink(target + ".failed")
    return log


def _build_and_load(
    target: str,
    partial: str,
    cxx: str,
    cuda: list[str],
    lib_dir: str,
    abi: int,
    libs: Sequence[str],
) -> TraceLog:
    from torch.utils.cpp_extension import include_paths

    includes, defines = [*include_paths(), *cuda], [f"_GLIBCXX_USE_CXX11_ABI={abi}"]
    why = _without_trace()
    if why is None:
        try:
            build(target, cxx, includes, lib_dir, libs, defines)
            return load(target)
        except BuildError as err:
            if "gputrace.cpp" not in str(err):
                raise  # a failure of the tracker's own, or of the machine (time, disk): no cache
            why = str(err)
    # the GPU trace leans on PyTorch's interpreter table: without it the tracker still works
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(partial), exist_ok=True)
        with open(partial + ".why", "w") as fh:  # before the library, which readers look for
            fh.write(why)
    build(partial, cxx, includes, lib_dir, libs, defines, TRACKER_SOURCES)
    return load(partial, why)


def start_background_build(target: str) -> None:
    """Build `target` in a process of its own (`python -m graphsan.cuda.tracelog`), detached, so
    that it finishes even when this run ends first; one build at a time per library, however
    many ranks start at once (a marker file, taken over once older than a build may run)."""
    marker = target + ".building"
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if time.time() - os.path.getmtime(marker) > BUILD_TIMEOUT_S + 60:
                os.unlink(marker)  # its builder died without cleaning up
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError:
        return  # another run is building it, or the cache cannot be written (the build would fail)
    package_root = os.path.dirname(os.path.dirname(HERE))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        _BACKGROUND.append(
            subprocess.Popen(
                [sys.executable, "-m", "graphsan.cuda.tracelog", "--marker", marker],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C for the run is not one for the build
            )
        )
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(marker)


_BACKGROUND: list[subprocess.Popen] = []


def _read_failed(target: str) -> str | None:
    try:
        with open(target + ".failed") as fh:
            return fh.read().strip() or "unknown"
    except OSError:
        return None


def _without_trace() -> str | None:
    """Why this interpreter cannot have the GPU trace, if it cannot."""
    if sys.version_info < (3, 11):
        return "the GPU trace reads frames with PyFrame_GetLasti (Python 3.11)"
    return None


def _read_why(path: str) -> str:
    try:
        with open(path + ".why") as fh:
            return fh.read().strip() or "unknown"
    except OSError:
        return "unknown"


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

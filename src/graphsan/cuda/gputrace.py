"""graphsan's own GPU-trace interpreter (gputrace.cpp, and gputable.cpp for PyTorch's
interpreter table), built into the tracker's library.

PyTorch reports every allocation and free of the CUDA caching allocator, outside the allocator's
lock, to whichever interpreter is registered for its GPU trace (`c10::impl::GPUTrace`). PyTorch's
own interpreter calls into Python for every one of them (and for every event record and
synchronization), listened to or not. This one filters in C++: Python hears only of the frees of
watched blocks and of the frees and allocations inside segments holding freed watched memory, and
allocation sites are read from the allocating thread's frames in C++ and kept there until a graph
references the block. `GpuTrace` drives it; `graphsan.cuda.allocator.AllocatorWatch` decides
whether to install it.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

Site = tuple  # (code, instruction offset, code, instruction offset, ...), innermost first
_KINDS = {"alloc": 0, "free": 1, "event_record": 2}


class GpuTrace:
    """The interpreter in a loaded library: install it, tell it what is watched, read sites."""

    def __init__(self, lib: ctypes.CDLL, pylib: ctypes.PyDLL) -> None:
        self.lib = lib
        self.pylib = pylib  # the same library, called with the GIL held (Python objects)
        self._sites: dict[int, Site] = {}  # site index + 1 -> (code, lasti, ...)
        # a site read and the clearing of every site never interleave (any thread may do either)
        self._sites_lock = threading.RLock()
        self.owner: object | None = None  # the one AllocatorWatch listening through it

    def install(self) -> str | None:
        """Become PyTorch's GPU-trace interpreter; None, or why not (one line)."""
        err = ctypes.create_string_buffer(256)
        if self.lib.gs_trace_install(err, len(err)) != 0:
            return err.value.decode("utf-8", "replace")
        return None

    def current(self) -> bool:
        """Whether this library still is the trace's interpreter."""
        return bool(self.lib.gs_trace_current())

    def uninstall(self) -> None:
        """Give the trace back as the install found it."""
        self.lib.gs_trace_uninstall()

    def callbacks(
        self, on_free: Callable[[int], None] | None, on_alloc: Callable[[int], None] | None
    ) -> None:
        """The callables (address) -> None for the frees and allocations to judge; None clears
        one."""

        def obj(fn: Any) -> ctypes.py_object:
            return ctypes.py_object(fn) if fn is not None else ctypes.py_object()

        self.pylib.gs_trace_callbacks(obj(on_free), obj(on_alloc))

    def enable(self, on: bool, sites: bool = False, depth: int = 24) -> None:
        """Start listening (tell it what is watched first), or stop: then nothing is watched
        and no block has a site."""
        self.lib.gs_trace_enable(1 if on else 0, 1 if sites else 0, depth)

    def clear_sites(self) -> None:
        """Forget every recorded site (with the trace stopped)."""
        with self._sites_lock:
            self.pylib.gs_trace_clear_sites()
            self._sites.clear()

    def watch(self, addresses: Sequence[int]) -> None:
        """Frees of these addresses call on_free (a superset of the watched blocks is fine)."""
        if addresses:
            arr = (ctypes.c_uint64 * len(addresses))(*addresses)
            self.lib.gs_trace_watch(arr, len(addresses))

    def unwatch(self, address: int) -> None:
        """Frees of `address` no longer call on_free (its free was judged)."""
        self.lib.gs_trace_unwatch(address)

    def freed_ranges(self, ranges: Sequence[tuple[int, int]]) -> None:
        """The (start, size) segments holding freed watched memory, sorted by start: frees and
        allocations in them call Python."""
        flat = [v for start, size in ranges for v in (start, size)]
        arr = (ctypes.c_uint64 * max(1, len(flat)))(*flat)
        self.lib.gs_trace_freed_ranges(arr, len(flat) // 2)  # the library reads 2 per range

    def watched_count(self) -> int:
        return int(self.lib.gs_trace_watched_count())

    def python_calls(self) -> int:
        """How often a free or an allocation called into Python since the library loaded."""
        return int(self.lib.gs_trace_python_calls())

    def site_of(self, address: int) -> Site | None:
        """The recorded allocation site of the live block at `address`, interned (one tuple per
        call path), or None."""
        with self._sites_lock:
            index = self.lib.gs_trace_site_of(address)
            if index == 0:
                return None
            site = self._sites.get(index)
            if site is None:
                # a tuple of the library's making, holding its own references to the code objects
                site = self.pylib.gs_trace_site_tuple(index - 1) or None
                if site is not None:
                    self._sites[index] = site
            return site

    # -- without a GPU (tests, benchmarks) ------------------------------------------------------
    def fire(self, kind: str, address: int) -> None:
        """Call the trace as the allocator does: kind is alloc, free or event_record."""
        if self.lib.gs_trace_fire(_KINDS[kind], address) != 0:
            raise RuntimeError("this library is not PyTorch's GPU-trace interpreter")

    def fire_temporaries(self, base: int, n: int) -> None:
        """`n` allocations from C++, each freed at once."""
        if self.lib.gs_trace_fire_temporaries(base, n) != 0:
            raise RuntimeError("this library is not PyTorch's GPU-trace interpreter")


def bind(lib: ctypes.CDLL, pylib: ctypes.PyDLL) -> GpuTrace:
    """The interpreter's functions in a loaded library; AttributeError where one is missing."""
    u64, i64, i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32
    pylib.gs_trace_callbacks.argtypes = [ctypes.py_object, ctypes.py_object]
    pylib.gs_trace_callbacks.restype = None
    pylib.gs_trace_clear_sites.restype = None
    pylib.gs_trace_site_tuple.argtypes = [ctypes.c_uint32]
    pylib.gs_trace_site_tuple.restype = ctypes.py_object
    signatures: dict[str, tuple[list, Any]] = {
        "gs_trace_install": ([ctypes.c_char_p, ctypes.c_size_t], i32),
        "gs_trace_current": ([], i32),
        "gs_trace_uninstall": ([], None),
        "gs_trace_enable": ([i32, i32, i32], None),
        "gs_trace_watch": ([ctypes.POINTER(u64), i64], None),
        "gs_trace_unwatch": ([u64], None),
        "gs_trace_freed_ranges": ([ctypes.POINTER(u64), i64], None),
        "gs_trace_watched_count": ([], i64),
        "gs_trace_python_calls": ([], u64),
        "gs_trace_site_of": ([u64], ctypes.c_uint32),
        "gs_trace_fire": ([i32, u64], i32),
        "gs_trace_fire_temporaries": ([u64, i64], i32),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    # frees while the interpreter shuts down must not call into Python
    atexit.register(lib.gs_trace_enable, 0, 0, 0)
    return GpuTrace(lib, pylib)

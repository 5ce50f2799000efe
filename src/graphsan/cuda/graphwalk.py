"""The walk of a graph being captured through the compiled library (graphwalk.cpp, built into
the tracker's library by tracebuild.py): the same records as `cuda.driver.walk`, without a Python
object per driver call. The driver walk through cuda-bindings stays the fallback.

The library hands one packed buffer per walk (its layout is described at the top of
graphwalk.cpp); here it becomes `KernelArgs` and `CopyArgs`, with kernel names and parameter
offsets looked up once per function by the caller's `describe` (`cuda.driver.function_info`'s
name and offsets in the capture analysis).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from collections.abc import Callable

from graphsan.core.records import AllocArgs, CopyArgs, KernelArgs, WalkStats

HEAD = struct.Struct("<IIQ")  # kind, payload bytes, function handle
SHAPE = struct.Struct("<IIII")  # a kernel record's grid x, y, z and block x, after its head
SIDE = struct.Struct("<IIQ")  # side (0 src, 1 dst), host, address
COUNT = struct.Struct("<II")
ADDRESS = struct.Struct("<Q")
# graphwalk.cpp's KIND_* codes
(
    KERNEL_FUNC,
    KERNEL_KERN,
    EXTRA_FUNC,
    EXTRA_KERN,
    NONE_FUNC,
    NONE_KERN,
    MEMCPY,
    MEMSET,
    MEM_ALLOC,
) = range(9)
RANGE = struct.Struct("<QQ")  # a memory node's address and bytes
SIDES = ("src", "dst")
STATS = ("nodes", "kernels", "copies", "unreadable", "child_graphs")  # gs_walk's stats order

# (handle, is a CUkernel) -> (demangled name, offset of each parameter)
Describe = Callable[[int, bool], tuple[str, tuple[int, ...]]]


class WalkError(RuntimeError):
    """The compiled walk could not read the graph (a driver call failed); one line."""


class GraphWalk:
    """The compiled walk in a loaded library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._lock = threading.Lock()  # the library's buffer lives until the next walk

    def walk(self, graph: int, describe: Describe) -> tuple[list[KernelArgs | CopyArgs], WalkStats]:
        """Every kernel, memcpy and memset node of the CUgraph `graph` (its handle as an int),
        child and conditional bodies included. Raises WalkError."""
        stats = (ctypes.c_int64 * len(STATS))()
        err = ctypes.create_string_buffer(256)
        with self._lock:
            n = self.lib.gs_walk(graph, stats, err, len(err))
            if n < 0:
                raise WalkError(err.value.decode("utf-8", "replace") or "the walk failed")
            raw = ctypes.string_at(self.lib.gs_walk_buffer(), n) if n else b""
        return parse(raw, describe), WalkStats(**dict(zip(STATS, stats, strict=True)))


def parse(raw: bytes, describe: Describe) -> list[KernelArgs | CopyArgs]:
    """The records of a walk's buffer, indexed in order."""
    out: list[KernelArgs | CopyArgs] = []
    pos, end = 0, len(raw)
    while pos < end:
        start = pos
        kind, size, handle = HEAD.unpack_from(raw, pos)
        pos += HEAD.size
        grid = (0, 0, 0)
        if kind <= NONE_KERN:  # a kernel record: the launch shape comes before the payload
            gx, gy, gz, _ = SHAPE.unpack_from(raw, pos)
            grid = (gx, gy, gz)
            pos += SHAPE.size
        payload = raw[pos : pos + size]
        pos += (size + 7) & ~7
        index = len(out)
        if kind <= NONE_KERN:
            if handle:
                name, offsets = describe(handle, kind & 1 == 1)
            else:
                name, offsets = "<unknown kernel>", ()
            if kind >= NONE_FUNC:
                out.append(KernelArgs(index, name, b"", [], grid))
            else:
                out.append(KernelArgs(index, name, payload, list(offsets), grid))
        elif kind == MEMCPY:
            count, _ = COUNT.unpack_from(payload, 0)
            addrs = []
            for i in range(count):
                side, _, address = SIDE.unpack_from(payload, COUNT.size + i * SIDE.size)
                addrs.append((SIDES[side], address))
            out.append(CopyArgs(index, "memcpy", addrs))
        elif kind == MEMSET:
            out.append(CopyArgs(index, "memset", [("dst", ADDRESS.unpack_from(payload)[0])]))
        elif kind == MEM_ALLOC:
            out.append(AllocArgs(index, *RANGE.unpack_from(payload)))
        else:
            raise WalkError(f"unknown node record {kind} at byte {start}")
    return out


def bind(lib: ctypes.CDLL) -> GraphWalk | str:
    """The walk in a loaded library, once the driver's functions were found; else why not."""
    try:
        lib.gs_walk_init.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.gs_walk_init.restype = ctypes.c_int32
        lib.gs_walk.argtypes = [
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.gs_walk.restype = ctypes.c_int64
        lib.gs_walk_buffer.restype = ctypes.c_void_p
        lib.gs_walk_set_driver.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32]
        lib.gs_walk_set_driver.restype = ctypes.c_int32
        lib.gs_walk_driver_slots.restype = ctypes.c_int32
    except AttributeError as err:
        return f"the library has no compiled walk ({err})"
    err = ctypes.create_string_buffer(256)
    if lib.gs_walk_init(err, len(err)) != 0:
        return err.value.decode("utf-8", "replace")
    return GraphWalk(lib)

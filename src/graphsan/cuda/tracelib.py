"""The compiled tracker's library as Python sees it (tracelog.cpp, with graphwalk.cpp,
gputrace.cpp and gputable.cpp in the same file): `load` binds its functions with ctypes and
checks that its records are the ones this module unpacks; `TraceLog` turns the tracker on and
off and drains it; `entries_from_records` gives the drained records the shape of a snapshot's
trace entries. Where the library comes from is `cuda.tracebuild`; the process's one attached
tracker is `cuda.tracelog`.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

from graphsan.cuda import gputrace, graphwalk
from graphsan.cuda.gputrace import GpuTrace
from graphsan.cuda.graphwalk import GraphWalk

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

    def release_pool(self, pool: tuple[int, int], c10_cuda: str) -> str | None:
        """Give private pool `pool`'s cached memory back to the driver (a pool nothing uses
        any more: the start-up probe's); None, or why not (one line)."""
        err = ctypes.create_string_buffer(256)
        if self.lib.gs_release_pool(c10_cuda.encode(), pool[0], pool[1], err, len(err)) != 0:
            return err.value.decode("utf-8", "replace")
        return None

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


def load(path: str, without_trace: str | None = None) -> TraceLog:
    """Load a built tracker (`without_trace`: it was built without the GPU trace's files,
    for that reason); raises BuildError (one line) when it cannot be used."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        raise BuildError(f"cannot load {os.path.basename(path)}: {str(err)[:300]}") from None
    try:
        lib.gs_tracelog_record_size.restype = ctypes.c_int32
        lib.gs_tracelog_attach.restype = ctypes.c_int32
        lib.gs_tracelog_attach.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        lib.gs_release_pool.restype = ctypes.c_int32
        lib.gs_release_pool.argtypes = [
            ctypes.c_char_p,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
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
        raise BuildError(f"{os.path.basename(path)}: record layout differs from tracelib.py")
    return TraceLog(lib, trace, path)

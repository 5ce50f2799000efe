"""The allocator view: one device's segments and blocks, seeded once from a snapshot and then
kept up to date from the allocator's trace entries (`segment_alloc`, `segment_free`,
`segment_map`, `segment_unmap`, `alloc`, `free_completed`), so an update costs the events since
the last one. It answers the questions of `core.memory_map.SegmentIndex`.

Trace entries carry no pool: the caller says which pool a new segment belongs to (the sanitizer
knows when a capture routes a stream's allocations to a graph pool). An expandable segment is
shown, like the snapshot shows it, as its runs of mapped pages. A segment's blocks are kept by
`core.viewsegment`.

Pure Python: nothing here touches CUDA.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from graphsan.core.memory_map import (
    KEEP_REQUESTED,
    Entry,
    PoolOf,
    SegmentIndex,
    _note_requested,
)
from graphsan.core.records import DEFAULT_POOL, DataPtr, Frame, PoolId
from graphsan.core.viewsegment import ViewBlock, ViewError, ViewSegment


class AllocatorView(SegmentIndex):
    """One device's allocator state, updated from trace entries."""

    def __init__(self, resolve: Callable[[DataPtr], list[Frame]] | None = None) -> None:
        self.resolve = resolve  # allocation stack of a live block's address
        self.segments: list[ViewSegment] = []  # address order
        self._starts = array("Q")  # the segments' addresses and ends, in the same order
        self._ends = array("Q")
        self.events = 0  # trace entries applied since the seed
        self.seeds = 0  # snapshots taken (the first one, and after any lost event)
        self.requested: dict[DataPtr, int] = {}  # see KEEP_REQUESTED
        self._blocks = 0  # allocated blocks, kept by seed and apply: a drain asks every time

    # -- building ----------------------------------------------------------------------------
    def seed(self, snapshot: dict[str, Any], device: int | None = None) -> None:
        """Replace the whole state by a snapshot's (`torch.cuda.memory._snapshot()` shape)."""
        segments: list[ViewSegment] = []
        self.requested = {}
        for seg in snapshot.get("segments", ()):
            if device is not None and seg.get("device", device) != device:
                continue
            _note_requested(seg, self.requested)
            pool = tuple(seg.get("segment_pool_id", DEFAULT_POOL))
            vs = ViewSegment(
                int(seg["address"]),
                int(seg["total_size"]),
                (int(pool[0]), int(pool[1])),
                bool(seg.get("is_expandable", False)),
                self.resolve,
            )
            vs.load(
                [
                    (int(b["address"]), int(b["size"]))
                    for b in seg.get("blocks", ())
                    if str(b["state"]).startswith("active")
                ]
            )
            segments.append(vs)
        segments.sort(key=lambda vs: vs.address)
        self.segments = segments
        self._starts = array("Q", [vs.address for vs in segments])
        self._ends = array("Q", [vs.address + vs.size for vs in segments])
        self._blocks = sum(len(vs) for vs in segments)
        self.seeds += 1

    def apply(self, entries: Iterable[Entry], pool_of: PoolOf) -> None:
        """Apply trace entries in order. Raises `ViewError` when one contradicts the view."""
        entries = entries if isinstance(entries, list) else list(entries)
        starts, ends, segments, requested = self._starts, self._ends, self.segments, self.requested
        find = bisect.bisect_right
        applied = 0
        try:
            for i, e in enumerate(entries):
                action = e["action"]
                if action == "alloc":
                    addr, size = int(e["addr"]), int(e["size"])
                    k = find(starts, addr) - 1
                    if k < 0 or addr >= ends[k]:
                        raise ViewError(
                            f"alloc of {size} B at {addr:#x} outside free segment space"
                        )
                    segments[k].carve(addr, size)
                    self._blocks += 1
                    if size <= KEEP_REQUESTED:
                        requested[addr] = size
                elif action == "free_completed":
                    addr = int(e["addr"])
                    k = find(starts, addr) - 1
                    if k < 0 or addr >= ends[k] or not segments[k].remove(addr):
                        raise ViewError(f"free of unknown block {addr:#x}")
                    self._blocks -= 1
                    requested.pop(addr, None)
                elif action == "free_requested":
                    continue  # as common as the two above; the block goes at free_completed
                elif action == "segment_alloc":
                    addr, size = int(e["addr"]), int(e["size"])
                    if self.segments_in(addr, addr + size):
                        raise ViewError(f"segment at {addr:#x} overlaps a known one")
                    pool = pool_of(e, _next_alloc(entries, i))
                    self._insert(ViewSegment(addr, size, pool, False, self.resolve))
                elif action == "segment_free":
                    addr = int(e["addr"])
                    seg = self.segment_at(addr)
                    if seg is None or seg.address != addr or len(seg):
                        raise ViewError(f"free of unknown or busy segment {addr:#x}")
                    self._remove(seg)
                elif action == "segment_map":
                    addr, size = int(e["addr"]), int(e["size"])
                    self._map(addr, size, pool_of(e, _next_alloc(entries, i)))
                elif action == "segment_unmap":
                    self._unmap(int(e["addr"]), int(e["size"]))
                else:
                    continue  # free_requested, snapshot, oom: no change to what is allocated
                applied += 1
        finally:
            self.events += applied

    # -- expandable segments -----------------------------------------------------------------
    def _map(self, addr: DataPtr, size: int, pool: PoolId) -> None:
        if self.segments_in(addr, addr + size):
            raise ViewError(f"mapped pages at {addr:#x} overlap a known segment")
        vs = ViewSegment(addr, size, pool, True, self.resolve)
        before = self.segment_at(addr - 1) if addr else None
        after = self.segment_at(addr + size)
        # neighbouring runs of mapped pages of the same reservation are one segment
        if before is not None and before.expandable and before.pool == pool:
            self._remove(before)
            vs = before.join(vs)
        if after is not None and after.expandable and after.pool == pool:
            self._remove(after)
            vs = vs.join(after)
        self._insert(vs)

    def _unmap(self, addr: DataPtr, size: int) -> None:
        end = addr + size
        seg = self.segment_at(addr)
        if seg is None or not seg.expandable or end > seg.end or seg.allocated_in(addr, end):
            raise ViewError(f"unmap of {size} B at {addr:#x} that is not free mapped memory")
        self._remove(seg)
        below, rest = seg.cut(addr)
        _, above = rest.cut(end)  # nothing is allocated in [addr, end)
        for part, lo, hi in ((below, seg.address, addr), (above, end, seg.end)):
            if hi > lo:
                part.address, part.size = lo, hi - lo
                self._insert(part)

    # -- the segment index -------------------------------------------------------------------
    def _insert(self, seg: ViewSegment) -> None:
        i = bisect.bisect_left(self._starts, seg.address)
        self._starts.insert(i, seg.address)
        self._ends.insert(i, seg.address + seg.size)
        self.segments.insert(i, seg)

    def _remove(self, seg: ViewSegment) -> None:
        i = bisect.bisect_left(self._starts, seg.address)
        del self._starts[i]
        del self._ends[i]
        del self.segments[i]

    def segment_at(self, addr: DataPtr) -> ViewSegment | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        return self.segments[i] if i >= 0 and addr < self._ends[i] else None

    def locate(self, addr: DataPtr) -> tuple[ViewSegment, ViewBlock] | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or addr >= self._ends[i]:
            return None
        seg = self.segments[i]
        return seg, seg.block_at(addr)

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        # a copy: an array that exports its buffer cannot grow, and the view keeps changing
        return np.array(self._starts, dtype=np.uint64), np.array(self._ends, dtype=np.uint64)

    def __len__(self) -> int:
        return self._blocks


def _next_alloc(entries: list[Entry], i: int) -> Entry | None:
    """The allocation a new segment was made for: the allocator records it right after."""
    for e in entries[i + 1 : i + 4]:
        if e["action"] == "alloc":
            return e
    return None

"""The allocator view: one device's segments and blocks, seeded once from a snapshot and then
kept up to date from the allocator's trace entries (`segment_alloc`, `segment_free`,
`segment_map`, `segment_unmap`, `alloc`, `free_completed`), so an update costs the events since
the last one. It answers the questions of `core.memory_map.SegmentIndex`.

Trace entries carry no pool: the caller says which pool a new segment belongs to (the sanitizer
knows when a capture routes a stream's allocations to a graph pool). An expandable segment is
shown, like the snapshot shows it, as its runs of mapped pages.

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


class ViewBlock:
    """An allocated block, or (from `block_at`) the free gap at an address."""

    __slots__ = ("address", "size", "allocated", "_frames", "_resolve")

    def __init__(
        self,
        address: DataPtr,
        size: int,
        allocated: bool = True,
        resolve: Callable[[DataPtr], list[Frame]] | None = None,
    ) -> None:
        self.address = address
        self.size = size
        self.allocated = allocated
        self._frames: list[Frame] | None = None
        self._resolve = resolve

    @property
    def state(self) -> str:
        return "active_allocated" if self.allocated else "inactive"

    @property
    def frames(self) -> list[Frame]:
        """The allocation stack, looked up only when someone asks (a block a graph references)."""
        if self._frames is None:
            self._frames = self._resolve(self.address) if self._resolve and self.allocated else []
        return self._frames

    def __repr__(self) -> str:
        return f"ViewBlock({self.address:#x}, {self.size}, {self.state})"


# A segment's allocated blocks are kept in chunks of at most this many (a chunk splits in two
# past it), so an insert moves a chunk's entries, not a whole expandable segment's.
CHUNK = 2048


class ViewSegment:
    """A segment (or a run of mapped pages of an expandable one) and its allocated blocks, kept
    as two arrays of 64-bit integers per chunk of blocks in address order (16 bytes a block: a
    rank holds tens of thousands, all of them in one segment when segments are expandable)."""

    __slots__ = ("address", "size", "pool", "expandable", "resolve", "_heads", "_cs", "_cz", "_n")

    def __init__(
        self,
        address: DataPtr,
        size: int,
        pool: PoolId,
        expandable: bool,
        resolve: Callable[[DataPtr], list[Frame]] | None = None,
    ) -> None:
        self.address = address
        self.size = size
        self.pool = pool
        self.expandable = expandable
        self.resolve = resolve
        self._heads: list[DataPtr] = []  # the first block address of each chunk
        self._cs: list[array] = []  # per chunk: block addresses
        self._cz: list[array] = []  # per chunk: block sizes
        self._n = 0

    @property
    def end(self) -> DataPtr:
        return self.address + self.size

    @property
    def blocks(self) -> list[ViewBlock]:
        """Allocated blocks in address order (free space is what lies between them)."""
        return [ViewBlock(a, n, True, self.resolve) for a, n in self.spans()]

    def spans(self) -> list[tuple[DataPtr, int]]:
        """(address, size) of the allocated blocks, in address order."""
        out: list[tuple[DataPtr, int]] = []
        for starts, sizes in zip(self._cs, self._cz, strict=True):
            out += zip(starts, sizes, strict=True)
        return out

    def _find(self, addr: DataPtr) -> tuple[int, int]:
        """(chunk, index) of the last block starting at or before `addr`; (-1, -1) if none."""
        c = bisect.bisect_right(self._heads, addr) - 1
        if c < 0:
            return -1, -1
        return c, bisect.bisect_right(self._cs[c], addr) - 1

    def _next_start(self, c: int, j: int) -> DataPtr | None:
        """The address of the block after (chunk, index) (-1, -1: the first block), if any."""
        if c >= 0 and j + 1 < len(self._cs[c]):
            return self._cs[c][j + 1]
        if c + 1 < len(self._cs):
            return self._heads[c + 1]
        return None

    def add(self, address: DataPtr, size: int) -> None:
        c, j = self._find(address)
        self._insert_at(max(c, 0), j + 1, address, size)

    def _insert_at(self, c: int, j: int, address: DataPtr, size: int) -> None:
        """Insert a block as entry `j` of chunk `c` (its address order place)."""
        if not self._cs:
            self._heads.append(address)
            self._cs.append(array("Q", (address,)))
            self._cz.append(array("Q", (size,)))
            self._n = 1
            return
        starts, sizes = self._cs[c], self._cz[c]
        starts.insert(j, address)
        sizes.insert(j, size)
        self._n += 1
        if j == 0:
            self._heads[c] = address
        if len(starts) > CHUNK:
            half = len(starts) // 2
            self._cs.insert(c + 1, starts[half:])
            self._cz.insert(c + 1, sizes[half:])
            self._heads.insert(c + 1, starts[half])
            del starts[half:]
            del sizes[half:]

    def remove(self, address: DataPtr) -> bool:
        c = bisect.bisect_right(self._heads, address) - 1
        if c < 0:
            return False
        starts, sizes = self._cs[c], self._cz[c]
        j = bisect.bisect_right(starts, address) - 1
        if starts[j] != address:
            return False
        del starts[j]
        del sizes[j]
        self._n -= 1
        if not starts:
            del self._cs[c], self._cz[c], self._heads[c]
        elif j == 0:
            self._heads[c] = starts[0]
        return True

    def carve(self, address: DataPtr, requested: int) -> None:
        """An allocation of `requested` bytes at `address` (a log entry): the block the allocator
        carved there out of the free space (see `block_size`). Raises `ViewError` when the
        address is not free space of the segment or the request does not fit there."""
        heads, hi = self._heads, self.address + self.size
        c = bisect.bisect_right(heads, address) - 1
        if c >= 0:
            starts = self._cs[c]
            j = bisect.bisect_right(starts, address) - 1
            if address < starts[j] + self._cz[c][j]:
                hi = address  # inside an allocated block
            elif j + 1 < len(starts):
                hi = starts[j + 1]
            elif c + 1 < len(heads):
                hi = heads[c + 1]
        else:
            j = -1
            if heads:
                hi = heads[0]
        if not self.address <= address < hi or address + requested > hi:
            raise ViewError(f"alloc of {requested} B at {address:#x} outside free segment space")
        size = block_size(requested, hi - address, self.expandable)
        self._insert_at(c if c > 0 else 0, j + 1, address, size)

    def allocated_in(self, start: DataPtr, end: DataPtr) -> ViewBlock | None:
        """The first allocated block overlapping [start, end), if any."""
        c, j = self._find(start)
        if c >= 0:
            if self._cs[c][j] >= end:
                return None
            if self._cs[c][j] + self._cz[c][j] > start:
                return ViewBlock(self._cs[c][j], self._cz[c][j], True, self.resolve)
        nxt = self._next_start(c, j)
        if nxt is not None and nxt < end:
            c, j = (c, j + 1) if c >= 0 and j + 1 < len(self._cs[c]) else (c + 1, 0)
            return ViewBlock(nxt, self._cz[c][j], True, self.resolve)
        return None

    def block_at(self, addr: DataPtr) -> ViewBlock | None:
        """The allocated block holding `addr`, else the free gap around it (as the allocator,
        which merges neighbouring free blocks, would show it); None outside the segment."""
        end = self.address + self.size
        if not self.address <= addr < end:
            return None
        heads = self._heads
        c = bisect.bisect_right(heads, addr) - 1
        if c < 0:
            return ViewBlock(self.address, (heads[0] if heads else end) - self.address, False)
        starts = self._cs[c]
        j = bisect.bisect_right(starts, addr) - 1
        lo = starts[j] + self._cz[c][j]
        if addr < lo:
            return ViewBlock(starts[j], self._cz[c][j], True, self.resolve)
        if j + 1 < len(starts):
            end = starts[j + 1]
        elif c + 1 < len(heads):
            end = heads[c + 1]
        return ViewBlock(lo, end - lo, False)

    def load(self, spans: list[tuple[DataPtr, int]]) -> None:
        """Replace the blocks by `spans` ((address, size), non-overlapping)."""
        spans = sorted(spans)
        self._heads, self._cs, self._cz = [], [], []
        for k in range(0, len(spans), CHUNK // 2 or 1):
            part = spans[k : k + (CHUNK // 2 or 1)]
            self._heads.append(part[0][0])
            self._cs.append(array("Q", [a for a, _ in part]))
            self._cz.append(array("Q", [n for _, n in part]))
        self._n = len(spans)

    def cut(self, at: DataPtr) -> tuple[ViewSegment, ViewSegment]:
        """Two segments (extents and pool as this one's) holding this one's blocks that start
        before `at` and from `at` on; whole chunks move over, so this one is left empty."""
        lo = ViewSegment(self.address, self.size, self.pool, self.expandable, self.resolve)
        hi = ViewSegment(self.address, self.size, self.pool, self.expandable, self.resolve)
        c = bisect.bisect_right(self._heads, at) - 1
        if c >= 0:
            starts, sizes = self._cs[c], self._cz[c]
            k = bisect.bisect_left(starts, at)
            lo._adopt(self._cs[:c] + [starts[:k]], self._cz[:c] + [sizes[:k]])
            hi._adopt([starts[k:]] + self._cs[c + 1 :], [sizes[k:]] + self._cz[c + 1 :])
        else:
            hi._adopt(self._cs, self._cz)
        self._heads, self._cs, self._cz, self._n = [], [], [], 0
        return lo, hi

    def _adopt(self, cs: list[array], cz: list[array]) -> None:
        """Take these chunks (address order) as the blocks; empty ones are dropped."""
        keep = [i for i, starts in enumerate(cs) if starts]
        self._cs, self._cz = [cs[i] for i in keep], [cz[i] for i in keep]
        self._heads = [starts[0] for starts in self._cs]
        self._n = sum(len(starts) for starts in self._cs)

    def __len__(self) -> int:
        return self._n


# The caching allocator's sizes: blocks are multiples of MIN_BLOCK; requests up to SMALL_SIZE
# come from the small pool
MIN_BLOCK = 512
SMALL_SIZE = 1 << 20


def block_size(requested: int, free: int, expandable: bool) -> int:
    """The size of the block the allocator carves for `requested` bytes out of a free block of
    `free` bytes: the request rounded up to 512 B, or the whole free block when the remainder is
    too small to split off (under 512 B; in the large pool of fixed segments, up to 1 MiB). The
    event log records only the requested size. (A `roundup_power2_divisions` setting rounds
    otherwise; the view then holds smaller blocks than the allocator.)"""
    rounded = max(MIN_BLOCK, -(-requested // MIN_BLOCK) * MIN_BLOCK)
    remaining = free - rounded
    if requested <= SMALL_SIZE or expandable:
        return rounded if remaining >= MIN_BLOCK else free
    return rounded if remaining > SMALL_SIZE else free


class ViewError(RuntimeError):
    """The event log does not fit the view (events were lost): the view must be reseeded."""


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
            vs = self._joined(before, vs)
        if after is not None and after.expandable and after.pool == pool:
            self._remove(after)
            vs = self._joined(vs, after)
        self._insert(vs)

    def _joined(self, a: ViewSegment, b: ViewSegment) -> ViewSegment:
        """One segment of `a` and `b`, which follows it; their blocks move over, chunk by chunk."""
        out = ViewSegment(a.address, b.end - a.address, a.pool, True, self.resolve)
        out._adopt(a._cs + b._cs, a._cz + b._cz)
        for old in (a, b):
            old._heads, old._cs, old._cz, old._n = [], [], [], 0
        return out

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

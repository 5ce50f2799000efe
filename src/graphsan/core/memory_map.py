"""The caching allocator's segments and blocks, as the analysis asks about them.

Three sources answer the same questions (`locate`, `segment_at`, `segments_in`, `covers`,
`bounds`), through the shared `SegmentIndex`:
- `MemoryMap`, built from one allocator snapshot (`torch.cuda.memory._snapshot()`-shaped dicts);
  its cost grows with the blocks alive, so it serves tests and checks;
- `core.allocview.AllocatorView`, the allocator view kept up to date from the allocator's trace
  entries (tests hold it equal to a `MemoryMap` of the same state);
- `AskedMap`, built from the driver's answers, for allocators that keep no block map.

Pure Python: nothing here touches CUDA.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphsan.core.records import DEFAULT_POOL, DataPtr, Frame, PoolId

Entry = dict[str, Any]  # one trace entry: action, addr, size, stream, user_metadata, ...
# which pool a new segment belongs to, from its trace entry and the allocation that follows it
# (the block the segment was made for), if any
PoolOf = Callable[[Entry, Entry | None], PoolId]


@dataclass
class Block:
    """One block of the caching allocator, as a snapshot shows it."""

    address: DataPtr
    size: int
    state: str  # "active_allocated" | "active_pending_free" | "inactive"
    frames: list[Frame] = field(default_factory=list)

    @property
    def allocated(self) -> bool:
        return self.state.startswith("active")


@dataclass
class Segment:
    """One segment (a cudaMalloc or an expandable reservation) with its blocks in address order."""

    address: DataPtr
    size: int
    pool: PoolId
    expandable: bool
    blocks: list[Block]

    def allocated_in(self, start: DataPtr, end: DataPtr) -> Block | None:
        """The first allocated block overlapping [start, end), if any."""
        for b in self.blocks:
            if b.address < end and start < b.address + b.size and b.allocated:
                return b
        return None

    def block_at(self, addr: DataPtr) -> Block | None:
        starts = [b.address for b in self.blocks]
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < self.blocks[i].address + self.blocks[i].size:
            return self.blocks[i]
        return None


def _frames(raw: Iterable[dict[str, Any]] | None) -> list[Frame]:
    """Allocator frames (innermost first) -> our frames (outermost first, like tracebacks)."""
    out = [(f.get("filename", "?"), int(f.get("line", 0)), f.get("name", "?")) for f in raw or ()]
    out.reverse()
    return out


class SegmentIndex:
    """Address questions over segments kept sorted by address (`segments`, `_starts`); shared by
    the snapshot's `MemoryMap` and the incremental `AllocatorView`."""

    segments: list
    _starts: list[DataPtr]

    def segment_at(self, addr: DataPtr):
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.segments[i].address + self.segments[i].size:
            return self.segments[i]
        return None

    def segments_in(self, start: DataPtr, end: DataPtr) -> list:
        """The segments overlapping [start, end), in address order."""
        out = []
        segments = self.segments
        for i in range(max(bisect.bisect_right(self._starts, start) - 1, 0), len(segments)):
            seg = segments[i]
            if seg.address >= end:
                break
            if seg.address + seg.size > start:
                out.append(seg)
        return out

    def covers(self, start: DataPtr, end: DataPtr) -> bool:
        """Whether segments cover all of [start, end). An expandable segment shows only its
        mapped ranges, so a block whose pages were partly unmapped is not covered."""
        pos = start
        while pos < end:
            seg = self.segment_at(pos)
            if seg is None:
                return False
            pos = seg.address + seg.size
        return True

    def bounds(self) -> tuple[int, int]:
        if not self.segments:
            return (0, 0)
        last = self.segments[-1]
        return (self.segments[0].address, last.address + last.size)

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Starts and ends (uint64, sorted, disjoint) of the ranges where `locate` answers."""
        raise NotImplementedError

    def contains(self, addrs: np.ndarray) -> np.ndarray:
        """`locate(a) is not None` for each address of a uint64 array, in one pass."""
        starts, ends = self.extents()
        if not len(starts):
            return np.zeros(len(addrs), dtype=bool)
        i = np.searchsorted(starts, addrs, side="right") - 1
        return (i >= 0) & (addrs < ends[np.maximum(i, 0)])


class MemoryMap(SegmentIndex):
    """Address lookup over the segments of an allocator snapshot."""

    def __init__(self, segments: list[Segment], requested: dict[DataPtr, int] | None = None):
        self.segments = sorted(segments, key=lambda s: s.address)
        self._starts = [s.address for s in self.segments]
        self.requested = requested if requested is not None else {}  # see KEEP_REQUESTED
        self._extents: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def from_snapshot(
        cls,
        snapshot: dict[str, Any],
        device: int | None = None,
        frame_filter: Callable[[list[Frame]], list[Frame]] | None = None,
    ) -> MemoryMap:
        """`frame_filter` trims allocation stacks (e.g. to the user's own frames)."""
        segments, requested = [], {}
        for seg in snapshot.get("segments", ()):
            if device is not None and seg.get("device", device) != device:
                continue
            _note_requested(seg, requested)
            addr = int(seg["address"])
            blocks, cursor = [], addr
            for b in seg.get("blocks", ()):
                baddr = int(b.get("address", cursor))
                frames = _frames(b.get("frames"))
                if frame_filter is not None and frames:
                    frames = frame_filter(frames)
                blocks.append(Block(baddr, int(b["size"]), b["state"], frames))
                cursor = baddr + int(b["size"])
            pool = tuple(seg.get("segment_pool_id", DEFAULT_POOL))
            segments.append(
                Segment(
                    addr,
                    int(seg["total_size"]),
                    (int(pool[0]), int(pool[1])),
                    bool(seg.get("is_expandable", False)),
                    blocks,
                )
            )
        return cls(segments, requested)

    def locate(self, addr: DataPtr) -> tuple[Segment, Block] | None:
        seg = self.segment_at(addr)
        if seg is None:
            return None
        blk = seg.block_at(addr)
        return (seg, blk) if blk is not None else None

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        # where locate answers: each block, cut to its segment; a range belongs to the last
        # segment (block) starting before it, as the bisections in `locate` decide
        if self._extents is None:
            lo, hi = [], []
            segs = self.segments
            for i, seg in enumerate(segs):
                seg_end = seg.address + seg.size
                if i + 1 < len(segs):
                    seg_end = min(seg_end, segs[i + 1].address)
                blocks = seg.blocks
                for j, b in enumerate(blocks):
                    start = max(b.address, seg.address)
                    end = min(b.address + b.size, seg_end)
                    if j + 1 < len(blocks):
                        end = min(end, blocks[j + 1].address)
                    if start < end:
                        lo.append(start)
                        hi.append(end)
            self._extents = (np.array(lo, dtype=np.uint64), np.array(hi, dtype=np.uint64))
        return self._extents


# Requested sizes are kept for live blocks up to this many bytes: the largest block read as a
# pointer table (core.scan.TABLE_BLOCK), read up to its tensor's end, not into the stale rest
KEEP_REQUESTED = 4 << 10


def _note_requested(seg: dict[str, Any], requested: dict[DataPtr, int]) -> None:
    """The requested sizes of a snapshot segment's small live blocks (KEEP_REQUESTED)."""
    for b in seg.get("blocks", ()):
        size = int(b.get("requested_size", b["size"]))
        if size <= KEEP_REQUESTED and str(b["state"]).startswith("active") and "address" in b:
            requested[int(b["address"])] = size


def layout(memmap: SegmentIndex) -> list[tuple]:
    """What the allocator holds, in a form two views can be compared by: each segment's
    extent, pool and kind, and its allocated blocks. (Free space is what lies between.)"""
    return [
        (
            seg.address,
            seg.size,
            tuple(seg.pool),
            bool(seg.expandable),
            tuple((b.address, b.size) for b in seg.blocks if b.allocated),
        )
        for seg in memmap.segments
    ]


# the range of addresses a device allocation can have on x86-64 and aarch64
DEVICE_LO, DEVICE_HI = 1 << 32, 1 << 49
RangeOf = Callable[[DataPtr], tuple[DataPtr, int] | None]  # address -> its allocation


class AskedMap(MemoryMap):
    """A map built from answers to `range_of(address)` (the driver's allocation holding an
    address), for allocators that keep no block map: one segment and one allocated block per
    allocation named, asked once per address. `own` ranges are memory the graph being analysed
    allocates itself (its memory nodes): free blocks of `own_pool`, its temporaries.

    With `freed` (judging), a watched address the driver no longer knows is a free block of
    the size it had, rather than no memory at all: the allocator's pool keeps what it freed."""

    def __init__(
        self,
        range_of: RangeOf,
        own: Iterable[tuple[DataPtr, int]] = (),
        own_pool: PoolId | None = None,
        freed: dict[DataPtr, int] | None = None,
    ) -> None:
        segments = [
            Segment(a, n, own_pool or DEFAULT_POOL, False, [Block(a, n, "inactive")])
            for a, n in own
            if n > 0
        ]
        super().__init__(segments)
        self.range_of = range_of
        self.freed = dict(freed or {})
        self._asked: dict[DataPtr, tuple[Segment, Block] | None] = {}

    def bounds(self) -> tuple[int, int]:
        return (DEVICE_LO, DEVICE_HI)

    def _ask(self, addr: DataPtr) -> tuple[Segment, Block] | None:
        if addr in self._asked:
            return self._asked[addr]
        seg = SegmentIndex.segment_at(self, addr)  # the segments asked about so far
        blk = seg.block_at(addr) if seg is not None else None
        hit = (seg, blk) if blk is not None else None
        if hit is None:
            answer = self.range_of(addr)
            if answer is None and addr in self.freed:
                answer = (addr, self.freed[addr])
                state = "inactive"
            else:
                state = "active_allocated"
            if answer is not None:
                base, size = answer
                blk = Block(base, size, state)
                seg = Segment(base, size, DEFAULT_POOL, False, [blk])
                i = bisect.bisect_left(self._starts, base)
                if not (i < len(self._starts) and self._starts[i] == base):
                    self.segments.insert(i, seg)
                    self._starts.insert(i, base)
                    self._extents = None
                hit = (seg, blk)
        self._asked[addr] = hit
        return hit

    def locate(self, addr: DataPtr) -> tuple[Segment, Block] | None:
        return self._ask(addr)

    def contains(self, addrs: np.ndarray) -> np.ndarray:
        answers = {int(a): self._ask(int(a)) is not None for a in np.unique(addrs).tolist()}
        return np.array([answers[int(a)] for a in addrs.tolist()], dtype=bool)

    def segment_at(self, addr: DataPtr):
        hit = self._ask(addr)
        return hit[0] if hit is not None else None

    def segments_in(self, start: DataPtr, end: DataPtr) -> list:
        self._ask(start)
        return super().segments_in(start, end)

    def covers(self, start: DataPtr, end: DataPtr) -> bool:
        pos = start
        while pos < end:
            hit = self._ask(pos)
            if hit is None:
                return False
            pos = hit[0].address + hit[0].size
        return True


# Expandable segments map and unmap whole pages: 2 MiB in the small pool, 20 MiB in the large
# one. Asking the driver every 2 MiB sees every page of either.
PAGE = 2 << 20


def all_pages_mapped(
    address: DataPtr, size: int, segs: list[Segment], is_mapped: Callable[[DataPtr], bool]
) -> bool:
    """Every page of [address, address + size) that lies in an expandable segment is mapped: a
    block can straddle pages, and empty_cache unmaps a page as soon as no live block is left on
    it, so the first address is not enough. (The driver question only makes sense for
    expandable segments: cudaMalloc'd memory has no allocation handle to retain.)"""
    end = address + size
    for page in range(address - address % PAGE, end, PAGE):
        addr = max(page, address)
        seg = next((s for s in segs if s.address <= addr < s.address + s.size), None)
        if seg is not None and seg.expandable and not is_mapped(addr):
            return False
    return True

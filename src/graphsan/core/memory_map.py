"""The caching allocator's segments and blocks, as the analysis asks about them.

Two sources answer the same questions (`locate`, `segment_at`, `segments_in`, `covers`,
`bounds`), through the shared `SegmentIndex`:
- `MemoryMap`, built from one allocator snapshot (`torch.cuda.memory._snapshot()`-shaped dicts);
  its cost grows with the blocks alive, so it serves tests and checks;
- `AllocatorView`, the allocator view: seeded once from a snapshot, then kept up to date from the
  allocator's trace entries (`segment_alloc`, `segment_free`, `segment_map`, `segment_unmap`,
  `alloc`, `free_completed`), so an update costs the events since the last one. Tests hold the
  two equal.

Trace entries carry no pool: the caller says which pool a new segment belongs to (the sanitizer
knows when a capture routes a stream's allocations to a graph pool). An expandable segment is
shown, like the snapshot shows it, as its runs of mapped pages.

Pure Python: nothing here touches CUDA.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

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
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        out = []
        for seg in self.segments[i:]:
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


class MemoryMap(SegmentIndex):
    """Address lookup over the segments of an allocator snapshot."""

    def __init__(self, segments: list[Segment], requested: dict[DataPtr, int] | None = None):
        self.segments = sorted(segments, key=lambda s: s.address)
        self._starts = [s.address for s in self.segments]
        self.requested = requested if requested is not None else {}  # see KEEP_REQUESTED

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


class ViewSegment:
    """A segment (or a run of mapped pages of an expandable one) and its allocated blocks, kept
    as two arrays of 64-bit integers (16 bytes a block: a rank holds tens of thousands)."""

    __slots__ = ("address", "size", "pool", "expandable", "resolve", "_starts", "_sizes")

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
        self._starts = array("Q")
        self._sizes = array("Q")

    @property
    def end(self) -> DataPtr:
        return self.address + self.size

    @property
    def blocks(self) -> list[ViewBlock]:
        """Allocated blocks in address order (free space is what lies between them)."""
        return [self._block(i) for i in range(len(self._starts))]

    def spans(self) -> list[tuple[DataPtr, int]]:
        """(address, size) of the allocated blocks, in address order."""
        return list(zip(self._starts, self._sizes, strict=True))

    def _block(self, i: int) -> ViewBlock:
        return ViewBlock(self._starts[i], self._sizes[i], True, self.resolve)

    def add(self, address: DataPtr, size: int) -> None:
        i = bisect.bisect_left(self._starts, address)
        self._starts.insert(i, address)
        self._sizes.insert(i, size)

    def remove(self, address: DataPtr) -> bool:
        i = bisect.bisect_left(self._starts, address)
        if i < len(self._starts) and self._starts[i] == address:
            del self._starts[i]
            del self._sizes[i]
            return True
        return False

    def allocated_in(self, start: DataPtr, end: DataPtr) -> ViewBlock | None:
        """The first allocated block overlapping [start, end), if any."""
        starts, sizes = self._starts, self._sizes
        for i in range(max(bisect.bisect_right(starts, start) - 1, 0), len(starts)):
            if starts[i] >= end:
                break
            if starts[i] + sizes[i] > start:
                return self._block(i)
        return None

    def block_at(self, addr: DataPtr) -> ViewBlock | None:
        """The allocated block holding `addr`, else the free gap around it (as the allocator,
        which merges neighbouring free blocks, would show it); None outside the segment."""
        if not self.address <= addr < self.end:
            return None
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < starts[i] + sizes[i]:
            return self._block(i)
        lo = starts[i] + sizes[i] if i >= 0 else self.address
        hi = starts[i + 1] if i + 1 < len(starts) else self.end
        return ViewBlock(lo, hi - lo, allocated=False)

    def __len__(self) -> int:
        return len(self._starts)


# The caching allocator's sizes: blocks are multiples of MIN_BLOCK; requests up to SMALL_SIZE
# come from the small pool
MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
# Requested sizes are kept for live blocks up to this many bytes: the largest block read as a
# pointer table (core.scan.TABLE_BLOCK), read up to its tensor's end, not into the stale rest
KEEP_REQUESTED = 4 << 10


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
        self._starts: list[DataPtr] = []
        self.events = 0  # trace entries applied since the seed
        self.seeds = 0  # snapshots taken (the first one, and after any lost event)
        self.requested: dict[DataPtr, int] = {}  # see KEEP_REQUESTED

    # -- building ----------------------------------------------------------------------------
    def seed(self, snapshot: dict[str, Any], device: int | None = None) -> None:
        """Replace the whole state by a snapshot's (`torch.cuda.memory._snapshot()` shape)."""
        self.segments, self._starts, self.requested = [], [], {}
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
            for b in seg.get("blocks", ()):
                if str(b["state"]).startswith("active"):
                    vs.add(int(b["address"]), int(b["size"]))
            self._insert(vs)
        self.seeds += 1

    def apply(self, entries: Iterable[Entry], pool_of: PoolOf) -> None:
        """Apply trace entries in order. Raises `ViewError` when one contradicts the view."""
        entries = list(entries)
        for i, e in enumerate(entries):
            action = e["action"]
            addr, size = int(e["addr"]), int(e["size"])
            if action == "alloc":
                seg = self.segment_at(addr)
                gap = seg.block_at(addr) if seg is not None else None
                if gap is None or gap.allocated or addr + size > gap.address + gap.size:
                    raise ViewError(f"alloc of {size} B at {addr:#x} outside free segment space")
                free = gap.address + gap.size - addr
                block = block_size(size, free, seg.expandable)
                seg.add(addr, block)
                if size <= KEEP_REQUESTED:
                    self.requested[addr] = size
            elif action == "free_completed":
                seg = self.segment_at(addr)
                if seg is None or not seg.remove(addr):
                    raise ViewError(f"free of unknown block {addr:#x}")
                self.requested.pop(addr, None)
            elif action == "segment_alloc":
                if self.segments_in(addr, addr + size):
                    raise ViewError(f"segment at {addr:#x} overlaps a known one")
                pool = pool_of(e, _next_alloc(entries, i))
                self._insert(ViewSegment(addr, size, pool, False, self.resolve))
            elif action == "segment_free":
                seg = self.segment_at(addr)
                if seg is None or seg.address != addr or len(seg):
                    raise ViewError(f"free of unknown or busy segment {addr:#x}")
                self._remove(seg)
            elif action == "segment_map":
                self._map(addr, size, pool_of(e, _next_alloc(entries, i)))
            elif action == "segment_unmap":
                self._unmap(addr, size)
            else:
                continue  # free_requested, snapshot, oom: no change to what is allocated
            self.events += 1

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
        out = ViewSegment(a.address, b.end - a.address, a.pool, True, self.resolve)
        for address, size in a.spans() + b.spans():
            out.add(address, size)
        return out

    def _unmap(self, addr: DataPtr, size: int) -> None:
        end = addr + size
        seg = self.segment_at(addr)
        if seg is None or not seg.expandable or end > seg.end or seg.allocated_in(addr, end):
            raise ViewError(f"unmap of {size} B at {addr:#x} that is not free mapped memory")
        self._remove(seg)
        for lo, hi in ((seg.address, addr), (end, seg.end)):
            if hi > lo:
                part = ViewSegment(lo, hi - lo, seg.pool, True, self.resolve)
                for address, size in seg.spans():
                    if lo <= address < hi:
                        part.add(address, size)
                self._insert(part)

    # -- the segment index -------------------------------------------------------------------
    def _insert(self, seg: ViewSegment) -> None:
        i = bisect.bisect_left(self._starts, seg.address)
        self._starts.insert(i, seg.address)
        self.segments.insert(i, seg)

    def _remove(self, seg: ViewSegment) -> None:
        i = bisect.bisect_left(self._starts, seg.address)
        del self._starts[i]
        del self.segments[i]

    def locate(self, addr: DataPtr) -> tuple[ViewSegment, ViewBlock] | None:
        seg = self.segment_at(addr)
        if seg is None:
            return None
        return seg, seg.block_at(addr)

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)


def _note_requested(seg: dict[str, Any], requested: dict[DataPtr, int]) -> None:
    """The requested sizes of a snapshot segment's small live blocks (KEEP_REQUESTED)."""
    for b in seg.get("blocks", ()):
        size = int(b.get("requested_size", b["size"]))
        if size <= KEEP_REQUESTED and str(b["state"]).startswith("active") and "address" in b:
            requested[int(b["address"])] = size


def _next_alloc(entries: list[Entry], i: int) -> Entry | None:
    """The allocation a new segment was made for: the allocator records it right after."""
    for e in entries[i + 1 : i + 4]:
        if e["action"] == "alloc":
            return e
    return None


def layout(memmap: MemoryMap | AllocatorView) -> list[tuple]:
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

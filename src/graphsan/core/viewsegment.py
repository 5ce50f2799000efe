"""The allocator view's segments: each one's allocated blocks, kept in chunked arrays of 64-bit
integers so that a segment of tens of thousands of blocks stays cheap to change
(`ViewSegment`), the block or free gap an address falls in (`ViewBlock`), and the caching
allocator's block rounding, which the view rebuilds because the event log records only the
requested size (`block_size`).

Pure Python: nothing here touches CUDA.
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable

from graphsan.core.records import DataPtr, Frame, PoolId


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

    def join(self, after: ViewSegment) -> ViewSegment:
        """One segment of this one and `after`, which follows it (pool and kind as this one's);
        whole chunks move over, so both are left empty."""
        size = after.end - self.address
        out = ViewSegment(self.address, size, self.pool, self.expandable, self.resolve)
        out._adopt(self._cs + after._cs, self._cz + after._cz)
        for old in (self, after):
            old._heads, old._cs, old._cz, old._n = [], [], [], 0
        return out

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

"""Where the captures of one pool carved memory (pure: no CUDA, no torch): the latest carve of
each address, every range ever carved and by whom, and each graph's own carves. The pool's
replay order (`core.pool_order`) and its judgement of the caller's outputs (`core.outputs`)
both read it; only the order's `add_graph` writes it."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from graphsan.core.records import DataPtr, GraphId

Range = tuple[DataPtr, DataPtr]  # [start, end)


@dataclass(frozen=True)
class Carve:
    """A range a capture allocated in the pool; `site` is its allocation stack as the adapter
    recorded it (opaque here)."""

    start: DataPtr
    end: DataPtr
    graph: GraphId
    site: object = None


def overlapping(items: list[tuple], start: DataPtr, end: DataPtr, longest: int) -> Iterator:
    """The items (start, end, ...) of a start-sorted list, none longer than `longest`, that
    overlap [start, end)."""
    i = bisect.bisect_left(items, (start - longest,))
    n = len(items)
    while i < n and items[i][0] < end:
        if items[i][1] > start:
            yield items[i]
        i += 1


@dataclass
class CarveIndex:
    """The carves of one pool."""

    # the latest carve of each address: non-overlapping, sorted by start
    starts: list[DataPtr] = field(default_factory=list)
    latest: list[Carve] = field(default_factory=list)
    # every range ever carved (distinct (start, end), sorted) -> the graphs that carved it
    ranges: list[Range] = field(default_factory=list)
    carved_by: dict[Range, set[GraphId]] = field(default_factory=dict)
    longest: int = 0  # the longest range ever carved (the overlap searches' window)
    # per carver, its carved ranges
    of: dict[GraphId, list[Range]] = field(default_factory=dict)

    def add(self, gid: GraphId, carves: list[Carve]) -> None:
        """Capture `gid` carved `carves` (sorted by start): each is the latest at its
        addresses from now on."""
        if carves:
            self.of[gid] = [(c.start, c.end) for c in carves]
        for c in carves:
            key = (c.start, c.end)
            if key not in self.carved_by:
                self.carved_by[key] = set()
                bisect.insort(self.ranges, key)
                self.longest = max(self.longest, c.end - c.start)
            self.carved_by[key].add(gid)
            self._carve(c)

    def ranges_in(self, start: DataPtr, end: DataPtr) -> Iterator[Range]:
        """Every carved range that overlaps [start, end)."""
        return overlapping(self.ranges, start, end, self.longest)

    def latest_in(self, start: DataPtr, end: DataPtr) -> Iterator[Carve]:
        """The latest carves that overlap [start, end), in address order."""
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while i < len(self.latest) and self.latest[i].start < end:
            c = self.latest[i]
            i += 1
            if c.end > start:
                yield c

    def at(self, addr: DataPtr) -> Carve | None:
        """The latest carve holding `addr`."""
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.latest[i].end:
            return self.latest[i]
        return None

    def _carve(self, new: Carve) -> None:
        """The latest carve wins: older carves overlapping it are trimmed or dropped."""
        lo = max(bisect.bisect_right(self.starts, new.start) - 1, 0)
        hi = bisect.bisect_left(self.starts, new.end)
        keep: list[Carve] = []
        for c in self.latest[lo:hi]:
            if c.end <= new.start or c.start >= new.end:
                keep.append(c)
                continue
            if c.start < new.start:
                keep.append(Carve(c.start, new.start, c.graph, c.site))
            if c.end > new.end:
                keep.append(Carve(new.end, c.end, c.graph, c.site))
        keep.append(new)
        keep.sort(key=lambda c: c.start)
        self.latest[lo:hi] = keep
        self.starts[lo:hi] = [c.start for c in keep]

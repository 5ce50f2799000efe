"""The ranges of one pool that its graphs read across graphs (pure: no CUDA, no torch): each
watched range's producer, its writers (every graph that carved memory over it) and its readers.
The pool's replay order (`core.pool_order`) finds conflicts in them; its judgement of the
caller's outputs (`core.outputs`) asks who reads a range."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

from graphsan.core.carves import Carve, CarveIndex, overlapping
from graphsan.core.records import DataPtr, GraphId, Reference


@dataclass(eq=False)
class Watched:
    """A range one graph writes and others read."""

    start: DataPtr
    end: DataPtr
    producer: GraphId
    site: object
    writers: set[GraphId]  # the producer and every other graph that carved the range
    readers: set[GraphId] = field(default_factory=set)


@dataclass
class Readers:
    """The ranges of one pool that graphs read across graphs, who reads and who writes each."""

    # the watched ranges, sorted: (start, end, n, Watched) (n keeps comparisons off Watched)
    watched: list[tuple] = field(default_factory=list)
    by_key: dict[tuple, Watched] = field(default_factory=dict)
    longest: int = 0
    reads: dict[GraphId, list[tuple[Watched, Reference]]] = field(default_factory=dict)
    writes: dict[GraphId, list[Watched]] = field(default_factory=dict)

    def overlapping(self, start: DataPtr, end: DataPtr) -> Iterator[Watched]:
        for item in overlapping(self.watched, start, end, self.longest):
            yield item[3]

    def watch(self, p: Carve, carves: CarveIndex) -> Watched:
        """The watched range of carve piece `p`, made on first read: its writers are the
        producer and every graph that ever carved memory overlapping it."""
        key = (p.start, p.end, p.graph)
        w = self.by_key.get(key)
        if w is not None:
            return w
        writers = {p.graph}
        for r in carves.ranges_in(p.start, p.end):
            writers |= carves.carved_by[r]
        w = Watched(p.start, p.end, p.graph, p.site, writers)
        if len(writers) > 1:  # a range only its producer writes needs no stamps
            for g in writers:
                self.writes.setdefault(g, []).append(w)
        self.by_key[key] = w
        self.longest = max(self.longest, p.end - p.start)
        bisect.insort(self.watched, (p.start, p.end, len(self.by_key), w))
        return w

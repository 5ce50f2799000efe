"""Replay order of the graphs that share one memory pool (pure: no CUDA, no torch).

Graphs captured into one pool may re-carve memory an earlier capture freed; that is legal as long
as they replay in capture order. The model, per pool:

- every capture appends to the pool's sequence g0, g1, ... and *carves* the ranges it allocated
  while it was captured (its replays write them);
- a reference of gi into a range that gp carved last before gi's capture ended (p < i) is a
  *read* of gp's output: gp is the range's producer for gi (a graph's own carves are its own
  business);
- every other graph gk that carved the range, before gp (k < p) or after gi (k > i), is a
  *conflict* (reader gi, range, producer gp, carver gk): each replay of gk overwrites it;
- replaying gi is the hazard when gk has replayed since gp last did: gi would read gk's data. In
  capture order, and when a sequence restarts at g0, the producer always ran after the carver.

The replays of every graph that carved something in its pool are counted (one clock tick); a
graph that reads another graph's range is checked at each replay, one comparison per (producer,
carver) pair it depends on. A reference counts as a read: the model cannot tell a kernel's reads
from its writes, so a graph that only overwrites another graph's output is judged like one that
reads it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from graphsan.core.records import DataPtr, GraphId, Reference


@dataclass(frozen=True)
class Carve:
    """A range a capture allocated in the pool; `site` is its allocation stack as the adapter
    recorded it (opaque here)."""

    start: DataPtr
    end: DataPtr
    graph: GraphId
    site: object = None


@dataclass(frozen=True)
class Conflict:
    """Reader `reader` uses [start, end), written by `producer`, later re-carved by `carver`."""

    reader: GraphId
    start: DataPtr
    end: DataPtr
    producer: GraphId
    carver: GraphId
    ref: Reference  # the reader's first reference into the range
    site: object = None  # the producer's allocation stack of the range


@dataclass
class PoolOrder:
    """One pool's capture sequence, its carves, its cross-graph reads and the replay clock."""

    sequence: list[GraphId] = field(default_factory=list)
    carvers: set[GraphId] = field(default_factory=set)  # graphs that carved (the adapter's)
    # the latest carve of each address: non-overlapping, sorted by start
    _starts: list[DataPtr] = field(default_factory=list)
    _latest: list[Carve] = field(default_factory=list)
    # every carve ever made: (start, end, n, carve), sorted by start (n, a running count, keeps
    # the comparison away from the carves); reads alike: (start, end, n, reader, producer, ref,
    # site)
    _history: list[tuple] = field(default_factory=list)
    _reads: list[tuple] = field(default_factory=list)
    _longest: int = 0
    _count: int = 0
    # reader -> (producer, carver) -> the conflicts of that pair
    conflicts: dict[GraphId, dict[tuple[GraphId, GraphId], list[Conflict]]] = field(
        default_factory=dict
    )
    clock: int = 0
    last: dict[GraphId, int] = field(default_factory=dict)  # graph -> clock of its last replay

    # -- capture ------------------------------------------------------------------------------
    def add_graph(
        self,
        gid: GraphId,
        carved: list[tuple[DataPtr, int, object]],
        refs: list[Reference],
    ) -> set[GraphId]:
        """Register capture `gid`: the ranges it carved ((address, size, site)) and its
        references. Returns the readers that got a new conflict."""
        self.sequence.append(gid)
        readers: set[GraphId] = set()
        carves = sorted(
            (Carve(a, a + n, gid, s) for a, n, s in carved if n > 0), key=lambda c: c.start
        )
        for c in carves:  # a later carver of what earlier graphs read
            for r in self._overlapping(self._reads, c.start, c.end):
                _, _, _, reader, producer, ref, site = r
                if reader != gid and producer != gid:
                    self._conflict(Conflict(reader, r[0], r[1], producer, gid, ref, site))
                    readers.add(reader)
        for c in carves:
            self._count += 1
            bisect.insort(self._history, (c.start, c.end, self._count, c))
            self._longest = max(self._longest, c.end - c.start)
            self._carve(c)
        seen: set[tuple[DataPtr, DataPtr]] = set()
        for ref in sorted(refs, key=lambda r: r.node):  # this graph's reads
            p = self._carve_at(ref.address)
            if p is None or p.graph == gid or (p.start, p.end) in seen:
                continue
            seen.add((p.start, p.end))
            self._count += 1
            bisect.insort(self._reads, (p.start, p.end, self._count, gid, p.graph, ref, p.site))
            for h in self._overlapping(self._history, p.start, p.end):  # earlier carvers
                carver = h[3].graph
                if carver not in (p.graph, gid):
                    self._conflict(Conflict(gid, p.start, p.end, p.graph, carver, ref, p.site))
                    readers.add(gid)
        return readers

    def _overlapping(self, items: list[tuple], start: DataPtr, end: DataPtr):
        lo = bisect.bisect_left(items, (start - self._longest,))
        for item in items[lo:]:
            if item[0] >= end:
                break
            if item[1] > start:
                yield item

    def _conflict(self, c: Conflict) -> None:
        pair = self.conflicts.setdefault(c.reader, {}).setdefault((c.producer, c.carver), [])
        if not any(x.start == c.start for x in pair):
            pair.append(c)

    def _carve_at(self, addr: DataPtr) -> Carve | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._latest[i].end:
            return self._latest[i]
        return None

    def _carve(self, new: Carve) -> None:
        """The latest carve wins: older carves overlapping it are trimmed or dropped."""
        lo = max(bisect.bisect_right(self._starts, new.start) - 1, 0)
        hi = bisect.bisect_left(self._starts, new.end)
        keep: list[Carve] = []
        for c in self._latest[lo:hi]:
            if c.end <= new.start or c.start >= new.end:
                keep.append(c)
                continue
            if c.start < new.start:
                keep.append(Carve(c.start, new.start, c.graph, c.site))
            if c.end > new.end:
                keep.append(Carve(new.end, c.end, c.graph, c.site))
        keep.append(new)
        keep.sort(key=lambda c: c.start)
        self._latest[lo:hi] = keep
        self._starts[lo:hi] = [c.start for c in keep]

    def forget(self, gid: GraphId) -> None:
        """The graph is gone: it reads nothing any more. (Its carves and replays still count:
        what it wrote stays written.)"""
        self.conflicts.pop(gid, None)
        self._reads = [r for r in self._reads if r[3] != gid]

    # -- replay -------------------------------------------------------------------------------
    def hazards(self, gid: GraphId) -> list[Conflict]:
        """The conflicts a replay of `gid` now would hit: the carver ran after the producer."""
        out = []
        last = self.last
        for (producer, carver), pair in self.conflicts.get(gid, {}).items():
            if last.get(carver, 0) > last.get(producer, 0):
                out += pair
        return out

    def replayed(self, gid: GraphId) -> None:
        self.clock += 1
        self.last[gid] = self.clock

"""Replays that race: two graphs whose memory overlaps, replayed on two streams with nothing
ordering one after the other (pure: no CUDA, no torch).

A graph writes the memory it carved while it was captured (its outputs and scratch, in its
pool); what else it references it may only read. Two graphs conflict where one's carves overlap
the other's carves or references: replayed at the same time, one writes what the other reads or
writes. Two graphs that only read the same memory (the weights of two microbatches' forwards) do
not conflict, nor do graphs whose memory is disjoint (separate pools, or ranges apart).

Before a replay of graph B on stream `s`, `Races.racing` looks at the replays in flight on other
streams that the launch on `s` would not come after (`core.streams`): for each such replay of a
graph A whose footprint overlaps B's, the caller asks whether A's stream is still busy; if it
is, the two may run at the same time, and the first overlapping range is the evidence. The
check costs nothing while every replay runs on one stream, and otherwise the footprints of the
unordered replays only (each graph's ranges are kept sorted: one merge per pair).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from graphsan.core.records import DataPtr, GraphId
from graphsan.core.streams import StreamKey, StreamOrder

Range = tuple[DataPtr, DataPtr]  # [start, end)


@dataclass(frozen=True)
class Footprint:
    """What a graph's replay touches: the ranges it carved (it writes them), with the carve
    sites, and the ranges it references (it may only read them), each sorted by start."""

    carved: tuple[Range, ...]
    referenced: tuple[Range, ...]
    sites: tuple[object, ...] = ()  # the carves' allocation sites, in `carved`'s order
    touched: tuple[Range, ...] = ()  # carved and referenced together, sorted

    def __post_init__(self) -> None:
        if not self.touched:
            object.__setattr__(self, "touched", tuple(sorted(self.carved + self.referenced)))

    @classmethod
    def of(cls, carves: list[tuple[DataPtr, int, object]], refs: list[Range]) -> Footprint:
        """From a capture's carves ((address, size, site)) and referenced blocks ([start,
        end))."""
        ordered = sorted(((a, a + n), site) for a, n, site in carves if n > 0)
        return cls(
            tuple(r for r, _ in ordered),
            tuple(sorted(set(refs))),
            tuple(site for _, site in ordered),
        )

    def site_at(self, start: DataPtr) -> object:
        """The allocation site of the carve holding `start` (None: not carved here)."""
        for (a, b), site in zip(self.carved, self.sites, strict=False):
            if a <= start < b:
                return site
        return None


@dataclass(frozen=True)
class Race:
    """Graph `graph`'s replay on `stream` may run at the same time as `other`'s replay number
    `other_launch` on `other_stream`: both touch [start, end), which `writer` carved."""

    graph: GraphId
    stream: StreamKey
    other: GraphId
    other_stream: StreamKey
    other_launch: int
    start: DataPtr
    end: DataPtr
    writer: GraphId
    site: object = None  # the writer's allocation site of the range


def _first_overlap(a: tuple[Range, ...], b: tuple[Range, ...]) -> Range | None:
    """The first overlap of two start-sorted range lists (each may hold overlapping ranges)."""
    i = j = 0
    while i < len(a) and j < len(b):
        (s1, e1), (s2, e2) = a[i], b[j]
        if s1 < e2 and s2 < e1:
            return max(s1, s2), min(e1, e2)
        if e1 <= e2:
            i += 1
        else:
            j += 1
    return None


def conflict(a: Footprint, b: Footprint) -> tuple[Range, bool] | None:
    """Where replays of graphs `a` and `b` touch the same memory and one of them writes it:
    (the range, whether `a` is the writer), or None."""
    hit = _first_overlap(a.carved, b.touched)
    if hit is not None:
        return hit, True
    hit = _first_overlap(b.carved, a.referenced)
    return (hit, False) if hit is not None else None


class Races:
    """The footprints of the watched graphs and the order of their replays (see the module)."""

    def __init__(self, order: StreamOrder | None = None) -> None:
        self.ordering = order if order is not None else StreamOrder()
        # held by whoever changes or reads the order: replays and the program's ordering calls
        # come from any thread
        self.lock = threading.Lock()
        self.footprints: dict[GraphId, Footprint] = {}
        self.streams_used: set[StreamKey] = set()  # streams replays ran on

    def add(self, gid: GraphId, footprint: Footprint) -> None:
        if footprint.carved or footprint.referenced:
            self.footprints[gid] = footprint

    def forget(self, gid: GraphId) -> None:
        self.footprints.pop(gid, None)

    def launched(self, gid: GraphId, stream: StreamKey) -> None:
        """A watched graph's replay was launched on `stream`."""
        self.streams_used.add(stream)
        if gid in self.footprints:
            self.ordering.launched(stream, gid)

    def racing(
        self, gid: GraphId, stream: StreamKey, busy: Callable[[StreamKey], bool]
    ) -> Race | None:
        """The replay of `gid` about to launch on `stream` may run at the same time as a replay
        in flight on another stream: the first such race, or None. `busy(stream)` asks the
        device whether that stream still has work (an idle one completed its replays)."""
        if not self.streams_used or self.streams_used == {stream}:
            return None  # every replay so far ran on this stream: nothing to race with
        mine = self.footprints.get(gid)
        if mine is None:
            return None
        asked: dict[StreamKey, bool] = {}
        for other_stream, n, other in self.ordering.unordered(stream):
            theirs = self.footprints.get(other)  # `gid` itself too: on another stream it races
            if theirs is None:
                continue
            hit = conflict(mine, theirs)
            if hit is None:
                continue
            if other_stream not in asked:
                asked[other_stream] = busy(other_stream)
                if not asked[other_stream]:
                    self.ordering.done(other_stream)
            if not asked[other_stream]:
                continue
            (start, end), mine_writes = hit
            writer, carver = (gid, mine) if mine_writes else (other, theirs)
            site = carver.site_at(start)
            return Race(gid, stream, other, other_stream, n, start, end, writer, site)
        return None

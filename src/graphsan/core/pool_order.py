"""Replay order of the graphs that share one memory pool (pure: no CUDA, no torch).

Graphs captured into one pool may re-carve memory an earlier capture freed; that is legal as long
as they replay in capture order. The model, per pool:

- every capture appends to the pool's sequence g0, g1, ... and *carves* the ranges it allocated
  while it was captured (its replays write them);
- a reference of gi into a range that gp carved last before gi's capture ended (p < i) is a
  *read* of gp's output: gp is the range's producer for gi (a graph's own carves are its own
  business);
- the range is *watched* once read: its writers are the producer and every other graph gk that
  carved memory overlapping it (before gp, k < p, or after gi, k > i, when gk is captured);
- a replay of a writer makes it the range's owner (the writer that replayed last); replaying
  gi is the hazard when the owner is not gp: gk ran after gp last did, and gi would read gk's
  data.
- In capture order, and when a sequence restarts at its first carver, the producer always runs
  after the other writers. So the model follows whether the carvers have replayed in capture
  order since the last restart, and how far: a reader whose producers all ran in this pass,
  and that comes before the next carver, is clean without looking at its ranges.

The caller is a reader too: `core.outputs` judges the outputs a replay would write over.

A replay costs a clock tick and that order bookkeeping, whatever the graph's size; a reader out
of order is checked per range it reads (its own footprint, never the number of graphs). A
reference counts as a read: the model cannot tell a kernel's reads from its writes, so a graph
that only overwrites another graph's output is judged like one that reads it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from graphsan.core.outputs import NEVER_IN_ORDER, CallerReads
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
    """Reader `reader` uses [start, end), written by `producer`, overwritten by `carver`."""

    reader: GraphId
    start: DataPtr
    end: DataPtr
    producer: GraphId
    carver: GraphId
    ref: Reference  # the reader's first reference into the range
    site: object = None  # the producer's allocation stack of the range


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
class PoolOrder(CallerReads):
    """One pool's capture sequence, its carves, the ranges read across graphs and who wrote
    each last. A replay of a graph stamps the ranges it writes; a reader checks its ranges."""

    sequence: list[GraphId] = field(default_factory=list)
    carvers: set[GraphId] = field(default_factory=set)  # graphs that carved (the adapter's)
    # the latest carve of each address: non-overlapping, sorted by start
    _starts: list[DataPtr] = field(default_factory=list)
    _latest: list[Carve] = field(default_factory=list)
    # every range ever carved (distinct (start, end), sorted) -> the graphs that carved it
    _ranges: list[tuple[DataPtr, DataPtr]] = field(default_factory=list)
    _carved_by: dict[tuple[DataPtr, DataPtr], set[GraphId]] = field(default_factory=dict)
    # the watched ranges, sorted: (start, end, n, Watched) (n keeps comparisons off Watched)
    _watched: list[tuple] = field(default_factory=list)
    _watched_by_key: dict[tuple, Watched] = field(default_factory=dict)
    _longest: int = 0
    _count: int = 0
    reads: dict[GraphId, list[tuple[Watched, Reference]]] = field(default_factory=dict)
    # per carver its carved ranges; the carvers of each range that no later capture carved
    # over yet; the carvers some later capture did carve over (their replays can overwrite)
    _carves_of: dict[GraphId, list[tuple[DataPtr, DataPtr]]] = field(default_factory=dict)
    _not_carved_over: dict[tuple[DataPtr, DataPtr], list[GraphId]] = field(default_factory=dict)
    _carved_over: set[GraphId] = field(default_factory=set)
    _newly_carved_over: list[GraphId] = field(default_factory=list)
    # per carver, its first reference (node order) into each of its carves, by carve start
    _first_refs: dict[GraphId, dict[DataPtr, Reference]] = field(default_factory=dict)
    writes: dict[GraphId, list[Watched]] = field(default_factory=dict)
    clock: int = 0
    last: dict[GraphId, int] = field(default_factory=dict)  # graph -> clock of its last replay
    # capture order: each graph's place in `sequence`, the graphs that carved (in that order)
    # and, per reader, the latest place of a graph it reads from
    _place: dict[GraphId, int] = field(default_factory=dict)
    _chain: list[GraphId] = field(default_factory=list)
    _link: dict[GraphId, int] = field(default_factory=dict)  # carver -> its index in _chain
    _producers_up_to: dict[GraphId, int] = field(default_factory=dict)
    # since the last restart the carvers replayed in capture order up to place `_reached`
    _in_order: bool = False
    _reached: int = -1
    _pass_start: int = 0  # the clock of the last restart
    # the pool's first capture, registered once a second one joins it or the order is asked
    # about it: alone in its pool, a graph's replays cannot conflict (most pools are one graph's)
    _pending: tuple | None = None

    # -- capture ------------------------------------------------------------------------------
    def defer(
        self,
        gid: GraphId,
        carved: list[tuple[DataPtr, int, object]],
        first_refs: dict[DataPtr, Reference] | None = None,
    ) -> bool:
        """Keep the pool's first capture for `add_graph` when the order next needs it; False
        (nothing kept) for any later capture, which the caller adds at once. It needs no
        references: the first graph of a pool can only point into its own carves, which are no
        reads."""
        if self.sequence or self._pending is not None:
            return False
        self._pending = (gid, list(carved), first_refs)
        return True

    def _settle(self) -> None:
        if self._pending is not None:
            gid, carved, first_refs = self._pending
            self._pending = None
            self.add_graph(gid, carved, [], first_refs)

    def add_graph(
        self,
        gid: GraphId,
        carved: list[tuple[DataPtr, int, object]],
        refs: list[Reference],
        first_refs: dict[DataPtr, Reference] | None = None,
    ) -> set[GraphId]:
        """Register capture `gid`: the ranges it carved ((address, size, site)), its references
        and its first reference into each carve (by carve start, `first_refs_into`). Returns
        the readers that a range they read can now be overwritten for."""
        self._settle()
        if first_refs:
            self._first_refs[gid] = first_refs
        self._place[gid] = len(self.sequence)
        self.sequence.append(gid)
        readers: set[GraphId] = set()
        carves = sorted(
            (Carve(a, a + n, gid, s) for a, n, s in carved if n > 0), key=lambda c: c.start
        )
        if carves:
            self._link[gid] = len(self._chain)
            self._chain.append(gid)
        for c in carves:  # a later carver of ranges earlier graphs read
            for w in self._overlapping(self._watched, c.start, c.end):
                w = w[3]
                if gid not in w.writers:
                    if len(w.writers) == 1:  # the producer's replays start to matter
                        self.writes.setdefault(w.producer, []).append(w)
                    w.writers.add(gid)
                    self.writes.setdefault(gid, []).append(w)
                    readers |= w.readers
        for c in carves:  # memory earlier graphs carved, carved again here
            for key in self._overlapping(self._ranges, c.start, c.end):
                earlier = self._not_carved_over.pop(key, None)
                for g in earlier or ():
                    if g != gid and g not in self._carved_over:
                        self._carved_over.add(g)
                        self._newly_carved_over.append(g)
        if carves:
            self._carves_of[gid] = [(c.start, c.end) for c in carves]
        reused = [r for c in carves for r in self._released_under(gid, c.start, c.end)]
        for c in carves:
            key = (c.start, c.end)
            if key not in self._carved_by:
                self._carved_by[key] = set()
                bisect.insort(self._ranges, key)
                self._longest = max(self._longest, c.end - c.start)
            self._carved_by[key].add(gid)
            self._not_carved_over.setdefault(key, []).append(gid)
            self._carve(c)
        seen: set[tuple[DataPtr, DataPtr]] = set()
        for ref in sorted(refs, key=lambda r: r.node):  # this graph's reads
            p = self._carve_at(ref.address)
            if p is None or p.graph == gid or (p.start, p.end) in seen:
                continue
            seen.add((p.start, p.end))
            w = self._watch(p)
            w.readers.add(gid)
            self.reads.setdefault(gid, []).append((w, ref))
            place = self._place.get(p.graph, -1)
            if place > self._producers_up_to.get(gid, -1):
                self._producers_up_to[gid] = place
            if len(w.writers) > 1:
                readers.add(gid)
        self._add_reuses(gid, reused)
        return readers

    def _watch(self, p: Carve) -> Watched:
        """The watched range of carve piece `p`, made on first read: its writers are the
        producer and every graph that ever carved memory overlapping it."""
        key = (p.start, p.end, p.graph)
        w = self._watched_by_key.get(key)
        if w is not None:
            return w
        writers = {p.graph}
        for start, end in self._overlapping(self._ranges, p.start, p.end):
            writers |= self._carved_by[(start, end)]
        w = Watched(p.start, p.end, p.graph, p.site, writers)
        if len(writers) > 1:  # a range only its producer writes needs no stamps
            for g in writers:
                self.writes.setdefault(g, []).append(w)
        self._watched_by_key[key] = w
        self._count += 1
        bisect.insort(self._watched, (p.start, p.end, self._count, w))
        return w

    def _overlapping(self, items: list[tuple], start: DataPtr, end: DataPtr):
        """The items (start, end, ...) of a start-sorted list that overlap [start, end)."""
        i = bisect.bisect_left(items, (start - self._longest,))
        n = len(items)
        while i < n and items[i][0] < end:
            if items[i][1] > start:
                yield items[i]
            i += 1

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
        """The graph is gone: it reads nothing any more, and a pass in capture order goes on
        without it. (What it wrote stays written.)"""
        if self._pending is not None and self._pending[0] == gid:
            self._pending = None
            return
        self._settle()
        for w, _ in self.reads.pop(gid, ()):
            w.readers.discard(gid)
        self._carves_of.pop(gid, None)
        self._first_refs.pop(gid, None)
        self._forget_reuses(gid)
        self._carved_over.discard(gid)
        # its readers read what no replay rewrites now: capture order no longer clears them
        for w in self._watched_by_key.values():
            if w.producer == gid:
                for r in w.readers:
                    self._producers_up_to[r] = NEVER_IN_ORDER
        if gid in self._link:
            self._chain.remove(gid)
            self._link = {g: i for i, g in enumerate(self._chain)}

    def judges(self, gid: GraphId, addr: DataPtr) -> bool:
        """Whether the order covers what `gid` does at `addr`: it reads there a range another
        graph of the pool carved, or it carved the range itself (its own output)."""
        if self._pending is not None and self._pending[0] == gid:
            # alone in the pool it reads no other graph's range: only its own carves count
            return any(a <= addr < a + n for a, n, _ in self._pending[1] if n > 0)
        self._settle()
        if any(w.start <= addr < w.end for w, _ in self.reads.get(gid, ())):
            return True
        return any(
            gid in self._carved_by[(start, end)]
            for start, end in self._overlapping(self._ranges, addr, addr + 1)
        )

    # -- replay -------------------------------------------------------------------------------
    def in_order(self, gid: GraphId) -> bool:
        """Whether a replay of `gid` now is clean by capture order alone: the carvers have
        replayed in capture order since the last restart, every graph `gid` reads from among
        them, and none after `gid`'s place (or `gid` restarts the pass)."""
        if self._chain and gid == self._chain[0] and gid not in self._producers_up_to:
            return True
        return self._in_order and self._producers_up_to.get(
            gid, -1
        ) <= self._reached < self._place.get(gid, -1)

    def hazards(self, gid: GraphId) -> list[Conflict]:
        """The ranges a replay of `gid` now would read from the wrong writer."""
        reads = self.reads.get(gid)
        if not reads or self.in_order(gid):
            return []
        out = []
        last = self.last
        for w, ref in reads:
            ran = [g for g in w.writers if last.get(g, 0)]
            owner = max(ran, key=last.__getitem__) if ran else None  # who wrote it last
            if owner is not None and owner != w.producer:
                out.append(Conflict(gid, w.start, w.end, w.producer, owner, ref, w.site))
        return out

    def producer_at(self, addr: DataPtr) -> GraphId | None:
        """The graph that carved `addr` last (None: no capture of the pool did)."""
        c = self._carve_at(addr)
        return c.graph if c is not None else None

    def replayed(self, gid: GraphId) -> None:
        """`gid` ran: it wrote every range it carves (it owns them until another writer runs).
        Only a shared pool's graphs are counted, so nothing is pending here."""
        self.clock += 1
        self.last[gid] = self.clock
        i = self._link.get(gid)
        if i is None:
            return  # it carved nothing: the order of the pass does not change
        if i == 0:
            self._in_order = True  # a pass restarts
            self._pass_start = self.clock
        elif not (self._in_order and self._chain[i - 1] == self._reached_graph()):
            self._in_order = False
        self._reached = self._place[gid]

    def _reached_graph(self) -> GraphId | None:
        return self.sequence[self._reached] if self._reached >= 0 else None


def first_refs_into(
    carved: list[tuple[DataPtr, int, object]], refs: list[Reference]
) -> dict[DataPtr, Reference]:
    """Per carve start, the first reference (node order) that points into that carve."""
    carves = sorted((a, a + n) for a, n, _ in carved if n > 0)
    starts = [a for a, _ in carves]
    out: dict[DataPtr, Reference] = {}
    for ref in refs:
        i = bisect.bisect_right(starts, ref.address) - 1
        if i >= 0 and ref.address < carves[i][1]:
            best = out.get(starts[i])
            if best is None or ref.node < best.node:
                out[starts[i]] = ref
    return out

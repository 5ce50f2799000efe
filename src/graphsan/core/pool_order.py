"""Replay order of the graphs that share one memory pool (pure: no CUDA, no torch).

Graphs captured into one pool may re-carve memory an earlier capture freed; that is legal as long
as they replay in capture order. The model, per pool:

- every capture appends to the pool's sequence g0, g1, ... and *carves* the ranges it allocated
  while it was captured (its replays write them; `core.carves`);
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
  order since the last restart, and how far (`core.passes`): a reader whose producers all ran
  in this pass, and that comes before the next carver, is clean without looking at its ranges.

The caller is a reader too: `core.outputs` judges the outputs a replay would write over, from
the same carves, passes and watched ranges.

A replay costs a clock tick and that order bookkeeping, whatever the graph's size; a reader out
of order is checked per range it reads (its own footprint, never the number of graphs). A
reference counts as a read: the model cannot tell a kernel's reads from its writes, so a graph
that only overwrites another graph's output is judged like one that reads it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from graphsan.core.carves import Carve, CarveIndex
from graphsan.core.outputs import CallerReads, Overwrite
from graphsan.core.passes import NEVER_IN_ORDER, PassOrder
from graphsan.core.reads import Readers, Watched
from graphsan.core.records import DataPtr, GraphId, Reference


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


@dataclass
class PoolOrder:
    """One pool's capture sequence, its carves, the ranges read across graphs and who wrote
    each last. A replay of a graph stamps the ranges it writes; a reader checks its ranges."""

    carvers: set[GraphId] = field(default_factory=set)  # graphs that carved (the adapter's)
    carves: CarveIndex = field(default_factory=CarveIndex)
    passes: PassOrder = field(default_factory=PassOrder)
    readers: Readers = field(default_factory=Readers)
    outputs: CallerReads = field(init=False)
    # the pool's first capture, registered once a second one joins it or the order is asked
    # about it: alone in its pool, a graph's replays cannot conflict (most pools are one graph's)
    _pending: tuple | None = None

    def __post_init__(self) -> None:
        self.outputs = CallerReads(self.carves, self.passes, self.readers)

    @property
    def sequence(self) -> list[GraphId]:
        return self.passes.sequence

    @property
    def clock(self) -> int:
        return self.passes.clock

    @property
    def last(self) -> dict[GraphId, int]:
        return self.passes.last

    @property
    def reads(self) -> dict[GraphId, list[tuple[Watched, Reference]]]:
        return self.readers.reads

    @property
    def writes(self) -> dict[GraphId, list[Watched]]:
        return self.readers.writes

    @property
    def reuses(self) -> dict:
        return self.outputs.reuses

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
        out = self.outputs
        if first_refs:
            out.first_refs[gid] = first_refs
        carves = sorted(
            (Carve(a, a + n, gid, s) for a, n, s in carved if n > 0), key=lambda c: c.start
        )
        self.passes.captured(gid, bool(carves))
        readers: set[GraphId] = set()
        writes = self.readers.writes
        for c in carves:  # a later carver of ranges earlier graphs read
            for w in self.readers.overlapping(c.start, c.end):
                if gid not in w.writers:
                    if len(w.writers) == 1:  # the producer's replays start to matter
                        writes.setdefault(w.producer, []).append(w)
                    w.writers.add(gid)
                    writes.setdefault(gid, []).append(w)
                    readers |= w.readers
        out.carving(gid, carves)  # memory earlier graphs carved, carved again here
        reused = out.released_under(gid, carves)
        self.carves.add(gid, carves)
        out.carved(gid, carves)
        seen: set[tuple[DataPtr, DataPtr]] = set()
        for ref in sorted(refs, key=lambda r: r.node):  # this graph's reads
            p = self.carves.at(ref.address)
            if p is None or p.graph == gid or (p.start, p.end) in seen:
                continue
            seen.add((p.start, p.end))
            w = self.readers.watch(p, self.carves)
            w.readers.add(gid)
            self.readers.reads.setdefault(gid, []).append((w, ref))
            self.passes.reads_from(gid, self.passes.place.get(p.graph, -1))
            if len(w.writers) > 1:
                readers.add(gid)
        out.add_reuses(gid, reused)
        return readers

    def forget(self, gid: GraphId) -> None:
        """The graph is gone: it reads nothing any more, and a pass in capture order goes on
        without it. (What it wrote stays written.)"""
        if self._pending is not None and self._pending[0] == gid:
            self._pending = None
            return
        self._settle()
        for w, _ in self.readers.reads.pop(gid, ()):
            w.readers.discard(gid)
        self.carves.of.pop(gid, None)
        self.outputs.forget(gid)
        # its readers read what no replay rewrites now: capture order no longer clears them
        for w in self.readers.by_key.values():
            if w.producer == gid:
                for r in w.readers:
                    self.passes.producers_up_to[r] = NEVER_IN_ORDER
        self.passes.forget(gid)

    def judges(self, gid: GraphId, addr: DataPtr) -> bool:
        """Whether the order covers what `gid` does at `addr`: it reads there a range another
        graph of the pool carved, or it carved the range itself (its own output)."""
        if self._pending is not None and self._pending[0] == gid:
            # alone in the pool it reads no other graph's range: only its own carves count
            return any(a <= addr < a + n for a, n, _ in self._pending[1] if n > 0)
        self._settle()
        if any(w.start <= addr < w.end for w, _ in self.readers.reads.get(gid, ())):
            return True
        return any(gid in self.carves.carved_by[r] for r in self.carves.ranges_in(addr, addr + 1))

    def release(self, start: DataPtr, size: int, in_capture: bool) -> None:
        """Memory a capture of the pool carved went back to the pool (`CallerReads.release`)."""
        self._settle()
        self.outputs.release(start, size, in_capture)

    # -- replay -------------------------------------------------------------------------------
    def in_order(self, gid: GraphId) -> bool:
        return self.passes.in_order(gid)

    def hazards(self, gid: GraphId) -> list[Conflict]:
        """The ranges a replay of `gid` now would read from the wrong writer."""
        reads = self.readers.reads.get(gid)
        if not reads or self.passes.in_order(gid):
            return []
        out = []
        last = self.passes.last
        for w, ref in reads:
            ran = [g for g in w.writers if last.get(g, 0)]
            owner = max(ran, key=last.__getitem__) if ran else None  # who wrote it last
            if owner is not None and owner != w.producer:
                out.append(Conflict(gid, w.start, w.end, w.producer, owner, ref, w.site))
        return out

    def overwritten(self, gid: GraphId) -> list[Overwrite]:
        """The outputs a replay of `gid` now would write over (`CallerReads.overwritten`)."""
        return self.outputs.overwritten(gid)

    def new_overwriters(self) -> list[GraphId]:
        return self.outputs.new_overwriters()

    def first_ref(self, gid: GraphId, start: DataPtr, end: DataPtr) -> Reference | None:
        """`gid`'s first reference into its carves that overlap [start, end)."""
        self._settle()
        return self.outputs.first_ref(gid, start, end)

    def producer_at(self, addr: DataPtr) -> GraphId | None:
        """The graph that carved `addr` last (None: no capture of the pool did)."""
        c = self.carves.at(addr)
        return c.graph if c is not None else None

    def replayed(self, gid: GraphId) -> None:
        """`gid` ran: it wrote every range it carves (it owns them until another writer runs).
        Only a shared pool's graphs are counted, so nothing is pending here."""
        self.passes.replayed(gid)


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

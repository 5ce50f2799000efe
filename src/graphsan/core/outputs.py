"""The caller as a reader of a shared pool's graphs (pure: no CUDA, no torch): the outputs a
replay would write over before the caller is done with them. `CallerReads` is a part of the
pool's replay order (`core.pool_order.PoolOrder`): it reads the pool's carves
(`core.carves`), its capture order and clock (`core.passes`) and the ranges its graphs read, and
keeps its own indexes (the outputs the pool got back, the carves made over them, the graphs
whose replays can write over a later graph's output).

The caller is a reader too. A capture can carve memory an earlier graph of the pool used as
scratch and hand it out as an output the caller keeps (a backward's input gradient in a pipeline
schedule). Replaying the earlier graph then writes over that output. In capture order, and at a
restart, that output belongs to a finished pass; out of capture order, when the output's producer
ran after the earlier graph last did, the caller has not read it yet. That `Overwrite` is judged
only in pools where graphs pass data to each other (some graph reads another's range): graphs of
one pool that never do (one graph per batch size, replayed in any order) each hand their output to
the caller before the next replay. An output that graphs of the pool read is consumed once every
one of them replayed after its producer did (a schedule's activations and gradients, handed from
graph to graph): the model cannot see eager code read it, and stays quiet there rather than
guess.

The other way round, a graph's output can go back to the pool while the caller still uses it:
Transformer Engine's `_reuse_graph_input_output_buffers` lets go of a forward's static outputs
once the matching backward is captured, and a later capture carves them. The adapter reports
each release between captures (`release`; one during a capture is that capture's own work), so
the model knows the capture the release came right after: the one the caller waited for (TE's
matching backward). A later capture that carves the memory writes over the output at replay
unless that capture has replayed since the producer last did: in capture order it has; out of
it (forward mb1 right after forward mb0, when backward mb0's capture came before the release)
the caller has not finished with the output. Other captures between producer and release do
not count: the lab's step replayed sequentially over graphs captured 1F1B with reuse runs
another microbatch's backward there first, and trains as eager does. Memory a graph of the pool
reads is left to `replay-order`, which judges that reader.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace

from graphsan.core.carves import Carve, CarveIndex, overlapping
from graphsan.core.passes import NEVER_IN_ORDER, PassOrder
from graphsan.core.reads import Readers
from graphsan.core.records import DataPtr, GraphId, Reference


@dataclass(frozen=True)
class Overwrite:
    """A replay of `writer` writes [start, end): memory `producer`, captured later, carved from
    `writer`'s scratch; `site` is the producer's allocation stack of its carve."""

    writer: GraphId
    start: DataPtr
    end: DataPtr
    producer: GraphId
    site: object = None
    # the producer's output went back to the pool after this graph's capture, which has not
    # replayed since the producer did: `writer` carved it later (see `release`)
    pending: GraphId | None = None


@dataclass(frozen=True)
class Reuse:
    """`writer` carved [start, end), `producer`'s output that the pool got back only after the
    captures of `window` (in capture order; the last is the one the release followed)."""

    writer: GraphId
    start: DataPtr
    end: DataPtr
    producer: GraphId
    window: tuple[GraphId, ...]
    site: object = None
    # the place of the window's last capture, and whether it carved memory (then a pass in
    # capture order that reached it proves it replayed after the producer)
    through: int = -1
    carvers: bool = False


Piece = tuple[DataPtr, DataPtr, GraphId, object, int]  # (start, end, producer, site, place)


@dataclass
class CallerReads:
    """The judgement of the outputs the caller holds (see the module docstring)."""

    carves: CarveIndex
    passes: PassOrder
    readers: Readers
    # outputs the pool got back after a later capture: (start, end, place of the last capture
    # before the release), sorted, none longer than `_released_longest`
    _released: list[tuple[DataPtr, DataPtr, int]] = field(default_factory=list)
    _released_longest: int = 0
    # per graph, the released outputs it carved again
    reuses: dict[GraphId, list[Reuse]] = field(default_factory=dict)
    # the carvers of each range that no later capture carved over yet; the carvers some later
    # capture did carve over (their replays can overwrite), and those not announced yet
    _not_carved_over: dict[tuple[DataPtr, DataPtr], list[GraphId]] = field(default_factory=dict)
    carved_over: set[GraphId] = field(default_factory=set)
    _newly_carved_over: list[GraphId] = field(default_factory=list)
    # per carver, its first reference (node order) into each of its carves, by carve start
    first_refs: dict[GraphId, dict[DataPtr, Reference]] = field(default_factory=dict)

    # -- capture ------------------------------------------------------------------------------
    def carving(self, gid: GraphId, carves: list[Carve]) -> None:
        """Before capture `gid`'s carves join the pool: the earlier carvers of memory it carves
        again can write over its outputs from now on."""
        for c in carves:
            for key in self.carves.ranges_in(c.start, c.end):
                for g in self._not_carved_over.pop(key, None) or ():
                    if g != gid:
                        self._carved_over_by(g)

    def carved(self, gid: GraphId, carves: list[Carve]) -> None:
        """Capture `gid`'s carves joined the pool: no later capture carved over them yet."""
        for c in carves:
            self._not_carved_over.setdefault((c.start, c.end), []).append(gid)

    def _carved_over_by(self, gid: GraphId) -> None:
        if gid not in self.carved_over:
            self.carved_over.add(gid)
            self._newly_carved_over.append(gid)

    def release(self, start: DataPtr, size: int, in_capture: bool) -> None:
        """Memory a capture of the pool carved went back to the pool, during a capture of the
        pool (`in_capture`) or between captures. Only a release between captures is the
        caller's: one during a capture is that capture's own work (autograd freeing what the
        backward consumed, a module swapping a cached tensor), which its reads cover. Kept until
        a capture carves the memory again, where captures came between producer and release."""
        if in_capture:
            return
        place = len(self.passes.sequence) - 1  # the latest capture
        c = self.carves.at(start)
        if c is None or self.passes.place.get(c.graph, place) >= place:
            return  # released before any other capture came: the caller was done with it
        end = start + size
        lo = bisect.bisect_left(self._released, (start,))
        hi = bisect.bisect_left(self._released, (end,))
        self._released[lo:hi] = [(start, end, place)]
        self._released_longest = max(self._released_longest, size)

    def _take_released(self, start: DataPtr, end: DataPtr) -> list[tuple[DataPtr, DataPtr, int]]:
        """The released ranges' parts in [start, end), no longer released (a capture carved
        them); their parts outside stay."""
        taken, keep = [], []
        hits = overlapping(self._released, start, end, self._released_longest)
        for r in list(hits):
            self._released.remove(r)
            rs, re, place = r
            taken.append((max(rs, start), min(re, end), place))
            keep += [(a, b, place) for a, b in ((rs, start), (end, re)) if a < b]
        for r in keep:
            bisect.insort(self._released, r)
        return taken

    def released_under(self, gid: GraphId, carves: list[Carve]) -> list[Piece]:
        """The released outputs the new carves of `gid` land on (before they join the pool's
        carves): (piece start, end, producer, its site, the place of the last capture before
        the release)."""
        out = []
        for c in carves:
            for lo, hi, place in self._take_released(c.start, c.end):
                for p in self.carves.latest_in(lo, hi):
                    if p.graph != gid:
                        out.append((max(lo, p.start), min(hi, p.end), p.graph, p.site, place))
        return out

    def add_reuses(self, gid: GraphId, reused: list[Piece]) -> None:
        """Keep the released outputs `gid` carved again whose window holds a graph other than
        `gid`, and that no graph of the pool reads (those are their readers' to judge)."""
        passes = self.passes
        mine = passes.place[gid]
        for start, end, producer, site, place in reused:
            first = passes.place.get(producer, mine) + 1
            window = tuple(g for g in passes.sequence[first : min(place, mine - 1) + 1])
            if not window or any(
                w.readers and w.producer == producer for w in self.readers.overlapping(start, end)
            ):
                continue
            carvers = window[-1] in passes.link
            through = passes.place[window[-1]]
            self.reuses.setdefault(gid, []).append(
                Reuse(gid, start, end, producer, window, site, through, carvers)
            )
            # capture order clears a replay of `gid` only once the pass reached the window
            passes.reads_from(gid, through if carvers else NEVER_IN_ORDER)
            self._carved_over_by(gid)

    def forget(self, gid: GraphId) -> None:
        """`gid` is gone: its first references, its reuses, those of its outputs, its place in
        every window."""
        self.first_refs.pop(gid, None)
        self.reuses.pop(gid, None)
        for writer, rs in list(self.reuses.items()):
            kept = []
            for r in rs:
                window = tuple(g for g in r.window if g != gid)
                if r.producer != gid and window:
                    kept.append(replace(r, window=window) if window != r.window else r)
            self.reuses[writer] = kept
        self.carved_over.discard(gid)

    # -- replay -------------------------------------------------------------------------------
    def new_overwriters(self) -> list[GraphId]:
        """The graphs whose replays can now write over a later graph's output, each once, from
        when graphs of the pool pass data to each other (see the module docstring)."""
        if not self.readers.reads:
            return []
        new, self._newly_carved_over = self._newly_carved_over, []
        return [g for g in new if g in self.carved_over]

    def first_ref(self, gid: GraphId, start: DataPtr, end: DataPtr) -> Reference | None:
        """`gid`'s first reference into its carves that overlap [start, end)."""
        refs = self.first_refs.get(gid, {})
        hits = [
            refs[s] for s, e in self.carves.of.get(gid, ()) if s < end and e > start and s in refs
        ]
        return min(hits, key=lambda r: r.node) if hits else None

    def overwritten(self, gid: GraphId) -> list[Overwrite]:
        """The ranges a replay of `gid` now would write that hold the latest carve of a graph
        captured later, which ran in this pass after `gid` last did (and nothing wrote there
        since): outputs the caller has not read yet, if the caller still holds them (that is
        the caller's to check). Judged out of capture order, in pools whose graphs pass data to
        each other."""
        if gid not in self.carved_over or not self.readers.reads:
            return []
        out = self._reused_outputs(gid)
        passes = self.passes
        if passes.in_order(gid):
            return out
        # outputs of an earlier pass were the caller's to read before the restart
        last = passes.last
        mine, place = max(last.get(gid, 0), passes.pass_start), passes.place[gid]
        for start, end in self.carves.of.get(gid, ()):
            for c in self.carves.latest_in(start, end):
                if c.graph == gid:
                    continue
                theirs = last.get(c.graph, 0)
                if passes.place.get(c.graph, -1) <= place or theirs <= mine:
                    continue
                if passes.clock > theirs:
                    continue  # another graph of the pool ran since: the caller took it before
                lo, hi = max(start, c.start), min(end, c.end)
                if self._written_since(lo, hi, c.graph, theirs):
                    continue  # its data there is gone already (found at that replay)
                if self._consumed(lo, hi, c.graph, theirs):
                    continue
                out.append(Overwrite(gid, lo, hi, c.graph, c.site))
        return out

    def _reused_outputs(self, gid: GraphId) -> list[Overwrite]:
        """The released outputs `gid` carved again that a replay now writes over: their producer
        ran in this pass after `gid` last did, and the capture the release followed has not
        replayed since."""
        out: list[Overwrite] = []
        passes = self.passes
        last = passes.last
        for r in self.reuses.get(gid, ()):
            if r.carvers and passes.in_order_since_restart and passes.reached >= r.through:
                continue  # this pass reached the window in capture order
            theirs = last.get(r.producer, 0)
            if theirs <= last.get(gid, 0) or theirs < passes.pass_start:
                continue
            pending = r.window[-1]  # the capture the release came right after
            if last.get(pending, 0) > theirs or self._written_since(
                r.start, r.end, r.producer, theirs
            ):
                continue
            out.append(Overwrite(gid, r.start, r.end, r.producer, r.site, pending))
        return out

    def _consumed(self, lo: DataPtr, hi: DataPtr, producer: GraphId, clock: int) -> bool:
        """Whether `producer`'s output in [lo, hi) went to graphs of the pool that have all read
        it since `clock` (its last replay): a pipeline's activation or gradient, handed on."""
        readers = [w.readers for w in self.readers.overlapping(lo, hi) if w.producer == producer]
        last = self.passes.last
        return bool(readers) and all(r and all(last.get(g, 0) > clock for g in r) for r in readers)

    def _written_since(self, lo: DataPtr, hi: DataPtr, producer: GraphId, clock: int) -> bool:
        """Whether a graph other than `producer` that carved memory in [lo, hi) replayed after
        `clock`."""
        last = self.passes.last
        return any(
            g != producer and last.get(g, 0) > clock
            for key in self.carves.ranges_in(lo, hi)
            for g in self.carves.carved_by[key]
        )

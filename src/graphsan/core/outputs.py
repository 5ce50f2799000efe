"""The caller as a reader of a shared pool's graphs (pure: no CUDA, no torch): the outputs a
replay would write over before the caller is done with them. `core.pool_order.PoolOrder` holds the
pool's model and takes these methods; this module is their half of it.

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


NEVER_IN_ORDER = 1 << 62  # a reader's producer place that no pass reaches


@dataclass
class CallerReads:
    """PoolOrder's judgement of the outputs the caller holds (see the module docstring)."""

    # outputs the pool got back after a later capture: (start, end, place of the last capture
    # before the release), sorted; and per graph the released outputs it carved again
    _released: list[tuple[DataPtr, DataPtr, int]] = field(default_factory=list)
    reuses: dict[GraphId, list[Reuse]] = field(default_factory=dict)

    # -- capture ------------------------------------------------------------------------------
    def release(self, start: DataPtr, size: int, in_capture: bool) -> None:
        """Memory a capture of the pool carved went back to the pool, during a capture of the
        pool (`in_capture`) or between captures. Only a release between captures is the
        caller's: one during a capture is that capture's own work (autograd freeing what the
        backward consumed, a module swapping a cached tensor), which its reads cover. Kept until
        a capture carves the memory again, where captures came between producer and release."""
        if in_capture:
            return
        self._settle()
        place = len(self.sequence) - 1  # the latest capture
        c = self._carve_at(start)
        if c is None or self._place.get(c.graph, place) >= place:
            return  # released before any other capture came: the caller was done with it
        end = start + size
        lo = bisect.bisect_left(self._released, (start,))
        hi = bisect.bisect_left(self._released, (end,))
        self._released[lo:hi] = [(start, end, place)]
        self._longest = max(self._longest, size)

    def _take_released(self, start: DataPtr, end: DataPtr) -> list[tuple[DataPtr, DataPtr, int]]:
        """The released ranges' parts in [start, end), no longer released (a capture carved
        them); their parts outside stay."""
        taken, keep = [], []
        for r in list(self._overlapping(self._released, start, end)):
            self._released.remove(r)
            rs, re, place = r
            taken.append((max(rs, start), min(re, end), place))
            keep += [(a, b, place) for a, b in ((rs, start), (end, re)) if a < b]
        for r in keep:
            bisect.insort(self._released, r)
        return taken

    def _released_under(self, gid: GraphId, start: DataPtr, end: DataPtr) -> list[tuple]:
        """The released outputs a new carve [start, end) of `gid` lands on: (piece start, end,
        producer, its site, the place of the last capture before the release)."""
        out = []
        for lo, hi, place in self._take_released(start, end):
            i = max(bisect.bisect_right(self._starts, lo) - 1, 0)
            while i < len(self._latest) and self._latest[i].start < hi:
                p = self._latest[i]
                i += 1
                if p.end > lo and p.graph != gid:
                    out.append((max(lo, p.start), min(hi, p.end), p.graph, p.site, place))
        return out

    def _add_reuses(self, gid: GraphId, reused: list[tuple]) -> None:
        """Keep the released outputs `gid` carved again whose window holds a graph other than
        `gid`, and that no graph of the pool reads (those are their readers' to judge)."""
        mine = self._place[gid]
        for start, end, producer, site, place in reused:
            first = self._place.get(producer, mine) + 1
            window = tuple(g for g in self.sequence[first : min(place, mine - 1) + 1])
            if not window or any(
                w.readers and w.producer == producer
                for _, _, _, w in self._overlapping(self._watched, start, end)
            ):
                continue
            carvers = window[-1] in self._link
            through = self._place[window[-1]]
            self.reuses.setdefault(gid, []).append(
                Reuse(gid, start, end, producer, window, site, through, carvers)
            )
            # capture order clears a replay of `gid` only once the pass reached the window
            bound = through if carvers else NEVER_IN_ORDER
            if bound > self._producers_up_to.get(gid, -1):
                self._producers_up_to[gid] = bound
            if gid not in self._carved_over:
                self._carved_over.add(gid)
                self._newly_carved_over.append(gid)

    def _forget_reuses(self, gid: GraphId) -> None:
        """`gid` is gone: its reuses, those of its outputs, and its place in every window."""
        self.reuses.pop(gid, None)
        for writer, rs in list(self.reuses.items()):
            kept = []
            for r in rs:
                window = tuple(g for g in r.window if g != gid)
                if r.producer != gid and window:
                    kept.append(replace(r, window=window) if window != r.window else r)
            self.reuses[writer] = kept

    # -- replay -------------------------------------------------------------------------------
    def new_overwriters(self) -> list[GraphId]:
        """The graphs whose replays can now write over a later graph's output, each once, from
        when graphs of the pool pass data to each other (see the module docstring)."""
        if not self.reads:
            return []
        new, self._newly_carved_over = self._newly_carved_over, []
        return [g for g in new if g in self._carved_over]

    def first_ref(self, gid: GraphId, start: DataPtr, end: DataPtr) -> Reference | None:
        """`gid`'s first reference into its carves that overlap [start, end)."""
        self._settle()
        refs = self._first_refs.get(gid, {})
        hits = [
            refs[s] for s, e in self._carves_of.get(gid, ()) if s < end and e > start and s in refs
        ]
        return min(hits, key=lambda r: r.node) if hits else None

    def overwritten(self, gid: GraphId) -> list[Overwrite]:
        """The ranges a replay of `gid` now would write that hold the latest carve of a graph
        captured later, which ran in this pass after `gid` last did (and nothing wrote there
        since): outputs the caller has not read yet, if
        the caller still holds them (that is the caller's to check). Judged out of capture
        order, in pools whose graphs pass data to each other."""
        if gid not in self._carved_over or not self.reads:
            return []
        out = self._reused_outputs(gid)
        if self.in_order(gid):
            return out
        # outputs of an earlier pass were the caller's to read before the restart
        mine, place, last = (
            max(self.last.get(gid, 0), self._pass_start),
            self._place[gid],
            self.last,
        )
        for start, end in self._carves_of.get(gid, ()):
            i = max(bisect.bisect_right(self._starts, start) - 1, 0)
            while i < len(self._latest) and self._latest[i].start < end:
                c = self._latest[i]
                i += 1
                if c.end <= start or c.graph == gid:
                    continue
                theirs = last.get(c.graph, 0)
                if self._place.get(c.graph, -1) <= place or theirs <= mine:
                    continue
                if self.clock > theirs:
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
        last = self.last
        for r in self.reuses.get(gid, ()):
            if r.carvers and self._in_order and self._reached >= r.through:
                continue  # this pass reached the window in capture order
            theirs = last.get(r.producer, 0)
            if theirs <= last.get(gid, 0) or theirs < self._pass_start:
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
        readers = [
            w.readers
            for _, _, _, w in self._overlapping(self._watched, lo, hi)
            if w.producer == producer
        ]
        last = self.last
        return bool(readers) and all(r and all(last.get(g, 0) > clock for g in r) for r in readers)

    def _written_since(self, lo: DataPtr, hi: DataPtr, producer: GraphId, clock: int) -> bool:
        """Whether a graph other than `producer` that carved memory in [lo, hi) replayed after
        `clock`."""
        last = self.last
        return any(
            g != producer and last.get(g, 0) > clock
            for key in self._overlapping(self._ranges, lo, hi)
            for g in self._carved_by[key]
        )

"""The replay orders of the process's shared pools, kept in step with the tracker's graphs, and
the findings of a replay that would read another graph's data (pure: no CUDA, no torch).

`core.pool_order.PoolOrder` models one pool; `ReplayOrders` keeps one per (device, pool) that a
capture carved memory in, says which graphs' replays are now counted (`GraphState.order`) or
checked (`GraphState.reads`) as a capture joins it (the replay judge tells their states),
answers the tracker whether a freed pool block is the order's to judge (`judges`), and turns a
reader's conflicts into `replay-order` findings.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

from graphsan.core.eager import EagerInPools, EagerTensor
from graphsan.core.graph_state import GraphState, WatchedBlock
from graphsan.core.kinds import Kind
from graphsan.core.memory_map import SegmentIndex
from graphsan.core.outputs import Overwrite
from graphsan.core.pool_order import Conflict, PoolOrder, first_refs_into
from graphsan.core.records import (
    DataPtr,
    Finding,
    Frame,
    GraphId,
    GraphInfo,
    OrderEvidence,
    PoolId,
    Reference,
    When,
    pool_name,
)

# a capture's carves: (address, requested size, allocation site as the adapter recorded it)
Carves = list[tuple[DataPtr, int, object]]


@dataclass(frozen=True)
class Joined:
    """What a capture joining its pool's order changed: the graphs now checked against the
    order at each replay (`checked`), and those whose replays it now counts (`counted`: the
    pool is shared from here on)."""

    order: PoolOrder
    checked: tuple[GraphId, ...]
    counted: tuple[GraphId, ...]


class ReplayOrders:
    """(device, pool) -> that pool's `PoolOrder`, for the graphs the tracker watches: `graphs`
    is the tracker's dict of live graphs (the tracker is built with the same dict, and asks
    these orders about its blocks, `judges` and `released`)."""

    def __init__(
        self,
        graphs: Mapping[GraphId, GraphState],
        site_frames: Callable[[object], list[Frame]],
        eager: EagerInPools | None = None,
    ) -> None:
        self.graphs = graphs
        self.site_frames = site_frames  # a carve's site as user frames, outermost first
        # the eager tensors in the graphs' carves (fed by the allocator's adapter)
        self.eager = eager if eager is not None else EagerInPools()
        self.orders: dict[tuple[int, PoolId], PoolOrder] = {}
        self.enabled = True  # follow the order of graphs captured from now on

    def add_capture(
        self, info: GraphInfo, carved: Carves, refs: list[Reference], view: SegmentIndex
    ) -> Joined | None:
        """Add the capture to its pool's replay order: what it carved in its own pool, what it
        reads there. Returns the graphs a new conflict involves (the replay judge tells their
        states), or None where the order changed for no graph."""
        if not self.enabled:
            return None
        in_pool = []
        for addr, size, site in carved:
            seg = view.segment_at(addr)
            if seg is not None and seg.pool == info.pool:
                in_pool.append((addr, size, site))
        if in_pool:
            self.eager.add_capture(info.id, info.device, info.pool, in_pool)
        key = (info.device, info.pool)
        order = self.orders.get(key)
        if order is None:
            if not in_pool:
                return None  # nothing carved: no later graph of the pool can depend on this one
            order = self.orders[key] = PoolOrder()
        firsts = first_refs_into(in_pool, refs) if in_pool else None
        if in_pool:
            order.carvers.add(info.id)
        if order.defer(info.id, in_pool, firsts):
            return None  # alone in its pool: registered when a second capture joins it
        checked = order.add_graph(info.id, in_pool, refs, firsts)
        counted = tuple(order.carvers) if len(order.sequence) > 1 else ()
        return Joined(order, (*checked, *order.new_overwriters()), counted)

    def _order_of(self, gid: GraphId) -> PoolOrder | None:
        g = self.graphs.get(gid)
        return self.orders.get((g.info.device, g.info.pool)) if g is not None else None

    def forget(self, gid: GraphId) -> None:
        """The graph is gone (call before the tracker forgets it): it reads nothing any more."""
        order = self._order_of(gid)
        if order is not None:
            order.forget(gid)
        self.eager.forget(gid)

    def judges(self, wb: WatchedBlock) -> bool:
        """Every graph watching the freed pool block carved it or reads it as another graph's
        output, which the pool's replay order judges: a later capture re-carving it is legal in
        capture order (graphs whose user drops an earlier graph's output between captures)."""
        if not self.enabled or not wb.graphs:
            return False
        for gid in wb.graphs:
            order = self._order_of(gid)
            if order is None or not order.judges(gid, wb.address):
                return False
        return True

    def released(self, wb: WatchedBlock, in_capture: bool) -> None:
        """A block of a pool went back to it while graphs watched it (the tracker handed it to
        the order): the pool's order remembers after which capture (`PoolOrder.release`)."""
        if not self.enabled:
            return
        for gid in wb.graphs:
            g = self.graphs.get(gid)
            if g is not None and g.info.pool == wb.pool:
                order = self.orders.get((g.info.device, wb.pool))
                if order is not None:
                    order.release(wb.address, wb.size, in_capture)
                return

    # -- replay -------------------------------------------------------------------------------
    def judge(
        self,
        state: GraphState,
        when: Callable[[], When],
        view: Callable[[], SegmentIndex] | None,
    ) -> list[Finding]:
        """The findings of the order on a replay of `state`'s graph now: ranges it would read
        from the wrong writer, and (where `view` gives the allocator as of now) outputs and
        eager tensors the caller holds that it would write over. `when` gives the phase, the
        step and the judgement, asked only where there is something to report."""
        info = state.info
        findings: list[Finding] = []
        hazards = self.hazards(state)
        if hazards:
            now = when()
            findings += [self._finding(info, c, now) for c in hazards]
        if view is None:
            return findings
        overs = self.overwritten(state)
        if overs:
            findings += self.live_outputs(info, overs, view(), when())
        eager = self.eager.marked(info.id)
        if eager:
            findings += self.eager_outputs(info, eager, state.blocks, view(), when())
        return findings

    def hazards(self, state: GraphState) -> list[Conflict]:
        """The ranges a replay of the graph now would read from the wrong writer."""
        if not state.reads:
            return []
        order = self.orders.get((state.info.device, state.info.pool))
        return order.hazards(state.info.id) if order is not None else []

    def overwritten(self, state: GraphState) -> list[Overwrite]:
        """The later graphs' outputs a replay of the graph now would write over, if the caller
        still holds them (`live_outputs` asks the allocator)."""
        if not state.reads:
            return []
        order = self.orders.get((state.info.device, state.info.pool))
        return order.overwritten(state.info.id) if order is not None else []

    def live_outputs(
        self, info: GraphInfo, overs: list[Overwrite], view: SegmentIndex, when: When
    ) -> list[Finding]:
        """A live-output finding per block the caller holds in the ranges of `overs`: memory a
        later graph of the pool carved as its output, and that graph's latest carve there."""
        order = self.orders[(info.device, info.pool)]
        out: list[Finding] = []
        seen: set[DataPtr] = set()
        for o in overs:
            if o.pending is not None:  # the pool has it back: the caller's tensor owns nothing
                block = (o.start, o.end - o.start)
                out.append(self._live_output(info, order, o, block, when))
                continue
            for seg in view.segments_in(o.start, o.end):
                if seg.pool != info.pool:
                    continue
                blk = seg.allocated_in(o.start, o.end)
                if blk is None or blk.address in seen:
                    continue
                if order.producer_at(max(blk.address, o.start)) != o.producer:
                    continue  # another capture carved it since, or eager code allocated it
                seen.add(blk.address)
                block = (blk.address, blk.size)
                out.append(self._live_output(info, order, o, block, when))
        return out

    def eager_outputs(
        self,
        info: GraphInfo,
        tensors: list[EagerTensor],
        watched: Container[DataPtr],
        view: SegmentIndex,
        when: When,
    ) -> list[Finding]:
        """A live-output finding per eager tensor (`EagerInPools.replaying`) whose block the
        allocator still holds, except blocks the graph watches (the tracker judges those); the
        marks of the others go."""
        out: list[Finding] = []
        for t in tensors:
            seg = view.segment_at(t.start)
            blk = seg.allocated_in(t.start, t.end) if seg is not None else None
            if seg is None or seg.pool != info.pool or blk is None or blk.address != t.start:
                self.eager.gone(t)
                continue
            if t.start in watched:
                continue
            order = self.orders.get((info.device, info.pool))
            ref = order.first_ref(info.id, t.start, t.end) if order is not None else None
            now = (
                "holds a tensor eager code allocated into the pool (use_mem_pool or "
                f"begin-allocate-to-pool){t.when}, after this graph's capture, "
                "over memory the capture carved; the caller still holds it and this replay "
                "writes over it"
            )
            ref = ref or Reference(-1, "", "", 0, t.start)
            block = (t.start, t.size)
            out.append(self._order_finding(Kind.LIVE_OUTPUT, info, ref, block, t.site, now, when))
        return out

    def _live_output(
        self,
        info: GraphInfo,
        order: PoolOrder,
        o: Overwrite,
        block: tuple[DataPtr, int],
        when: When,
    ) -> Finding:
        # no argument names the range (a pointer table, say): the range itself is the address
        ref = order.first_ref(o.writer, o.start, o.end) or Reference(-1, "", "", 0, o.start)
        last_mine = order.last.get(o.writer)
        mine = f"#{last_mine}" if last_mine else "none since capture"
        held = (
            "still held by the caller"
            if o.pending is None
            else f"which the pool got back at capture only after {self._who(o.pending)} was "
            "captured, and that graph has not replayed since"
        )
        now = (
            f"holds the output of {self._who(o.producer)} from the pool's replay "
            f"#{order.last.get(o.producer)}, {held}; this replay would be "
            f"#{order.clock + 1} and writes over it (this graph's last replay: {mine})"
        )
        replays = (order.last.get(o.producer, 0), order.clock + 1)
        evidence = OrderEvidence(written_by=o.producer, replays=replays)
        return self._order_finding(Kind.LIVE_OUTPUT, info, ref, block, o.site, now, when, evidence)

    def _order_finding(
        self,
        kind: Kind,
        info: GraphInfo,
        ref: Reference,
        block: tuple[DataPtr, int],
        site: object,
        now: str,
        when: When,
        evidence: OrderEvidence | None = None,
    ) -> Finding:
        """A finding of the pool's order: `ref` is the graph's argument, `block` (start, size)
        the range, `site` the producer's carve site."""
        return Finding.at(
            kind,
            info,
            ref,
            when,
            evidence,
            block=block,
            pool=pool_name(info.pool, info.pool),
            alloc_stack=tuple(self.site_frames(site)),
            now=now,
        )

    def _who(self, gid: GraphId) -> str:
        g = self.graphs.get(gid)
        return f"graph #{gid} '{g.info.label}'" if g is not None else f"graph #{gid} (gone)"

    def _finding(self, info: GraphInfo, c: Conflict, when: When) -> Finding:
        who = self._who
        now = (
            f"written by {who(c.producer)}; {who(c.carver)} also carved it in this pool "
            f"and has replayed since the writer last did: the range holds its data"
        )
        return self._order_finding(
            Kind.REPLAY_ORDER,
            info,
            c.ref,
            (c.start, c.end - c.start),
            c.site,
            now,
            when,
            OrderEvidence(written_by=c.producer, carved_by=c.carver),
        )

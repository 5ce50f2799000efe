"""The replay check, in one place (pure: what it asks of memory goes through `MemorySource`).

`ReplayJudge` owns the rules for when a replay of a watched graph is judged, and judges it:

1. `needs(state)`, on every replay (the graph hooks ask it before calling the sanitizer): the
   graph's memory may have changed (`dirty`: a free, memory given back, an eager tensor in its
   pool, a watch that asks before every replay), or it reads another graph's range of a shared
   pool and the pool's graphs have not replayed in capture order;
   Or something it baked at capture beside addresses changed (a module it ran was switched
   between train and eval, an entry re-registered; both marked by hooks), or a param group's
   hyperparameter or tensor it took differs now (`core.baked.Baked.changed`, looked at here);
2. `verdict(state)`: the pool's replay order (`core.pool_orders`: replay-order and live-output
   findings), then, where something the graph uses was freed, the pointer tables that named it
   read again and the tracker's judgement of the graph's memory (`core.tracker`: freed,
   reowned, moved, unmapped, pool-reuse), then what it baked (`core.baked`: mode, baked-value,
   superseded);
3. `decided(state, stopped)`: the policy's outcome, kept in the graph's state (a stopped graph
   stays blocked; one stopped before its first launch has its own memory kept alive where the
   watch allocates it at launch).

Only the judge and the tracker change a graph's state (`core.graph_state`), and a test keeps it
so. The capture analysis hands each new graph to the judge (`watch`, `join_order`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from graphsan.core.baked import Baked, BakedWatch, Unwatched
from graphsan.core.graph_state import GraphState
from graphsan.core.kinds import Kind
from graphsan.core.memory_map import SegmentIndex
from graphsan.core.memory_source import MemorySource
from graphsan.core.pool_orders import Carves, ReplayOrders
from graphsan.core.races import Footprint, Race, Races
from graphsan.core.records import (
    DEFAULT_POOL,
    HOST_POOL,
    Finding,
    GraphId,
    GraphInfo,
    Judged,
    OrderEvidence,
    Reference,
    When,
    pool_name,
)
from graphsan.core.streams import Streams
from graphsan.core.tracker import Tracker


@dataclass(frozen=True)
class Verdict:
    """A replay's findings, and whether the graph's memory was judged (not only its pool's
    order): the timeline and the graph's stats count those."""

    findings: list[Finding]
    judged: bool


class ReplayJudge:
    """Judges replays of the tracker's graphs (see the module); `phase()` gives the program's
    phase and step, `rank` the process's rank."""

    def __init__(
        self,
        tracker: Tracker,
        orders: ReplayOrders,
        memory: MemorySource,
        phase: Callable[[], tuple[str | None, int | None]] = lambda: (None, None),
        rank: int | None = None,
        baked: BakedWatch = Unwatched(),
        races: Races | None = None,
        streams: Streams | None = None,
    ) -> None:
        self.tracker, self.orders, self.memory = tracker, orders, memory
        self.phase, self.rank = phase, rank
        self.baked = baked  # where hooks saw baked modes and entries change
        # the graphs' footprints and their replays' order across streams, and what the device
        # says of its streams (None: every replay is taken to run on one stream)
        self.races, self.streams = races, streams

    # -- capture ------------------------------------------------------------------------------
    def watch(self, state: GraphState, baked: Baked | None = None) -> None:
        """A graph was captured, having baked `baked` beside addresses: under a watch that finds
        frees by asking, every replay is judged."""
        state.depends_on(baked)
        if self.memory.judges_every_replay:
            state.mark_changed()

    def join_order(
        self, info: GraphInfo, carved: Carves, refs: list[Reference], view: SegmentIndex
    ) -> None:
        """The capture joins its pool's replay order; the graphs it involves are told."""
        joined = self.orders.add_capture(info, carved, refs, view)
        if joined is None:
            return
        graphs = self.tracker.graphs
        for gid in joined.checked:
            g = graphs.get(gid)
            if g is not None:
                g.checked_against(joined.order)
        for gid in joined.counted:
            g = graphs.get(gid)
            if g is not None:
                g.counted_in(joined.order)

    def footprint(self, info: GraphInfo, carved: Carves) -> None:
        """What a replay of the graph writes (its carves) and what else in graph pools it
        touches: the memory another stream's replay may race with (default-pool memory is no
        graph's to write)."""
        state = self.tracker.graphs.get(info.id)
        if self.races is None or state is None:
            return
        pooled = [
            (wb.address, wb.address + wb.size)
            for wb in state.blocks.values()
            if wb.pool not in (DEFAULT_POOL, HOST_POOL)
        ]
        self.races.add(info.id, Footprint.of(list(carved), pooled))

    def forget(self, gid: GraphId) -> None:
        if self.races is not None:
            self.races.forget(gid)

    # -- replay -------------------------------------------------------------------------------
    def needs(self, state: GraphState) -> bool:
        """Whether this replay is judged: the hot path, three attribute reads when nothing is
        pending (and a look at the few param-group entries of a graph that stepped an
        optimizer); for a graph whose memory another graph's replay may touch, the current
        stream, and while replays run on more than one stream, the replays in flight there."""
        racing = self.races is not None and self._racing(state) is not None  # notes the stream
        return (
            racing
            or state.dirty
            or (state.reads and not state.read_order.in_order(state.info.id))
            or (state.baked is not None and state.baked.polls and state.baked.changed())
        )

    def replayed(self, state: GraphState) -> None:
        """The graph's replay was launched: its pool's order counts it, and its stream's
        replays in flight hold it."""
        if state.order is not None:  # it wrote what it carved in its pool
            state.order.replayed(state.info.id)
        if state.stream is not None and self.races is not None:
            with self.races.lock:
                self.races.launched(state.info.id, state.stream)

    def _race_finding(self, state: GraphState, race: Race) -> Finding:
        """A `replay-race` finding: this graph's first reference into the shared range (its
        own carve where it references none), the other graph and both streams."""
        info = state.info
        ref = next(
            (r for refs in state.refs.values() for r in refs if race.start <= r.address < race.end),
            Reference(-1, "", "", 0, race.start),
        )
        other = self.tracker.graphs.get(race.other)
        who = f"graph #{race.other} '{other.info.label}'" if other is not None else "a graph"
        when = self._when()
        now = (
            f"{who} was replayed on stream {race.other_stream[1]:#x} and may still run: nothing "
            f"orders this replay on stream {race.stream[1]:#x} after it, and both touch this "
            f"range (graph #{race.writer} writes it)"
        )
        evidence = OrderEvidence(
            written_by=race.other, streams=(int(race.stream[1]), int(race.other_stream[1]))
        )
        return Finding.at(
            Kind.REPLAY_RACE,
            info,
            ref,
            when,
            evidence,
            block=(race.start, race.end - race.start),
            pool=pool_name(info.pool, info.pool),
            alloc_stack=tuple(self.orders.site_frames(race.site)),
            now=now,
        )

    def _racing(self, state: GraphState) -> Race | None:
        """The race of the replay about to launch, if any (see `core.races`)."""
        races = self.races
        if state.info.id not in races.footprints:
            return None
        stream = self.streams.current()
        state.replaying_on(stream)
        used = races.streams_used
        if len(used) < 2 and (not used or stream in used):
            return None  # every replay so far ran on this stream: nothing to race with
        with races.lock:
            return races.racing(state.info.id, stream, self.streams.busy)

    def verdict(self, state: GraphState) -> Verdict:
        """The findings of a replay of the graph now, before its launch."""
        memory, info = self.memory, state.info
        findings = self.orders.judge(state, self._when, memory.held(info.device))
        memory.prepare(state)
        judging = state.dirty and any(wb.freed is not None for wb in state.blocks.values())
        if judging:
            self._reread_tables(state)
            as_of = self.tracker.free_seq  # frees after this are not in the view yet
            view = memory.view(info.device)
            judged = Judged(self.rank, time.time(), memory.last_release)
            findings += self.tracker.judge(info.id, view, memory.mapped, as_of, judged)
        else:
            state.judged(again=False)  # nothing the graph uses was freed: nothing to judge
        if state.baked is not None:
            findings += state.baked.findings(info, self._when(), self.baked)
        race = self._racing(state) if self.races is not None else None
        if race is not None:
            findings.append(self._race_finding(state, race))
        if memory.judges_every_replay or self.orders.eager.marks.get(info.id):
            state.mark_changed()  # the next replay asks the driver or the allocator again
        return Verdict(findings, judging)

    def decided(self, state: GraphState, stopped: bool) -> int:
        """The policy stopped the replay, or let it launch. A graph stopped before its first
        launch whose memory the allocator makes at launch has what Python holds there kept
        alive (freeing memory a graph never allocated aborts PyTorch); returns how many
        storages were kept."""
        if not stopped:
            state.went_ahead()
            return 0
        state.block()
        if state.launched or not state.own:
            return 0
        return self.memory.keep_alive(state.drop_own())

    def _when(self) -> When:
        phase, step = self.phase()
        return When(phase, step, Judged(self.rank, time.time()))

    def _reread_tables(self, state: GraphState) -> None:
        """The pointer tables that named a freed block are read again, and a reference the
        table no longer holds (it was rewritten) is dropped."""
        stale = {}  # freed block -> its indirect references
        for addr, wb in state.blocks.items():
            if wb.freed is not None:
                refs = state.refs.get(addr, ())
                if any(r.through is not None for r in refs):
                    stale[addr] = refs
        if not stale:
            return
        tables = sorted(
            {
                r.through
                for refs in stale.values()
                for r in refs
                if r.through is not None
                and r.through in state.blocks
                and state.blocks[r.through].freed is None  # a freed table is a finding itself
            }
        )
        spans = [(t, state.blocks[t].size) for t in tables]
        words = {}
        for t, data in zip(tables, self.memory.read_device(spans), strict=True):
            if data:
                words[t] = {
                    int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data) - 7, 8)
                }
        for addr, refs in stale.items():
            keep = [r for r in refs if r.through not in words or r.address in words[r.through]]
            if len(keep) != len(refs):
                self.tracker.retain(state.info.id, addr, keep)

"""The pure core: graph references x memory events -> findings.

Nothing here touches CUDA. The CUDA-facing adapters (`graphsan.cuda`) feed it plain
records: the references a captured graph holds (`Reference`), a view of the caching allocator
(`graphsan.core.memory_map`), and memory events as they
happen (`on_free`, `on_alloc`, `on_release`). `Tracker.judge` turns a graph's stale references
into `Finding`s.

The rules, in one place:
- A reference is *watched* when its block was allocated at capture end and lives outside the
  graph's own temporaries: the default pool, another graph's pool, or persistent blocks of the
  graph's own pool. Foreign memory (not the caching allocator's) cannot be watched.
- A watched block that is freed marks its graphs *dirty*; only dirty graphs are judged, so a
  replay with nothing new costs one attribute check.
- Judging looks at where the freed block's memory is now: not mapped -> "unmapped"; freed by a
  storage change (resize_, set_, .data =) -> "moved"; part of a new allocation -> "pool-reuse" in
  a private pool, "reowned" in the default pool; free in the default pool -> "freed". Freed but
  unused memory of a private pool is harmless while the pool lives (nobody else can get it) and
  is kept under watch instead.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Iterable

from graphsan.core.graph_state import GraphState, WatchedBlock
from graphsan.core.kinds import Kind
from graphsan.core.memory_map import Block, MemoryMap, Segment, all_pages_mapped
from graphsan.core.records import (
    DEFAULT_POOL,
    FREED_BEFORE_CAPTURE,
    HOST_POOL,
    MOVE_OPS,
    DataPtr,
    Finding,
    Frame,
    FreeEvent,
    GraphId,
    GraphInfo,
    Judged,
    OtherUse,
    Reference,
    ReferenceCounts,
    Release,
    When,
    display_path,
    pool_name,
)

_UNSEEN = object()
_node = operator.itemgetter(0)  # Reference.node


class Tracker:
    """Holds the watched blocks of all live graphs and judges graphs on request.

    What it asks of its neighbours comes through the constructor: `graphs`, the dict of live
    graphs it shares with the replay orders (`core.pool_orders`), which read it; `host_owner(start,
    end)`, the live pinned host block overlapping the range (address, size, frames);
    `order_reads(block)`, whether the pool's replay order (`core.pool_order`) judges every graph that
    reads the block: then a free outside a capture hands it over, like one inside a capture; and
    `handed_over(block, in_capture)`, told of each such hand-over."""

    def __init__(
        self,
        graphs: dict[GraphId, GraphState] | None = None,
        host_owner: Callable[[DataPtr, DataPtr], object | None] | None = None,
        order_reads: Callable[[WatchedBlock], bool] | None = None,
        handed_over: Callable[[WatchedBlock, bool], None] | None = None,
    ) -> None:
        self.graphs: dict[GraphId, GraphState] = {} if graphs is None else graphs
        self.live: dict[DataPtr, WatchedBlock] = {}  # watched blocks not yet freed
        self.freed_segments: dict[tuple[DataPtr, int], set[GraphId]] = {}
        self._freed_seg_keys: list[tuple[DataPtr, int]] = []  # sorted by start
        self._freed_seg_starts: list[DataPtr] = []
        self.free_seq = 0  # watched frees recorded so far (see judge's as_of)
        self.host_owner = host_owner
        self.order_reads = order_reads
        self.handed_over = handed_over
        self._on_watch: Callable[[list[DataPtr]], None] | None = None
        self._on_freed_segments: Callable[[list[tuple[DataPtr, int]]], None] | None = None

    def mirror(
        self,
        on_watch: Callable[[list[DataPtr]], None] | None,
        on_freed_segments: Callable[[list[tuple[DataPtr, int]]], None] | None = None,
    ) -> None:
        """An adapter that filters allocator events outside Python mirrors what is watched:
        `on_watch(addresses)` is told the addresses about to be watched (before a free can find
        them), `on_freed_segments(keys)` the freed segments whenever they change; None, None
        stops the mirroring."""
        self._on_watch = on_watch
        self._on_freed_segments = on_freed_segments

    @property
    def mirrored(self) -> Callable[[list[DataPtr]], None] | None:
        """Who is told of newly watched addresses (see `mirror`)."""
        return self._on_watch

    # -- capture -----------------------------------------------------------------------------
    def add_graph(
        self,
        info: GraphInfo,
        refs: Iterable[Reference],
        memmap: MemoryMap,
        host: Callable[[DataPtr], object | None] | None = None,
        own: Iterable[tuple[DataPtr, int]] = (),
    ) -> GraphState:
        """Register a freshly captured graph; returns its state (with capture statistics).
        `host(address)`: the live pinned host block (address, size, frames) holding a memcpy
        node's address, if any; `own`: the graph's memory-allocation nodes (address, size)."""
        by_block: dict[DataPtr, list[Reference]] = {}
        blocks: dict[DataPtr, WatchedBlock] = {}
        counts = dict.fromkeys(("default", "own", "other", "foreign", "temporary", "host"), 0)
        stale_at_capture: list[WatchedBlock] = []
        watched: list[WatchedBlock] = []
        located: dict[DataPtr, object] = {}  # a graph names the same addresses many times
        for ref in refs:
            hit = located.get(ref.address, _UNSEEN)
            if hit is _UNSEEN:
                hit = located[ref.address] = memmap.locate(ref.address)
            if hit is None and host is not None and isinstance(ref.param, str):
                hb = host(ref.address)
                if hb is not None:
                    blk = Block(hb.address, hb.size, "active_allocated", list(hb.frames))
                    hit = Segment(hb.address, hb.size, HOST_POOL, False, [blk]), blk
            if hit is None:
                counts["foreign"] += 1
                continue
            seg, blk = hit
            if seg.pool == HOST_POOL:
                cls = "host"
            elif seg.pool == DEFAULT_POOL:
                cls = "default"
            else:
                cls = "own" if info.pool is not None and seg.pool == info.pool else "other"
            if not blk.allocated and seg.pool != DEFAULT_POOL:
                counts["temporary"] += 1  # pool memory the graph owns between replays
                continue
            counts[cls] += 1
            wb = blocks.get(blk.address)
            if wb is None:
                wb = self.live.get(blk.address)
                if wb is None or wb.size != blk.size or wb.freed is not None:
                    wb = WatchedBlock(
                        blk.address,
                        blk.size,
                        seg.pool,
                        (seg.address, seg.size),
                        blk.frames,
                    )
                    if blk.allocated:
                        watched.append(wb)  # in live below, once the adapter was told
                    else:  # default-pool memory already free when the capture ended
                        wb.freed = FreeEvent((), None, None, FREED_BEFORE_CAPTURE)
                        stale_at_capture.append(wb)
                blocks[blk.address] = wb
            wb.graphs.add(info.id)
            by_block.setdefault(blk.address, []).append(ref)
        for rs in by_block.values():
            rs.sort(key=_node)
        state = GraphState(info, by_block, blocks, ReferenceCounts(**counts), own=tuple(own))
        self.graphs[info.id] = state
        if watched and self._on_watch is not None:
            self._on_watch([wb.address for wb in watched])  # before a free can find them
        for wb in watched:
            self.live[wb.address] = wb
        for wb in stale_at_capture:
            self._note_freed_segment(wb)
        if stale_at_capture:
            state.mark_changed()
        return state

    def forget(self, graph_id: GraphId) -> None:
        """The graph was reset or destroyed: its references no longer matter."""
        state = self.graphs.pop(graph_id, None)
        if state is None:
            return
        for wb in state.blocks.values():
            wb.graphs.discard(graph_id)
            if not wb.graphs and self.live.get(wb.address) is wb:
                del self.live[wb.address]
        for key in list(self.freed_segments):
            self.freed_segments[key].discard(graph_id)
            if not self.freed_segments[key]:
                del self.freed_segments[key]
        self._index_freed_segments()

    # -- memory events (hot: keep them cheap) ----------------------------------------------
    def on_free(self, ptr: DataPtr, event_factory: Callable[[], FreeEvent]) -> bool:
        """A block at `ptr` was freed. Returns True when it was watched."""
        self.on_alloc(ptr)  # the owner of memory near freed watched memory changed
        wb = self.live.pop(ptr, None)
        if wb is None:
            return False
        self.free_seq += 1
        wb.freed = event_factory()
        wb.freed.seq = self.free_seq
        in_capture = wb.freed.capture_pool == wb.pool
        if wb.pool != DEFAULT_POOL and (
            in_capture or (self.order_reads is not None and self.order_reads(wb))
        ):
            self._hand_over(wb, in_capture)
            return True
        for gid in wb.graphs:
            self.recheck(gid)
        self._note_freed_segment(wb)
        return True

    def _hand_over(self, wb: WatchedBlock, in_capture: bool) -> None:
        """A capture into the block's own pool consumed it (autograd freeing saved activations
        while the backward graph is captured, as make_graphed_callables and TE do): the pool is
        shared by design, graphs replay in capture order, and the block is no longer watched."""
        for gid in wb.graphs:
            g = self.graphs.get(gid)
            if g is not None:
                g.hand_over(wb.address)
        if self.handed_over is not None:
            self.handed_over(wb, in_capture)

    def retain(self, graph_id: GraphId, address: DataPtr, refs: list[Reference]) -> None:
        """Keep only `refs` of the graph's references to the block at `address` (a pointer table
        re-read at judgement no longer names it); with none left the graph lets the block go."""
        state = self.graphs.get(graph_id)
        if state is None or address not in state.refs:
            return
        if refs:
            state.refs[address] = refs
            return
        del state.refs[address]
        wb = state.blocks.pop(address, None)
        if wb is not None:
            wb.graphs.discard(graph_id)
            if not wb.graphs and self.live.get(address) is wb:
                del self.live[address]

    def on_alloc(self, ptr: DataPtr) -> None:
        """A block was allocated or freed at `ptr`: if that is inside a segment holding freed
        memory a graph references, the memory's owner changed (re-carved, or given back again)
        and the graphs concerned must be judged again."""
        starts = self._freed_seg_starts
        if not starts:
            return
        i = bisect.bisect_right(starts, ptr) - 1
        if i < 0:
            return
        start, size = self._freed_seg_keys[i]
        if ptr < start + size:
            for gid in list(self.freed_segments.get((start, size), ())):
                self.recheck(gid)

    def on_release(self) -> None:
        """Cached memory went back to the driver (empty_cache): freed references may be unmapped."""
        for gids in list(self.freed_segments.values()):
            for gid in list(gids):
                self.recheck(gid)

    def recheck(self, gid: GraphId) -> None:
        """Something the graph depends on may have changed (a free, memory given back, an
        eager tensor in its pool, pins to take): its next replay is judged."""
        g = self.graphs.get(gid)
        if g is not None:
            g.mark_changed()

    def _index_freed_segments(self) -> None:
        self._freed_seg_keys = sorted(self.freed_segments)
        self._freed_seg_starts = [k[0] for k in self._freed_seg_keys]
        if self._on_freed_segments is not None:
            self._on_freed_segments(self._freed_seg_keys)

    def _note_freed_segment(self, wb: WatchedBlock) -> None:
        self.freed_segments.setdefault(wb.segment, set()).update(wb.graphs)
        self._index_freed_segments()

    # -- judgement ---------------------------------------------------------------------------
    def judge(
        self,
        graph_id: GraphId,
        memmap: MemoryMap,
        is_mapped: Callable[[DataPtr], bool] | None = None,
        as_of: int | None = None,
        judged: Judged | None = None,
    ) -> list[Finding]:
        """Findings for every freed block the graph references (the graph is clean afterwards).
        `judged` adds the rank, the time and the last release to memory to each finding.

        `as_of`: `free_seq` read before `memmap` was taken. A free recorded after it (on
        another thread) is not in the snapshot, whose block would look re-owned by itself; it
        is left for the next replay, and the graph stays dirty."""
        judged = judged or Judged()
        state = self.graphs[graph_id]
        state.judged(again=False)  # before the look: a free arriving meanwhile marks it again
        findings = []
        for addr, wb in list(state.blocks.items()):  # frees may arrive from autograd threads
            if wb.freed is None:
                continue
            if as_of is not None and wb.freed.seq > as_of:
                state.mark_changed()
                continue
            kind, now = self._classify(wb, memmap, is_mapped, state.info, judged.release)
            if kind is None:
                continue
            refs = state.refs.get(addr)
            if not refs:
                continue  # handed over meanwhile
            first = refs[0]
            findings.append(
                Finding.at(
                    kind,
                    state.info,
                    first,
                    When(wb.freed.phase, wb.freed.step, judged),
                    block=(wb.address, wb.size),
                    pool=pool_name(wb.pool, state.info.pool),
                    alloc_stack=wb.alloc_stack,
                    free_stack=wb.freed.stack,
                    free_op=wb.freed.op,
                    now=now,
                    other_nodes=len({r.node for r in refs}) - 1,
                    also_used_by=self._other_users(wb, graph_id),
                    freed_at=wb.freed.time,
                    through=first.through,
                    through_slot=first.slot if first.through is not None else None,
                    host=wb.pool == HOST_POOL,
                    caveat=first.caveat if all(r.caveat for r in refs) else None,
                )
            )
        return findings

    def _other_users(self, wb: WatchedBlock, graph_id: GraphId) -> tuple[OtherUse, ...]:
        out = []
        for gid in sorted(wb.graphs - {graph_id}):
            g = self.graphs.get(gid)
            refs = g.refs.get(wb.address) if g is not None else None
            if refs:
                r = refs[0]
                out.append(OtherUse(gid, g.info.label, r.node, r.kernel, r.param, r.offset))
        return tuple(out)

    def _classify(
        self,
        wb: WatchedBlock,
        memmap: MemoryMap,
        is_mapped: Callable[[DataPtr], bool] | None,
        info: GraphInfo,
        release: Release | None = None,
    ) -> tuple[Kind | None, str]:
        end = wb.address + wb.size
        if wb.pool == HOST_POOL:
            owner = self.host_owner(wb.address, end) if self.host_owner is not None else None
            if owner is not None:
                where = _frame_line(list(owner.frames))
                return Kind.REOWNED, f"part of a live {owner.size} B pinned block{where}"
            return Kind.FREED, "back in PyTorch's pinned-memory cache; any pin_memory() may take it"
        # after empty_cache the range may have been handed out again, as several segments of
        # several pools: every one of them counts
        segs = memmap.segments_in(wb.address, end)
        if (
            not segs
            or segs[0].block_at(wb.address) is None
            or not memmap.covers(wb.address, end)
            or (
                is_mapped is not None and not all_pages_mapped(wb.address, wb.size, segs, is_mapped)
            )
        ):
            now = "the address is no longer mapped: the replay would fault"
            if release is not None:
                where = _file_line(release.stack[-1]) if release.stack else "?"
                when = f"phase {release.phase}, step {release.step}"
                now += f"; cached memory was released by empty_cache() at {where} ({when})"
            return Kind.UNMAPPED, now
        moved = wb.freed.op in MOVE_OPS if wb.freed else False
        for seg in segs:
            blk = seg.allocated_in(wb.address, end)
            if blk is None:
                continue
            where = _frame_line(blk.frames)
            owner = self._graph_using(blk.address, exclude=info.id)
            if moved:
                return Kind.MOVED, f"the old memory now belongs to a {blk.size} B block{where}"
            if seg.pool != DEFAULT_POOL:
                by = f" by {owner.describe()}" if owner else ""
                return Kind.POOL_REUSE, f"re-carved{by} as a {blk.size} B block{where}"
            return Kind.REOWNED, f"part of a live {blk.size} B allocation{where}"
        if moved:
            return Kind.MOVED, "the old memory is free in the allocator's cache"
        if wb.pool != DEFAULT_POOL and all(seg.pool == wb.pool for seg in segs):
            return None, ""  # free in its own private pool: nobody else can have it yet
        return Kind.FREED, "free in the allocator's cache; any allocation may take it"

    def _graph_using(self, addr: DataPtr, exclude: GraphId) -> GraphInfo | None:
        for gid, g in self.graphs.items():
            if gid != exclude and addr in g.blocks and g.blocks[addr].freed is None:
                return g.info
        return None


def _file_line(frame: Frame) -> str:
    """`file:line` of a frame, the path as the stacks print it."""
    return f"{display_path(frame[0])}:{frame[1]}"


def _frame_line(frames: list[Frame]) -> str:
    """` allocated at file:line` of the innermost frame."""
    return f" allocated at {_file_line(frames[-1])}" if frames else ""

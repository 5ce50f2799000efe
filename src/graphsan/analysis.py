"""The pure core: graph references x memory events -> findings.

Nothing here touches CUDA. The CUDA-facing adapters (`capture`, `memory`, `_driver`) feed it plain
records: the references a captured graph holds (`Reference`), a view of the caching allocator
(`MemoryMap`, built from `torch.cuda.memory._snapshot()`-shaped dicts), and memory events as they
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from graphsan.report import FREED_BEFORE_CAPTURE, Finding, Frame, GraphInfo, display_path

DataPtr = int
GraphId = int
PoolId = tuple[int, int]
DEFAULT_POOL: PoolId = (0, 0)


# ----------------------------------------------------------------------------- allocator view
@dataclass
class Block:
    """One block of the caching allocator, as a snapshot shows it."""

    address: DataPtr
    size: int
    state: str  # "active_allocated" | "active_pending_free" | "inactive"
    frames: list[Frame] = field(default_factory=list)

    @property
    def allocated(self) -> bool:
        return self.state.startswith("active")


@dataclass
class Segment:
    """One segment (a cudaMalloc or an expandable reservation) with its blocks in address order."""

    address: DataPtr
    size: int
    pool: PoolId
    expandable: bool
    blocks: list[Block]

    def allocated_in(self, start: DataPtr, end: DataPtr) -> Block | None:
        """The first allocated block overlapping [start, end), if any."""
        for b in self.blocks:
            if b.address < end and start < b.address + b.size and b.allocated:
                return b
        return None

    def block_at(self, addr: DataPtr) -> Block | None:
        starts = [b.address for b in self.blocks]
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < self.blocks[i].address + self.blocks[i].size:
            return self.blocks[i]
        return None


def _frames(raw: Iterable[dict[str, Any]] | None) -> list[Frame]:
    """Allocator frames (innermost first) -> our frames (outermost first, like tracebacks)."""
    out = [(f.get("filename", "?"), int(f.get("line", 0)), f.get("name", "?")) for f in raw or ()]
    out.reverse()
    return out


class MemoryMap:
    """Address lookup over the segments of an allocator snapshot."""

    def __init__(self, segments: list[Segment]):
        self.segments = sorted(segments, key=lambda s: s.address)
        self._starts = [s.address for s in self.segments]

    @classmethod
    def from_snapshot(
        cls,
        snapshot: dict[str, Any],
        device: int | None = None,
        frame_filter: Callable[[list[Frame]], list[Frame]] | None = None,
    ) -> MemoryMap:
        """`frame_filter` trims allocation stacks (e.g. to the user's own frames)."""
        segments = []
        for seg in snapshot.get("segments", ()):
            if device is not None and seg.get("device", device) != device:
                continue
            addr = int(seg["address"])
            blocks, cursor = [], addr
            for b in seg.get("blocks", ()):
                baddr = int(b.get("address", cursor))
                frames = _frames(b.get("frames"))
                if frame_filter is not None and frames:
                    frames = frame_filter(frames)
                blocks.append(Block(baddr, int(b["size"]), b["state"], frames))
                cursor = baddr + int(b["size"])
            pool = tuple(seg.get("segment_pool_id", DEFAULT_POOL))
            segments.append(
                Segment(
                    addr,
                    int(seg["total_size"]),
                    (int(pool[0]), int(pool[1])),
                    bool(seg.get("is_expandable", False)),
                    blocks,
                )
            )
        return cls(segments)

    def segment_at(self, addr: DataPtr) -> Segment | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self.segments[i].address + self.segments[i].size:
            return self.segments[i]
        return None

    def segments_in(self, start: DataPtr, end: DataPtr) -> list[Segment]:
        """The segments overlapping [start, end), in address order."""
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        out = []
        for seg in self.segments[i:]:
            if seg.address >= end:
                break
            if seg.address + seg.size > start:
                out.append(seg)
        return out

    def covers(self, start: DataPtr, end: DataPtr) -> bool:
        """Whether segments cover all of [start, end). An expandable segment's snapshot lists
        only its mapped ranges, so a block whose pages were partly unmapped is not covered."""
        pos = start
        while pos < end:
            seg = self.segment_at(pos)
            if seg is None:
                return False
            pos = seg.address + seg.size
        return True

    def locate(self, addr: DataPtr) -> tuple[Segment, Block] | None:
        seg = self.segment_at(addr)
        if seg is None:
            return None
        blk = seg.block_at(addr)
        return (seg, blk) if blk is not None else None

    def bounds(self) -> tuple[int, int]:
        if not self.segments:
            return (0, 0)
        last = self.segments[-1]
        return (self.segments[0].address, last.address + last.size)


# ----------------------------------------------------------------------------- graph nodes
@dataclass
class KernelArgs:
    """A kernel node: its name and its device-side parameter block as bytes."""

    index: int
    name: str
    buffer: bytes
    offsets: list[int]  # start of each parameter inside `buffer` (empty when unknown)


@dataclass
class CopyArgs:
    """A memcpy or memset node: the device addresses it touches."""

    index: int
    kind: str  # "memcpy" | "memset"
    addresses: list[tuple[str, int]]  # ("src" | "dst", address)


@dataclass
class WalkStats:
    nodes: int = 0
    kernels: int = 0
    copies: int = 0
    unreadable: int = 0
    child_graphs: int = 0


def scan_words(buf: bytes, lo: int, hi: int, unaligned: bool = True) -> list[tuple[int, int]]:
    """(byte offset, value) of every little-endian 64-bit word in `buf` whose value lies in
    [lo, hi): at every byte offset, or (unaligned=False) at 8-byte-aligned ones only. The caller
    confirms each candidate against the allocator's map."""
    n = len(buf)
    if n < 8 or hi <= lo:
        return []
    raw = np.frombuffer(buf, dtype=np.uint8)
    out = []
    for align in range(8) if unaligned else (0,):
        count = (n - align) // 8
        if count <= 0:
            break
        words = raw[align : align + 8 * count].view("<u8")
        for i in np.nonzero((words >= lo) & (words < hi))[0]:
            out.append((align + 8 * int(i), int(words[i])))
    out.sort()
    return out


def references(
    nodes: Iterable[KernelArgs | CopyArgs],
    memmap: MemoryMap,
    foreign: Callable[[int], bool] | None = None,
    unaligned: bool = False,
) -> list[Reference]:
    """Every confirmed device address in the nodes' arguments.

    A kernel word counts when it is 8-byte aligned and falls inside a block of the allocator's
    map; words outside it count as foreign memory only when `foreign(value)` (a driver query)
    confirms them. Memcpy and memset addresses are taken as they are.

    Kernel parameters follow the C++ ABI, so a pointer sits at an 8-byte-aligned offset of the
    parameter buffer (inside structs too) unless a struct is declared packed. Unaligned words
    (`unaligned=True`, for such packed buffers) cost false alarms: on the H200 a pointer's zero
    high bytes followed by a small int64 (16384, a size) read at offset 13 as an address inside an
    18 MB block of the default pool.

    The aligned words of all kernels are compared in one vectorized pass, so a graph of
    thousands of nodes costs one numpy scan plus a lookup per candidate.
    """
    nodes = list(nodes)
    lo, hi = memmap.bounds()
    out: list[Reference] = []
    candidates: dict[int, list[tuple[int, int]]] = {}  # node position -> (offset, value)
    kernels = [(i, n) for i, n in enumerate(nodes) if isinstance(n, KernelArgs)]
    if unaligned:
        for i, n in kernels:
            candidates[i] = scan_words(n.buffer, lo, hi, True)
            if foreign is not None:
                candidates[i] += [
                    (off, v)
                    for off, v in scan_words(n.buffer, FOREIGN_LO, FOREIGN_HI, unaligned=False)
                    if not lo <= v < hi
                ]
    else:
        candidates = _aligned_candidates(kernels, lo, hi, foreign is not None)
    is_foreign: dict[int, bool] = {}
    for i, node in enumerate(nodes):
        if isinstance(node, CopyArgs):
            out += [Reference(node.index, node.kind, side, 0, a) for side, a in node.addresses]
            continue
        seen = set()
        for off, value in candidates.get(i, ()):
            if value in seen:
                continue
            if memmap.locate(value) is None:
                if foreign is None or off % 8 or lo <= value < hi:
                    continue
                known = is_foreign.get(value)
                if known is None:
                    known = is_foreign[value] = foreign(value)
                if not known:
                    continue
            seen.add(value)
            param, inner = _param_of(node.offsets, off)
            out.append(Reference(node.index, node.name, param, inner, value))
    return out


def _aligned_candidates(
    kernels: list[tuple[int, KernelArgs]], lo: int, hi: int, with_foreign: bool
) -> dict[int, list[tuple[int, int]]]:
    """(offset, value) of the 8-byte-aligned words that may be addresses, per node position:
    inside [lo, hi), or (with_foreign) anywhere device memory can be mapped."""
    bufs = [(i, n.buffer[: len(n.buffer) // 8 * 8]) for i, n in kernels if len(n.buffer) >= 8]
    if not bufs:
        return {}
    counts = np.array([len(b) // 8 for _, b in bufs])
    words = np.frombuffer(b"".join(b for _, b in bufs), dtype="<u8")
    mask = (words >= lo) & (words < hi)
    if with_foreign:
        mask |= (words >= FOREIGN_LO) & (words < FOREIGN_HI)
    hits = np.nonzero(mask)[0]
    if not len(hits):
        return {}
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    which = np.searchsorted(starts, hits, side="right") - 1
    out: dict[int, list[tuple[int, int]]] = {}
    for h, w in zip(hits.tolist(), which.tolist(), strict=True):
        out.setdefault(bufs[w][0], []).append((8 * (h - int(starts[w])), int(words[h])))
    return out


FOREIGN_LO, FOREIGN_HI = 1 << 32, 1 << 49  # where device virtual addresses live on x86-64


def _param_of(offsets: list[int], off: int) -> tuple[int, int]:
    if not offsets:
        return 0, off
    i = max(bisect.bisect_right(offsets, off) - 1, 0)
    return i, off - offsets[i]


# ----------------------------------------------------------------------------- graph references
class Reference(NamedTuple):
    """One device address found in one node's arguments (a tuple: graphs hold many)."""

    node: int
    kernel: str  # demangled kernel name, or "memcpy" / "memset"
    param: int | str
    offset: int
    address: DataPtr


@dataclass
class FreeEvent:
    """Where, when and how a watched block was freed."""

    stack: list[Frame]
    phase: str | None
    step: int | None
    op: str | None = None  # "resize_", "set_", ".data =", ... when a storage change freed it
    capture_pool: PoolId | None = None  # the pool a capture in progress was allocating from
    seq: int = 0  # the Tracker's count of watched frees when this one was recorded
    time: float | None = None  # time.time() of the free, for the report's timeline


@dataclass
class WatchedBlock:
    """A block that at least one live graph references."""

    address: DataPtr
    size: int
    pool: PoolId
    segment: tuple[DataPtr, int]
    alloc_stack: list[Frame]
    graphs: set[GraphId] = field(default_factory=set)
    freed: FreeEvent | None = None


@dataclass
class GraphState:
    info: GraphInfo
    refs: dict[DataPtr, list[Reference]]  # watched block address -> its references, node order
    blocks: dict[DataPtr, WatchedBlock]
    stats: dict[str, Any]
    dirty: bool = False
    reported: set[tuple[DataPtr, str]] = field(default_factory=set)


# Expandable segments map and unmap whole pages: 2 MiB in the small pool, 20 MiB in the large
# one. Asking the driver every 2 MiB sees every page of either.
PAGE = 2 << 20


def _all_mapped(
    wb: WatchedBlock, segs: list[Segment], is_mapped: Callable[[DataPtr], bool]
) -> bool:
    """Every page of the block that lies in an expandable segment is mapped: a block can straddle
    pages, and empty_cache unmaps a page as soon as no live block is left on it, so the first
    address is not enough. (The driver question only makes sense for expandable segments:
    cudaMalloc'd memory has no allocation handle to retain.)"""
    end = wb.address + wb.size
    for page in range(wb.address - wb.address % PAGE, end, PAGE):
        addr = max(page, wb.address)
        seg = next((s for s in segs if s.address <= addr < s.address + s.size), None)
        if seg is not None and seg.expandable and not is_mapped(addr):
            return False
    return True


def pool_name(pool: PoolId, own: PoolId | None) -> str:
    if pool == DEFAULT_POOL:
        return "default pool"
    if own is not None and pool == own:
        return f"graph's own private pool {pool}"
    return f"private pool {pool} of another graph"


class Tracker:
    """Holds the watched blocks of all live graphs and judges graphs on request."""

    def __init__(self) -> None:
        self.graphs: dict[GraphId, GraphState] = {}
        self.live: dict[DataPtr, WatchedBlock] = {}  # watched blocks not yet freed
        self.freed_segments: dict[tuple[DataPtr, int], set[GraphId]] = {}
        self._freed_seg_keys: list[tuple[DataPtr, int]] = []  # sorted by start
        self._freed_seg_starts: list[DataPtr] = []
        self.free_seq = 0  # watched frees recorded so far (see judge's as_of)

    # -- capture -----------------------------------------------------------------------------
    def add_graph(
        self, info: GraphInfo, refs: Iterable[Reference], memmap: MemoryMap
    ) -> GraphState:
        """Register a freshly captured graph; returns its state (with capture statistics)."""
        by_block: dict[DataPtr, list[Reference]] = {}
        blocks: dict[DataPtr, WatchedBlock] = {}
        counts = {"default": 0, "own": 0, "other": 0, "foreign": 0, "temporary": 0}
        stale_at_capture: list[WatchedBlock] = []
        for ref in refs:
            hit = memmap.locate(ref.address)
            if hit is None:
                counts["foreign"] += 1
                continue
            seg, blk = hit
            cls = (
                "default"
                if seg.pool == DEFAULT_POOL
                else ("own" if info.pool is not None and seg.pool == info.pool else "other")
            )
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
                        self.live[blk.address] = wb
                    else:  # default-pool memory already free when the capture ended
                        wb.freed = FreeEvent([], None, None, FREED_BEFORE_CAPTURE)
                        stale_at_capture.append(wb)
                blocks[blk.address] = wb
            wb.graphs.add(info.id)
            by_block.setdefault(blk.address, []).append(ref)
        for rs in by_block.values():
            rs.sort(key=lambda r: r.node)
        stats = {"references": sum(counts.values()), "watched_blocks": len(blocks), **counts}
        state = GraphState(info, by_block, blocks, stats)
        self.graphs[info.id] = state
        for wb in stale_at_capture:
            self._note_freed_segment(wb)
        state.dirty = bool(stale_at_capture)
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
        if wb.freed.capture_pool == wb.pool and wb.pool != DEFAULT_POOL:
            self._hand_over(wb)
            return True
        for gid in wb.graphs:
            g = self.graphs.get(gid)
            if g is not None:
                g.dirty = True
        self._note_freed_segment(wb)
        return True

    def _hand_over(self, wb: WatchedBlock) -> None:
        """A capture into the block's own pool consumed it (autograd freeing saved activations
        while the backward graph is captured, as make_graphed_callables and TE do): the pool is
        shared by design, graphs replay in capture order, and the block is no longer watched."""
        for gid in wb.graphs:
            g = self.graphs.get(gid)
            if g is not None:
                g.blocks.pop(wb.address, None)
                g.refs.pop(wb.address, None)
                g.stats["handed_over"] = g.stats.get("handed_over", 0) + 1

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
                self._mark_dirty(gid)

    def on_release(self) -> None:
        """Cached memory went back to the driver (empty_cache): freed references may be unmapped."""
        for gids in list(self.freed_segments.values()):
            for gid in list(gids):
                self._mark_dirty(gid)

    def _mark_dirty(self, gid: GraphId) -> None:
        g = self.graphs.get(gid)
        if g is not None:
            g.dirty = True

    def _index_freed_segments(self) -> None:
        self._freed_seg_keys = sorted(self.freed_segments)
        self._freed_seg_starts = [k[0] for k in self._freed_seg_keys]

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
    ) -> list[Finding]:
        """Findings for every freed block the graph references (the graph is clean afterwards).

        `as_of`: `free_seq` read before `memmap` was taken. A free recorded after it (on
        another thread) is not in the snapshot, whose block would look re-owned by itself; it
        is left for the next replay, and the graph stays dirty."""
        state = self.graphs[graph_id]
        state.dirty = False
        findings = []
        for addr, wb in list(state.blocks.items()):  # frees may arrive from autograd threads
            if wb.freed is None:
                continue
            if as_of is not None and wb.freed.seq > as_of:
                state.dirty = True
                continue
            kind, now = self._classify(wb, memmap, is_mapped, state.info)
            if kind is None:
                continue
            refs = state.refs.get(addr)
            if not refs:
                continue  # handed over meanwhile
            first = refs[0]
            findings.append(
                Finding(
                    kind=kind,
                    graph=state.info,
                    node=first.node,
                    kernel=first.kernel,
                    param=first.param,
                    offset=first.offset,
                    address=first.address,
                    nbytes=wb.size,
                    block_address=wb.address,
                    pool=pool_name(wb.pool, state.info.pool),
                    alloc_stack=wb.alloc_stack,
                    free_stack=wb.freed.stack,
                    phase=wb.freed.phase,
                    step=wb.freed.step,
                    free_op=wb.freed.op,
                    now=now,
                    other_nodes=len({r.node for r in refs}) - 1,
                    also_used_by=self._other_users(wb, graph_id),
                )
            )
        return findings

    def _other_users(self, wb: WatchedBlock, graph_id: GraphId) -> list[dict]:
        out = []
        for gid in sorted(wb.graphs - {graph_id}):
            g = self.graphs.get(gid)
            refs = g.refs.get(wb.address) if g is not None else None
            if refs:
                r = refs[0]
                out.append(
                    {"graph": gid, "label": g.info.label, "node": r.node, "kernel": r.kernel}
                    | {"param": r.param, "offset": r.offset}
                )
        return out

    def _classify(
        self,
        wb: WatchedBlock,
        memmap: MemoryMap,
        is_mapped: Callable[[DataPtr], bool] | None,
        info: GraphInfo,
    ) -> tuple[str | None, str]:
        end = wb.address + wb.size
        # after empty_cache the range may have been handed out again, as several segments of
        # several pools: every one of them counts
        segs = memmap.segments_in(wb.address, end)
        if (
            not segs
            or segs[0].block_at(wb.address) is None
            or not memmap.covers(wb.address, end)
            or (is_mapped is not None and not _all_mapped(wb, segs, is_mapped))
        ):
            return "unmapped", "the address is no longer mapped: the replay would fault"
        moved = wb.freed.op in MOVE_OPS if wb.freed else False
        for seg in segs:
            blk = seg.allocated_in(wb.address, end)
            if blk is None:
                continue
            where = _frame_line(blk.frames)
            owner = self._graph_using(blk.address, exclude=info.id)
            if moved:
                return "moved", f"the old memory now belongs to a {blk.size} B block{where}"
            if seg.pool != DEFAULT_POOL:
                by = f" by {owner.describe()}" if owner else ""
                return "pool-reuse", f"re-carved{by} as a {blk.size} B block{where}"
            return "reowned", f"part of a live {blk.size} B allocation{where}"
        if moved:
            return "moved", "the old memory is free in the allocator's cache"
        if wb.pool != DEFAULT_POOL and all(seg.pool == wb.pool for seg in segs):
            return None, ""  # free in its own private pool: nobody else can have it yet
        return "freed", "free in the allocator's cache; any allocation may take it"

    def _graph_using(self, addr: DataPtr, exclude: GraphId) -> GraphInfo | None:
        for gid, g in self.graphs.items():
            if gid != exclude and addr in g.blocks and g.blocks[addr].freed is None:
                return g.info
        return None


MOVE_OPS = ("resize_", "set_", ".data =", "storage.resize_")


def _frame_line(frames: list[Frame]) -> str:
    """` allocated at file:line` of the innermost frame, the path as the stacks print it."""
    if not frames:
        return ""
    filename, line, _ = frames[-1]
    return f" allocated at {display_path(filename)}:{line}"

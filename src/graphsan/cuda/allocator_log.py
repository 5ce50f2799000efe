"""The allocator's view as graphsan keeps it from the allocator's own event log: one
`AllocatorView` per device (`core.memory_map`), seeded by one snapshot and then brought up to date
at each drain (capture begin and end, before a replay is judged), and the allocations each capture
made (its carves).

- Each drain costs the events since the last one, not the blocks alive; a log that overflowed
  between two drains (or contradicts the view) reseeds it.
- The events come from a compiled trace tracker (`graphsan.cuda.tracelog`), which names each new
  segment's pool; memory history stays off. Where it cannot be built or attached, they come from
  the allocator's memory history (`_record_memory_history(enabled="all", context=None)`), read
  through a snapshot filtered by an empty pool, whose C++ side still walks every block.
- The history's log carries no pool. While a graph is captured, the allocator's user metadata
  names the capture, so its log entries carry the tag: a new segment made for a tagged
  allocation on the capture stream is the graph pool's (capture_begin's own allocations come
  before the tag); one made on another stream during the capture, or untagged (the metadata
  does not reach the autograd engine's worker thread, which runs a captured backward), is
  looked up in the ending capture's pool snapshot. Segments made inside a `beginAllocate*ToPool`
  window (torch.compile's graph trees, `use_mem_pool`) belong to that window's pool. Either way
  the tag marks a capture's allocations.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from graphsan.core.allocview import AllocatorView, ViewError
from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import DEFAULT_POOL, Frame, PoolId
from graphsan.cuda import tracelib
from graphsan.cuda.context import user_frames
from graphsan.cuda.sites import Site, site_frames

# Trace entries kept between two drains; more than this and the history overwrites the oldest (the
# tracker drops the newest), which the drain notices and answers with a fresh snapshot.
MAX_ENTRIES = 1 << 18
# Below this many new entries a drain applies them; above it (and above twice the blocks the view
# holds) a fresh snapshot is cheaper.
RESEED_ENTRIES = 20_000


def snapshot_map(device: int | None = None) -> MemoryMap:
    """The allocator's segments and blocks right now, from a full snapshot (its cost grows with
    the blocks alive: for tests and checks, not for captures)."""
    return MemoryMap.from_snapshot(_snapshot(), device, user_frames)


def _snapshot(pool: PoolId = (0, 0), traces: bool = False) -> dict[str, Any]:
    """`torch._C._cuda_memorySnapshot` for one pool ((0, 0): all), with or without the event log;
    torch releases without the filter give everything."""
    try:
        return torch._C._cuda_memorySnapshot((pool[0], pool[1], traces))
    except (TypeError, RuntimeError):
        return torch.cuda.memory._snapshot()


def pool_segments(pool: PoolId) -> int:
    """How many segments private pool `pool` holds now (a snapshot filtered by the pool: its
    cost is that pool's, not the process's)."""
    if tuple(pool) == (0, 0):
        raise ValueError("(0, 0) names every pool, not one")
    segments = _snapshot(pool)["segments"]
    return sum(1 for seg in segments if tuple(seg.get("segment_pool_id", ())) == tuple(pool))


_EMPTY_POOL: list = []


def _empty_pool_id() -> PoolId:
    """A pool that never holds memory, made once and kept for the process (a pool must not be
    destroyed while a capture runs): a snapshot filtered by it converts no block, only the log.
    Torch releases without `MemPool` get no filter."""
    if not _EMPTY_POOL:
        try:
            _EMPTY_POOL.append(torch.cuda.MemPool())
        except (AttributeError, RuntimeError):
            _EMPTY_POOL.append(None)
    pool = _EMPTY_POOL[0]
    return tuple(int(x) for x in pool.id) if pool is not None else (0, 0)


def _metadata() -> str:
    try:
        return torch.cuda.memory._get_memory_metadata()
    except (AttributeError, RuntimeError):
        return ""


def _set_metadata(text: str) -> None:
    with contextlib.suppress(AttributeError, RuntimeError):
        torch.cuda.memory._set_memory_metadata(text)


def _reseed_limit(view: AllocatorView) -> int:
    """Events past which a fresh snapshot of the view's device is cheaper than applying them."""
    return max(RESEED_ENTRIES, 2 * len(view))


class AllocatorLog:
    """The allocator's views and the captures' carves, kept from its event log (`log`: the
    compiled tracker, or None: memory history through snapshots). Its owner (the allocator
    watch) hands it what it does not know itself: the allocation site of a live block
    (`site_at`), a look at its sources before each drain (`before_drain`), and who hears of
    eager allocations into a routed pool (`eager_allocated(device, pool, address, size)`)."""

    def __init__(
        self,
        site_at: Callable[[int], Site | None] = lambda address: None,
        before_drain: Callable[[], None] = lambda: None,
        eager_allocated: Callable[[int, PoolId, int, int], None] | None = None,
    ) -> None:
        self.site_at, self.before_drain = site_at, before_drain
        self.eager_allocated = eager_allocated
        self.tracelog: tracelib.TraceLog | None = (
            None  # the compiled tracker, when it could be used
        )
        self.views: dict[int, AllocatorView] = {}
        # streams whose new segments belong to a pool: [stream or None (every stream), pool]
        self.routes: list[list] = []
        self.drains = 0
        self.captures: dict[str, tuple[int, PoolId | None]] = {}  # tag -> (stream, pool)
        # tag -> (address, requested size, allocation site) of each allocation the capture made
        self.carves: dict[str, list[tuple[int, int, Site | None]]] = {}
        self._saved_metadata: list[str] = []
        self._reseed = False

    # -- the view ------------------------------------------------------------------------------
    def view(self, device: int, sync: bool = True, own=(), own_pool=None) -> AllocatorView:
        """The allocator of `device` as of now (`sync`: apply the event log since the last
        drain first). `own` and `own_pool` are for watches without a block map (a capture's
        memory nodes); this view knows the pools' blocks itself."""
        if sync:
            self.sync()
        view = self.views.get(device)
        return view if view is not None else self._new_view(device)

    def _new_view(self, device: int) -> AllocatorView:
        view = self.views[device] = AllocatorView(self.frames_of)
        view.seed(_snapshot(), device)
        return view

    def sync(self) -> None:
        """Apply the allocator's event log to the views."""
        if torch.cuda.is_current_stream_capturing():
            # the history must not be touched mid-capture (the tracker's events simply wait)
            return
        self.before_drain()
        if self.tracelog is not None:
            raw, tags, lost = self.tracelog.drain_raw()
            n = len(raw) // tracelib.RECORD.size
            # a batch this big reseeds every view, so only the captures' allocations (carves)
            # are worth converting
            reseed_all = lost or any(n >= _reseed_limit(v) for v in self.views.values())
            per_device = tracelib.entries_from_records(raw, tags, reseed_all)
        elif not self.views and not self.captures:
            self.record_history(clear=True)
            return
        else:
            snap = _snapshot(_empty_pool_id(), traces=True)
            self.record_history(clear=True)
            traces = snap.get("device_traces", [])
            per_device = dict(enumerate(traces))
            reseed_all = False
        if not self.views:
            if self.captures:  # the first capture's end: the views start here, its carves count
                for device, entries in per_device.items():
                    if entries:
                        self._note_carves(entries, self._new_view(device))
            return
        self.drains += 1
        reseed, self._reseed = self._reseed, False
        for device, view in self.views.items():
            entries = per_device.get(device, [])
            if reseed_all:
                view.seed(_snapshot(), device)
            else:
                self._apply(view, entries, device, reseed)
            if self.captures:
                self._note_carves(entries, view)
            if self.routes:
                self._note_eager(entries, view, device)

    def _apply(self, view: AllocatorView, entries: list, device: int, reseed: bool) -> None:
        # a full buffer lost entries; and past RESEED_ENTRIES a snapshot, walked in C++, is
        # cheaper than applying the entries in Python
        if len(entries) >= min(MAX_ENTRIES, _reseed_limit(view)):
            view.seed(_snapshot(), device)
            return
        unsure: list[tuple[int, PoolId]] = []
        try:
            if reseed:
                raise ViewError("a capture failed: where its segments went is not known")
            view.apply(entries, functools.partial(self._pool_of, unsure=unsure))
        except ViewError:
            view.seed(_snapshot(), device)
            return
        if unsure:
            self._check_pools(view, unsure, device)

    def _note_carves(self, entries, view: AllocatorView) -> None:
        """Keep the allocations each capture made: the ranges its replays write (the replay
        order of a shared pool, `graphsan.core.pool_order`). An allocation carries the capture's tag,
        or (made by another thread, see `_pool_of`) lies in the pool of the one capture ending."""
        ending: dict[PoolId, list[str]] = {}
        for tag, (_, pool) in self.captures.items():
            if pool is not None:
                ending.setdefault(pool, []).append(tag)
        for e in entries:
            if e["action"] != "alloc":
                continue
            addr = int(e["addr"])
            carves = self.carves.get(e.get("user_metadata", ""))
            if carves is None and ending:
                pool = e.get("pool")  # the tracker's entries name it; else the view's segment
                if pool is None:
                    seg = view.segment_at(addr)
                    pool = seg.pool if seg is not None else None
                tags = ending.get(tuple(pool)) if pool is not None else None
                if tags is not None and len(tags) == 1:
                    carves = self.carves.get(tags[0])
            if carves is not None:
                carves.append((addr, int(e["size"]), self.site_at(addr)))

    def _note_eager(self, entries, view: AllocatorView, device: int) -> None:
        """Hand `eager_allocated` each allocation eager code made into a private pool it was
        routed to (`routes`): not a capture's, and in a routed pool on a routed stream."""
        if self.eager_allocated is None:
            return
        routed = {tuple(pool) for _, pool in self.routes}
        for e in entries:
            if e["action"] != "alloc" or e.get("user_metadata", "") in self.carves:
                continue
            addr = int(e["addr"])
            pool = e.get("pool")
            if pool is None:
                seg = view.segment_at(addr)
                pool = seg.pool if seg is not None else None
            if pool is None or tuple(pool) not in routed:
                continue
            stream = int(e.get("stream", 0))
            if any(s is None or s == stream for s, p in self.routes if tuple(p) == tuple(pool)):
                self.eager_allocated(device, tuple(pool), addr, int(e["size"]))

    def _pool_of(self, entry, following, unsure: list) -> PoolId:
        """The pool of a new segment (see the module docstring)."""
        pool = entry.get("pool")
        if pool is not None:  # the tracker's entries: the allocator named it
            return pool
        stream = int(entry["stream"])
        tag = (following or entry).get("user_metadata", "")
        capture = self.captures.get(tag)
        if capture is not None:
            capture_stream, pool = capture
            if stream != capture_stream:
                unsure.append((int(entry["addr"]), pool))
            return pool
        for route_stream, pool in reversed(self.routes):
            if route_stream is None or route_stream == stream:
                return pool
        # Untagged while a capture ends: another thread may have made it for the capture (the
        # autograd engine's worker thread runs a captured backward and does not see the
        # allocator's user metadata), so the ending captures' pool snapshots decide.
        addr = int(entry["addr"])
        for _, pool in self.captures.values():
            if pool is not None:
                unsure.append((addr, pool))
        return DEFAULT_POOL

    def _check_pools(self, view: AllocatorView, unsure: list, device: int) -> None:
        """Segments whose pool the log leaves open (made on a stream other than the capture's,
        or untagged while a capture ended): the first candidate pool whose snapshot has them,
        else the default pool."""
        own: dict[PoolId, list[tuple[int, int]]] = {}
        for pool in dict.fromkeys(p for _, p in unsure):
            own[pool] = [
                (int(s["address"]), int(s["address"]) + int(s["total_size"]))
                for s in _snapshot(pool)["segments"]
                if s.get("device", device) == device and tuple(s["segment_pool_id"]) == pool
            ]
        candidates: dict[int, list[PoolId]] = {}
        for addr, pool in unsure:
            candidates.setdefault(addr, []).append(pool)
        for addr, pools in candidates.items():
            pool = next(
                (p for p in pools if any(lo <= addr < hi for lo, hi in own[p])), DEFAULT_POOL
            )
            seg = view.segment_at(addr)
            if seg is None or tuple(seg.pool) == pool:
                continue
            if seg.address != addr or seg.expandable:
                # mapped pages were joined to a neighbour of the pool the log suggested: the
                # runs are only right from a snapshot
                view.seed(_snapshot(), device)
                return
            seg.pool = pool

    # -- captures ---------------------------------------------------------------------------
    def capture_started(self, gid: int, stream: int) -> str:
        """Tag the allocator's log entries of this capture; returns the tag."""
        tag = f"graphsan capture {gid}"
        self._saved_metadata.append(_metadata())
        _set_metadata(tag)
        self.captures[tag] = (stream, None)
        self.carves[tag] = []
        return tag

    def capture_ended(self, tag: str, pool: PoolId) -> list[tuple[int, int, Site | None]]:
        """The capture's pool is known now: apply the log, then forget the tag. Returns the
        allocations the capture made ((address, requested size, site); any pool)."""
        if self._saved_metadata:
            _set_metadata(self._saved_metadata.pop())
        stream, _ = self.captures[tag]
        self.captures[tag] = (stream, pool)
        try:
            self.sync()
        finally:
            self.captures.pop(tag, None)
        return self.carves.pop(tag, [])

    def capture_failed(self, tag: str) -> None:
        """The capture was invalidated: its tag goes, and the views are seeded afresh."""
        if self._saved_metadata:
            _set_metadata(self._saved_metadata.pop())
        self.captures.pop(tag, None)
        self.carves.pop(tag, None)
        self._reseed = True

    def captured_unseen(self) -> None:
        """Captures graphsan did not hook (its own startup probe) routed segments to pools that
        snapshots' logs cannot name (the tracker's can): the next drain seeds the views afresh."""
        if self.tracelog is None:
            self._reseed = True

    def record_history(self, clear: bool = False) -> None:
        """Memory history on (`clear`: from an empty log): the log where no tracker is loaded."""
        kwargs: dict[str, Any] = {
            "context": None,
            "stacks": "python",
            "max_entries": MAX_ENTRIES,
            "clear_history": clear,
        }
        try:
            torch.cuda.memory._record_memory_history(
                enabled="all", skip_actions=["free_requested", "snapshot", "oom"], **kwargs
            )
        except TypeError:  # torch without skip_actions
            torch.cuda.memory._record_memory_history(enabled="all", **kwargs)

    def frames_of(self, address: int) -> list[Frame]:
        """The live block's allocation site as user frames, outermost first."""
        return site_frames(self.site_at(address))

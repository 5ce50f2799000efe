"""The caching allocator as graphsan sees it: an incremental view of its segments and blocks,
alloc/free events, storage changes and cache releases, turned into calls on the pure `Tracker`.

- The view (`allocview.AllocatorView`, one per device) is seeded by one snapshot when graphsan
  starts and then follows the allocator's own events, drained at capture begin and end and
  before a replay is judged. Each drain costs the events since the last one, not the blocks
  alive; a log that overflowed between two drains (or contradicts the view) reseeds it.
- The events come from a compiled trace tracker (`graphsan.cuda.tracelog`), which names each new
  segment's pool; memory history stays off. Where it cannot be built or attached, they come from
  the allocator's memory history (`_record_memory_history(enabled="all", context=None)`), read
  through a snapshot filtered by an empty pool, whose C++ side still walks every block
  (`allocator_log` says which and why).
- The history's log carries no pool. While a graph is captured, the allocator's user metadata
  names the capture, so its log entries carry the tag: a new segment made for a tagged
  allocation on the capture stream is the graph pool's (capture_begin's own allocations come
  before the tag); one made on another stream during the capture, or untagged (the metadata
  does not reach the autograd engine's worker thread, which runs a captured backward), is
  looked up in the ending capture's pool snapshot. Segments made inside a `beginAllocate*ToPool` window (torch.compile's graph trees,
  `use_mem_pool`) belong to that window's pool. Either way the tag marks a capture's allocations.
- Allocation stacks are taken by the GPU-trace allocation callback as raw (code, instruction)
  pairs, one interned tuple per distinct call path (interned once the block outlives the next
  `INTERN_BATCH` allocations, or a capture made it), and turned into frames only for blocks a
  graph references. (The allocator's own stacks need torch's symbolizer, whose first use in a
  process costs seconds.)
- Frees arrive through PyTorch's GPU-trace callbacks. Only frees of *watched* blocks do more than
  two dict lookups: they record the Python stack, the phase and the step.
- Storage changes (`resize_`, `set_`, `.data =`, `untyped_storage().resize_`) are wrapped so a
  free they cause is known to be a *move*.
- `torch.cuda.empty_cache()` is wrapped to note releases to the driver.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import warnings
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

import torch

from graphsan.context import Context, python_stack, user_frames
from graphsan.core.memory_map import AllocatorView, MemoryMap, ViewError
from graphsan.core.patches import Patches
from graphsan.core.records import DEFAULT_POOL, Frame, FreeEvent, PoolId, Release
from graphsan.core.tracker import Tracker
from graphsan.cuda import tracelog
from graphsan.cuda.gputrace import GpuTrace
from graphsan.cuda.graphwalk import GraphWalk
from graphsan.report.timeline import Timeline

# Trace entries kept between two drains; more than this and the history overwrites the oldest (the
# tracker drops the newest), which the drain notices and answers with a fresh snapshot.
MAX_ENTRIES = 1 << 18
# Below this many new entries a drain applies them; above it (and above twice the blocks the view
# holds) a fresh snapshot is cheaper.
RESEED_ENTRIES = 20_000
# Frames kept per allocation stack (innermost first while walking; user frames are picked later):
# every allocation pays for the walk, and the innermost 24 reach the user's code through torch's
# call wrappers.
SITE_DEPTH = 24
Site = tuple  # (code, instruction offset, code, instruction offset, ...), innermost first
# A new allocation's site stays a plain tuple until this many allocations later; only those
# still alive then are interned, so temporaries never pay for the interning.
INTERN_BATCH = 1024

_op = threading.local()


def _current_op() -> str | None:
    return getattr(_op, "name", None)


def _wrap_op(name: str, orig: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        prev = getattr(_op, "name", None)
        _op.name = name
        try:
            return orig(self, *args, **kwargs)
        finally:
            _op.name = prev

    wrapper.__wrapped__ = orig
    wrapper.__name__ = getattr(orig, "__name__", name)
    wrapper.__doc__ = getattr(orig, "__doc__", None)
    return wrapper


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


_SAID: list[str] = []


def _say_fallback(reason: str | None) -> None:
    """A fallback the user did not ask for is said once per process, in one line."""
    if reason is None or reason in (f"{tracelog.ENV}=0", tracelog.BUILDING) or _SAID:
        return
    _SAID.append(reason)
    sys.stderr.write(
        f"graphsan: the allocator's events come from snapshots ({reason}); "
        "each capture costs more as the live blocks grow\n"
    )


def _site_frames(site: Site | None) -> list[Frame]:
    """A recorded allocation stack as frames, outermost first, user frames only."""
    if not site:
        return []
    frames = [
        (code.co_filename, _line(code, lasti), code.co_name)
        for code, lasti in zip(site[0::2], site[1::2], strict=True)
    ]
    frames.reverse()
    return user_frames(frames)


def _unrolled_walk(depth: int) -> Callable[[FrameType], Site]:
    """A function of a frame giving the call path from it outwards: (code, instruction offset)
    of at most `depth` frames, innermost first. Written out frame by frame, without a loop or a
    list, because every allocation runs it and those were a large part of a loop's cost."""

    def pairs(n: int) -> str:
        return ", ".join(f"f{i}.f_code, f{i}.f_lasti" for i in range(n))

    src = ["def walk(frame):", "    f0 = frame"]
    for i in range(1, depth):
        src += [
            f"    f{i} = f{i - 1}.f_back",
            f"    if f{i} is None:",
            f"        return ({pairs(i)},)",
        ]
    src.append(f"    return ({pairs(depth)},)")
    namespace: dict[str, Any] = {}
    exec("\n".join(src), namespace)
    return namespace["walk"]


_walk = _unrolled_walk(SITE_DEPTH)


def _line(code: CodeType, lasti: int) -> int:
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line or 0
    return code.co_firstlineno


class AllocatorWatch:
    """Feeds allocator events into a Tracker while started."""

    def __init__(
        self,
        tracker: Tracker,
        context: Context,
        on_error: Callable[[BaseException], None],
        alloc_stacks: bool = True,
    ) -> None:
        self.tracker = tracker
        self.context = context
        self.on_error = on_error
        self.alloc_stacks = alloc_stacks
        self.last_release: Release | None = None
        self.capture_pool: tuple[int, int] | None = None  # set while a capture is in progress
        # (tensor, sizes) -> tensor | None: the pin policy's way around a reallocating resize_
        self.redirect_resize: Callable[[torch.Tensor, tuple], torch.Tensor | None] | None = None
        self.views: dict[int, AllocatorView] = {}
        self.sites: dict[int, Site] = {}  # live block address -> its allocation stack
        self._interned: dict[tuple, Site] = {}  # code ids and offsets -> the site
        self._fresh: list[int] = []  # addresses whose site may not be interned yet
        # the tracker's own dicts (never rebound), read by every free without two lookups
        self._live = tracker.live
        self._freed_segments = tracker.freed_segments
        # streams whose new segments belong to a pool: [stream or None (every stream), pool]
        self.routes: list[list] = []
        self.drains = 0
        self.captures: dict[str, tuple[int, PoolId | None]] = {}  # tag -> (stream, pool)
        # tag -> (address, requested size, allocation site) of each allocation the capture made
        self.carves: dict[str, list[tuple[int, int, Site | None]]] = {}
        self._saved_metadata: list[str] = []
        self._reseed = False
        self.timeline: Timeline | None = None  # gets watched frees and empty_cache releases
        self._active = False
        self._patches = Patches()  # the storage ops, empty_cache and pool routing wrapped
        self.log: tracelog.TraceLog | None = None  # the compiled tracker, when it could be used
        self.log_reason: str | None = None  # why not
        # the same library as PyTorch's GPU-trace interpreter: frees and allocations reach
        # Python only where graphsan judges them (None: PyTorch's trace and the callbacks below)
        self.trace: GpuTrace | None = None
        self.trace_reason: str | None = None  # why PyTorch's trace is used instead
        self._arriving: set[int] = set()  # the blocks the capture being added is about to watch

    def graph_walk(self) -> GraphWalk | None:
        """The tracker library's graph walk, where the library is loaded and found the driver
        (`TraceLog.graph_walk`); None: the walk goes through cuda-bindings."""
        if self.log is None:
            return None
        return self.log.graph_walk()[0]

    @property
    def allocator_log(self) -> str | None:
        """Where the allocator's events come from: "tracker" (with ", GPU trace: PyTorch's
        (why)" where frees come through PyTorch's dispatch), or "snapshot (why)"; None before the
        watch starts."""
        if self.log is not None:
            if self.trace is None and self.trace_reason is not None:
                return f"tracker, GPU trace: PyTorch's ({self.trace_reason})"
            return "tracker"
        return f"snapshot ({self.log_reason})" if self.log_reason is not None else None

    polls = False  # frees arrive as events: a clean graph needs no look before its replay

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
        view = self.views[device] = AllocatorView(self._frames_of)
        view.seed(_snapshot(), device)
        return view

    def sync(self) -> None:
        """Apply the allocator's event log to the views."""
        if torch.cuda.is_current_stream_capturing():
            # the history must not be touched mid-capture (the tracker's events simply wait)
            return
        self.check_trace()
        if self.log is not None:
            raw, tags, lost = self.log.drain_raw()
            n = len(raw) // tracelog.RECORD.size
            # a batch this big reseeds every view, so only the captures' allocations (carves)
            # are worth converting
            reseed_all = lost or any(n >= _reseed_limit(v) for v in self.views.values())
            per_device = tracelog.entries_from_records(raw, tags, reseed_all)
        elif not self.views and not self.captures:
            self._clear_log()
            return
        else:
            snap = _snapshot(_empty_pool_id(), traces=True)
            self._clear_log()
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
        order of a shared pool, `graphsan.core.order`). An allocation carries the capture's tag,
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
                carves.append((addr, int(e["size"]), self._site_at(addr)))

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
        if self.log is None:
            self._reseed = True

    def _clear_log(self) -> None:
        self._record(clear=True)

    def _record(self, clear: bool = False) -> None:
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

    def _site(self, frame: FrameType) -> Site:
        """This call path as an interned tuple."""
        return self._intern(_walk(frame))

    def _intern(self, site: Site) -> Site:
        """The one tuple kept for this call path. The key is built from code ids (hashing a code
        object hashes its contents); the kept tuple holds the code objects, which keeps the ids
        valid."""
        return self._interned.setdefault((*map(id, site[0::2]), *site[1::2]), site)

    def _intern_fresh(self) -> None:
        """Intern the sites of the latest allocations still alive. Another thread may free or
        reallocate an address meanwhile: a site is only put back where no newer one was stored."""
        fresh, self._fresh = self._fresh, []
        sites = self.sites
        for ptr in fresh:
            raw = sites.get(ptr)
            if raw is None:
                continue
            site = self._intern(raw)
            if sites.get(ptr) is raw:  # the entry is never absent, so readers never miss it
                sites[ptr] = site

    def _site_at(self, address: int) -> Site | None:
        """The interned allocation site of the live block at `address`, if one was recorded."""
        if self.trace is not None:
            return self.trace.site_of(address)
        site = self.sites.get(address)
        return self._intern(site) if site is not None else None

    def _frames_of(self, address: int) -> list[Frame]:
        return _site_frames(self._site_at(address))

    @staticmethod
    def site_frames(site: Site | None) -> list[Frame]:
        """A site kept elsewhere (a capture's carve) as user frames, outermost first."""
        return _site_frames(site)

    # -- callbacks (hot path) ------------------------------------------------------------------
    def _on_free(self, ptr: int) -> None:
        if not self._active:
            return
        self.sites.pop(ptr, None)
        if ptr not in self._live and not self._freed_segments:
            return
        try:
            if self.tracker.on_free(ptr, self._free_event) and self.timeline is not None:
                ev = _op.freed  # the event _free_event just made, on this thread
                self.timeline.free(ptr, ev.time, ev.stack, ev.phase, ev.step, ev.op)
        except Exception as err:  # never let a callback break the user's free
            self.on_error(err)

    def _free_event(self) -> FreeEvent:
        phase, step = self.context.current()
        ev = FreeEvent(python_stack(), phase, step, _current_op(), self.capture_pool)
        ev.time = time.time()
        _op.freed = ev
        return ev

    def _on_alloc_judged(self, ptr: int) -> None:
        """An allocation in a segment holding freed watched memory (from the compiled trace,
        which keeps the site itself)."""
        if not self._active:
            return
        try:
            self.tracker.on_alloc(ptr)
        except Exception as err:
            self.on_error(err)

    def _on_watch(self, addresses: list[int]) -> None:
        """Blocks about to be watched (`Tracker.add_graph`, before they enter `live`)."""
        if self.trace is not None:
            self._arriving = set(addresses)
            self.trace.watch(addresses)

    def _on_free_traced(self, ptr: int) -> None:
        """A free the compiled trace passed on: judged as any other; the address leaves its
        watched set once judged, or when no graph watches it (a graph forgotten), but not while
        the capture that watches it is still putting it in `live`."""
        judged = ptr in self._live
        self._on_free(ptr)
        trace = self.trace
        if trace is not None and (judged or ptr not in self._arriving):
            trace.unwatch(ptr)

    def _on_freed_segments(self, keys: list[tuple[int, int]]) -> None:
        if self.trace is not None:
            self.trace.freed_ranges(keys)

    def _on_alloc(self, ptr: int) -> None:
        if not self._active:
            return
        if self.alloc_stacks:
            self.sites[ptr] = _walk(sys._getframe(1))
            fresh = self._fresh
            fresh.append(ptr)
            if len(fresh) >= INTERN_BATCH:
                self._intern_fresh()
        if not self._freed_segments:
            return
        try:
            self.tracker.on_alloc(ptr)
        except Exception as err:
            self.on_error(err)

    # -- start / stop --------------------------------------------------------------------------
    def start(self) -> None:
        if self._active:
            return
        if self.log is None and self.log_reason is None:
            self.log, self.log_reason = tracelog.open_log()
            _say_fallback(self.log_reason)
        if self.log is not None:
            self.log.set_cap(MAX_ENTRIES)
            self.log.enable(True)
        else:
            self._record(clear=True)
        self._active = True  # before the trace listens: its first free must not be dropped
        self._start_trace()
        self._patch_storage_ops()
        self._patch_empty_cache()
        self._patch_pool_routing()
        self.view(torch.cuda.current_device())  # the one snapshot: the seed

    def _start_trace(self) -> None:
        """Listen to frees and allocations: through the compiled library as the GPU trace's
        interpreter where it loaded and no other interpreter is registered, else through
        PyTorch's trace. The Python callbacks are registered either way: they stay silent under
        graphsan's interpreter and carry on at once if something replaces it."""
        self._register_callbacks()
        trace = self.log.gpu_trace if self.log is not None else None
        if isinstance(trace, str):
            self.trace_reason = trace
        elif trace is not None and trace.owner not in (None, self):
            # PyTorch's trace would replace the other's interpreter: this one goes without
            self.trace_reason = "another active graphsan sanitizer holds the GPU trace"
            warnings.warn(f"graphsan: {self.trace_reason}; this one sees no frees", stacklevel=3)
            return
        elif trace is not None:
            self.trace_reason = trace.install()
            if self.trace_reason is None:
                self._listen(trace)
                return
        self._activate_torch_trace()

    def _listen(self, trace: GpuTrace) -> None:
        """Frees and allocations through graphsan's interpreter, told first what is watched so
        that no free slips by."""
        self.trace = trace
        trace.owner = self
        trace.callbacks(self._on_free_traced, self._on_alloc_judged)
        self.tracker.on_watch = self._on_watch
        self.tracker.on_freed_segments = self._on_freed_segments
        trace.watch(list(self.tracker.live))
        trace.freed_ranges(sorted(self.tracker.freed_segments))
        trace.enable(True, sites=self.alloc_stacks, depth=SITE_DEPTH)

    @staticmethod
    def _activate_torch_trace() -> None:
        torch._C._activate_gpu_trace()

    def _register_callbacks(self) -> None:
        if not getattr(self, "_registered", False):
            from torch.cuda import _gpu_trace

            _gpu_trace.register_callback_for_memory_deallocation(self._on_free)
            _gpu_trace.register_callback_for_memory_allocation(self._on_alloc)
            self._registered = True

    def _stop_trace(self, uninstall: bool = True) -> None:
        trace, self.trace = self.trace, None
        self.tracker.on_watch = self.tracker.on_freed_segments = None
        if trace is not None:
            trace.enable(False)
            trace.callbacks(None, None)
            trace.clear_sites()
            trace.owner = None
            if uninstall:
                trace.uninstall()

    def check_trace(self) -> None:
        """Go on through PyTorch's trace (one warning) where something replaced graphsan's
        interpreter since (torch._C._activate_gpu_trace(), torch.cuda._sanitizer): the Python
        callbacks have carried the frees since then."""
        if self.trace is None or self.trace.current():
            return
        self._stop_trace(uninstall=False)
        self.trace_reason = "PyTorch's GPU trace was switched on after graphsan started"
        warnings.warn(
            f"graphsan: {self.trace_reason}; frees reach it through PyTorch's trace since "
            "(allocation sites of blocks allocated before are lost)",
            stacklevel=2,
        )

    def stop(self) -> None:
        self._active = False  # the gpu-trace callbacks cannot be unregistered; they go idle
        self._stop_trace()
        self._patches.restore()
        if self.log is not None:
            self.log.enable(False)
        else:
            with contextlib.suppress(Exception):
                if not torch.cuda.is_current_stream_capturing():
                    torch.cuda.memory._record_memory_history(enabled=None)
        self.views.clear()
        self.sites.clear()
        self._fresh.clear()
        self._interned.clear()

    def _set(self, owner: object, name: str, value: object) -> None:
        self._patches.set(owner, name, value)

    def _patch_storage_ops(self) -> None:
        for name in ("resize_as_", "set_"):
            self._set(torch.Tensor, name, _wrap_op(name, getattr(torch.Tensor, name)))
        tagged_resize = _wrap_op("resize_", torch.Tensor.resize_)
        watch = self

        def resize_(tensor, *sizes, **kwargs):
            if watch.redirect_resize is not None and watch._active:
                out = watch.redirect_resize(tensor, sizes)
                if out is not None:
                    return out
            return tagged_resize(tensor, *sizes, **kwargs)

        resize_.__wrapped__ = torch.Tensor.resize_
        resize_.__doc__ = torch.Tensor.resize_.__doc__
        self._set(torch.Tensor, "resize_", resize_)
        self._set(
            torch.UntypedStorage,
            "resize_",
            _wrap_op("storage.resize_", torch.UntypedStorage.resize_),
        )
        base = torch._C.TensorBase.data

        def set_data(self, value):
            prev = getattr(_op, "name", None)
            _op.name = ".data ="
            try:
                base.__set__(self, value)
            finally:
                _op.name = prev

        self._set(torch.Tensor, "data", property(base.__get__, set_data, doc=base.__doc__))

    def _patch_empty_cache(self) -> None:
        orig = torch.cuda.memory.empty_cache
        watch = self

        def empty_cache() -> None:
            orig()
            if watch._active:
                try:
                    phase, step = watch.context.current()
                    watch.last_release = Release(tuple(python_stack()), phase, step)
                    if watch.timeline is not None:
                        watch.timeline.release(list(watch.last_release.stack), phase, step)
                    watch.tracker.on_release()
                except Exception as err:
                    watch.on_error(err)

        empty_cache.__wrapped__ = orig
        empty_cache.__doc__ = orig.__doc__
        self._set(torch.cuda.memory, "empty_cache", empty_cache)
        self._set(torch.cuda, "empty_cache", empty_cache)

    def _patch_pool_routing(self) -> None:
        """Outside captures, eager allocations are routed to a private pool by these calls
        (torch.compile's CUDA graph trees, `torch.cuda.use_mem_pool`): a segment they make
        belongs to that pool."""
        watch = self

        def wrap_begin(orig: Callable, per_thread: bool) -> Callable:
            def begin(device, pool, *args, **kwargs):
                if watch._active:
                    watch.sync()
                    stream = None if per_thread else torch.cuda.current_stream().cuda_stream
                    watch.routes.append([stream, (int(pool[0]), int(pool[1]))])
                return orig(device, pool, *args, **kwargs)

            begin.__wrapped__ = orig
            return begin

        def wrap_end(orig: Callable) -> Callable:
            def end(device, pool, *args, **kwargs):
                out = orig(device, pool, *args, **kwargs)
                if watch._active:
                    watch.sync()
                    key = (int(pool[0]), int(pool[1]))
                    for i in range(len(watch.routes) - 1, -1, -1):
                        if watch.routes[i][1] == key:
                            del watch.routes[i]
                            break
                return out

            end.__wrapped__ = orig
            return end

        for owner in (torch._C, torch.cuda.memory):
            for name, per_thread in (
                ("_cuda_beginAllocateCurrentThreadToPool", True),
                ("_cuda_beginAllocateToPool", True),
                ("_cuda_beginAllocateCurrentStreamToPool", False),
            ):
                if name in vars(owner):
                    self._set(owner, name, wrap_begin(vars(owner)[name], per_thread))
            if "_cuda_endAllocateToPool" in vars(owner):
                self._set(
                    owner,
                    "_cuda_endAllocateToPool",
                    wrap_end(vars(owner)["_cuda_endAllocateToPool"]),
                )

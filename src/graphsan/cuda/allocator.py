"""The caching allocator as graphsan sees it while a sanitizer runs: alloc/free events,
storage changes and cache releases turned into calls on the pure `Tracker`, over the views that
`AllocatorLog` keeps from the allocator's event log (`cuda.allocator_log`).

- Frees arrive through PyTorch's GPU-trace callbacks, or through graphsan's own interpreter of
  that trace (`cuda.gputrace`), which passes on only frees of watched blocks. Only frees of
  *watched* blocks do more than two dict lookups: they record the Python stack, the phase and the
  step (`free_event`).
- Allocation stacks are taken by the GPU-trace allocation callback (`cuda.sites`) and turned
  into frames only for blocks a graph references.
- Storage changes are wrapped so a free they cause is known to be a *move*, and
  `torch.cuda.empty_cache()` so that releases to the driver are noted (`cuda.storage_ops`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch

from graphsan.core.eager import EagerInPools
from graphsan.core.patches import Patches
from graphsan.core.records import Frame, FreeEvent, PoolId, Release
from graphsan.core.timeline import Timeline
from graphsan.core.tracker import Tracker
from graphsan.cuda import storage_ops, tracebuild, tracelib, tracelog
from graphsan.cuda.allocator_log import MAX_ENTRIES, AllocatorLog, pool_segments
from graphsan.cuda.context import Context, python_stack
from graphsan.cuda.device_reads import read_now
from graphsan.cuda.gputrace import GpuTrace
from graphsan.cuda.graphwalk import GraphWalk
from graphsan.cuda.sites import INTERN_BATCH, SITE_DEPTH, AllocSites, Site, site_frames, walk

_freed = threading.local()  # the free event `free_event` made last, on this thread
_SAID: list[str] = []


def _say_fallback(reason: str | None) -> None:
    """A fallback the user did not ask for is said once per process, in one line."""
    if reason is None or reason in (f"{tracebuild.ENV}=0", tracebuild.BUILDING) or _SAID:
        return
    _SAID.append(reason)
    sys.stderr.write(
        f"graphsan: the allocator's events come from snapshots ({reason}); "
        "each capture costs more as the live blocks grow\n"
    )


class AllocatorWatch:
    """Feeds allocator events into a Tracker while started. It holds the views kept from the
    allocator's event log (`ledger`, an `AllocatorLog`) and the allocation sites of live blocks
    (`sites`, where the compiled GPU trace does not keep them)."""

    def __init__(
        self,
        tracker: Tracker,
        context: Context,
        on_error: Callable[[BaseException], None],
        alloc_stacks: bool = True,
        timeline: Timeline | None = None,
        eager: EagerInPools | None = None,
        driver: Callable[[], object] | None = None,
    ) -> None:
        self.ledger = AllocatorLog(self._site_at, self.check_trace, self._eager_allocated)
        self.tracker = tracker
        # the driver module (cuda.driver), loaded when first asked (it loads cuda-bindings)
        self.driver = driver
        self.eager = eager  # the eager tensors in graphs' carves, where the replay order keeps them
        self.context = context
        self.on_error = on_error
        self.alloc_stacks = alloc_stacks
        self.timeline = timeline  # gets watched frees and empty_cache releases
        self.last_release: Release | None = None
        # the pool a capture in progress allocates from, where known (frees name it)
        self.capture_pool: PoolId | None = None
        # (tensor, sizes) -> tensor | None: the pin policy's way around a reallocating resize_
        self._redirect_resize: Callable[[torch.Tensor, tuple], torch.Tensor | None] | None = None
        self.sites = AllocSites()
        self._site_of = self.sites.by_address  # never rebound: the hot paths use it directly
        # the tracker's own dicts (never rebound), read by every free without two lookups
        self._live = tracker.live
        self._freed_segments = tracker.freed_segments
        self._active = False
        self._patches = Patches()  # the storage ops, empty_cache and pool routing wrapped
        self.tracelog_reason: str | None = None  # why not
        # the same library as PyTorch's GPU-trace interpreter: frees and allocations reach
        # Python only where graphsan judges them (None: PyTorch's trace and the callbacks below)
        self.trace: GpuTrace | None = None
        self.trace_reason: str | None = None  # why PyTorch's trace is used instead
        self._arriving: set[int] = set()  # the blocks the capture being added is about to watch

    # -- the ledger: the event log's views and the captures' carves ---------------------------
    @property
    def tracelog(self) -> tracelib.TraceLog | None:
        """The compiled tracker the events come from (None: memory history)."""
        return self.ledger.tracelog

    @tracelog.setter
    def tracelog(self, log: tracelib.TraceLog | None) -> None:
        self.ledger.tracelog = log

    def view(self, device: int, sync: bool = True, own=(), own_pool=None):
        return self.ledger.view(device, sync, own, own_pool)

    def sync(self) -> None:
        self.ledger.sync()

    # -- a capture (core.memory_source.CaptureMemory) ------------------------------------------
    def capture_started(self, gid: int, stream: int, pool: PoolId | None) -> str:
        self.capture_pool = pool
        return self.ledger.capture_started(gid, stream)

    def capture_ended(self, tag: str, pool: PoolId) -> list:
        self.capture_pool = None
        return self.ledger.capture_ended(tag, pool)

    def capture_failed(self, tag: str) -> None:
        self.capture_pool = None
        self.ledger.capture_failed(tag)

    def captured_unseen(self) -> None:
        self.ledger.captured_unseen()

    def graph_walk(self) -> GraphWalk | None:
        """The tracker library's graph walk, where the library is loaded and found the driver
        (`TraceLog.graph_walk`); None: the walk goes through cuda-bindings."""
        if self.tracelog is None:
            return None
        return self.tracelog.graph_walk()[0]

    @property
    def event_source(self) -> str | None:
        """Where the allocator's events come from: "tracker" (with ", GPU trace: PyTorch's
        (why)" where frees come through PyTorch's dispatch), or "snapshot (why)"; None before the
        watch starts."""
        if self.tracelog is not None:
            if self.trace is None and self.trace_reason is not None:
                return f"tracker, GPU trace: PyTorch's ({self.trace_reason})"
            return "tracker"
        return f"snapshot ({self.tracelog_reason})" if self.tracelog_reason is not None else None

    # -- what the replay judge asks (core.memory_source.MemorySource) ------------------------
    judges_every_replay = False  # frees arrive as events: a clean graph needs no look

    def prepare(self, state) -> None:
        """Nothing to ask before a judgement: the allocator's events told everything."""

    def held(self, device: int) -> Callable[[], object]:
        return functools.partial(self.view, device)

    @property
    def mapped(self) -> Callable[[int], bool] | None:
        """The driver's answer (expandable segments unmap pages their range outlives)."""
        return self.driver().is_mapped if self.driver is not None else None

    def read_device(self, spans) -> list[bytes]:
        return read_now(self.driver, spans)

    @staticmethod
    def keep_alive(own) -> int:
        """This allocator makes a graph's memory at its capture: nothing to keep; 0."""
        return 0

    @staticmethod
    def probe_refused() -> str | None:
        """The start-up probe may run here (its memory goes to a pool it gives back)."""
        return None

    def probe_waits(self) -> bool:
        """The start-up probe must wait: a capture graphsan watches is in progress (on any
        stream or thread), or eager allocations are routed to a graph pool."""
        return bool(self.ledger.captures or self.ledger.routes)

    def release_pool(self, pool: PoolId) -> str | None:
        """Give a private pool nothing uses any more back to the driver, that pool alone (the
        start-up probe's: its segments would otherwise stay in the program's snapshots and
        `memory_reserved()`); None, or why not. A pool that emptied itself (a dropped
        `MemPool`) needs nothing more."""
        if not pool_segments(pool):
            return None
        if self.tracelog is None:
            return (
                "the compiled tracker is not loaded: the pool's memory stays cached until the "
                "program's own empty_cache()"
            )
        why = self.tracelog.release_pool(
            pool, os.path.join(tracelog.torch_lib_dir(), "libc10_cuda.so")
        )
        if why is not None:
            return why
        left = pool_segments(pool)  # the allocator skips a pool something still uses, silently
        return f"{left} segment(s) of the pool stayed cached: it is still in use" if left else None

    def _site_at(self, address: int) -> Site | None:
        """The interned allocation site of the live block at `address`, if one was recorded."""
        if self.trace is not None:
            return self.trace.site_of(address)
        return self.sites.at(address)

    @staticmethod
    def site_frames(site: Site | None) -> list[Frame]:
        """A site kept elsewhere (a capture's carve) as user frames, outermost first."""
        return site_frames(site)

    # -- callbacks (hot path) ------------------------------------------------------------------
    def _on_free(self, ptr: int) -> None:
        if not self._active:
            return
        self._site_of.pop(ptr, None)
        if ptr not in self._live and not self._freed_segments:
            return
        try:
            if self.tracker.on_free(ptr, self.free_event) and self.timeline is not None:
                ev = _freed.event  # the event free_event just made, on this thread
                self.timeline.free(ptr, ev.time, ev.stack, ev.phase, ev.step, ev.op)
        except Exception as err:  # never let a callback break the user's free
            self.on_error(err)

    def free_event(self) -> FreeEvent:
        """What a watched free records: the Python stack, phase, step and storage change now."""
        phase, step = self.context.current()
        ev = FreeEvent(python_stack(), phase, step, storage_ops.current_op(), self.capture_pool)
        ev.time = time.time()
        _freed.event = ev
        return ev

    def _on_alloc_judged(self, ptr: int) -> None:
        """An allocation in a segment holding freed watched memory: from the compiled trace,
        which keeps the site itself, or from `_on_alloc` once it kept the site."""
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
            sites = self.sites
            self._site_of[ptr] = walk(sys._getframe(1))
            fresh = sites.fresh
            fresh.append(ptr)
            if len(fresh) >= INTERN_BATCH:
                sites.intern_fresh()
        if self._freed_segments:
            self._on_alloc_judged(ptr)

    # -- start / stop --------------------------------------------------------------------------
    def start(self) -> None:
        if self._active:
            return
        if self.tracelog is None and self.tracelog_reason is None:
            self.tracelog, self.tracelog_reason = tracelog.open_log()
            _say_fallback(self.tracelog_reason)
        if self.tracelog is not None:
            self.tracelog.set_cap(MAX_ENTRIES)
            self.tracelog.enable(True)
        else:
            self.ledger.record_history(clear=True)
        self._active = True  # before the trace listens: its first free must not be dropped
        self._start_trace()
        storage_ops.patch_storage_ops(self._patches, self)
        storage_ops.patch_empty_cache(self._patches, self)
        storage_ops.patch_pool_routing(self._patches, self)
        self.view(torch.cuda.current_device())  # the one snapshot: the seed

    def _start_trace(self) -> None:
        """Listen to frees and allocations: through the compiled library as the GPU trace's
        interpreter where it loaded and no other interpreter is registered, else through
        PyTorch's trace. The Python callbacks are registered either way: they stay silent under
        graphsan's interpreter and carry on at once if something replaces it."""
        self._register_callbacks()
        trace = self.tracelog.gpu_trace if self.tracelog is not None else None
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
        self.tracker.mirror(self._on_watch, self._on_freed_segments)
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
        self.tracker.mirror(None, None)
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
        if self.tracelog is not None:
            self.tracelog.enable(False)
        else:
            with contextlib.suppress(Exception):
                if not torch.cuda.is_current_stream_capturing():
                    torch.cuda.memory._record_memory_history(enabled=None)
        self.ledger.views.clear()
        self.sites.clear()

    # -- storage ops (storage_ops.OpsListener) -----------------------------------------------
    def redirect_resizes(
        self, how: Callable[[torch.Tensor, tuple], torch.Tensor | None] | None
    ) -> None:
        """From now, `tensor.resize_(*sizes)` is done as `how(tensor, sizes)` says (a tensor,
        or None: as asked); None: every resize as asked."""
        self._redirect_resize = how

    @property
    def resizes_redirected_to(self) -> Callable | None:
        return self._redirect_resize

    def redirected_resize(self, tensor: torch.Tensor, sizes: tuple) -> torch.Tensor | None:
        """`tensor.resize_(*sizes)` done another way (the pin policy's), or None: as asked."""
        if self._redirect_resize is None or not self._active:
            return None
        return self._redirect_resize(tensor, sizes)

    def released(self) -> None:
        """`empty_cache()` returned cached memory to the driver."""
        if not self._active:
            return
        try:
            phase, step = self.context.current()
            self.last_release = Release(tuple(python_stack()), phase, step)
            if self.timeline is not None:
                self.timeline.release(list(self.last_release.stack), phase, step)
            self.tracker.on_release()
        except Exception as err:
            self.on_error(err)

    def _eager_allocated(self, device: int, pool: PoolId, addr: int, size: int) -> None:
        if self.eager is None:
            return
        phase, step = self.context.current()
        for gid in self.eager.allocated(device, pool, addr, size, self._site_at(addr), phase, step):
            self.tracker.recheck(gid)  # its next replay asks whether the tensor is still held

    def route_begins(self, pool: PoolId, per_thread: bool) -> None:
        """Eager allocations go to `pool` from now (this thread's, or this stream's)."""
        if self._active:
            self.sync()
            stream = None if per_thread else torch.cuda.current_stream().cuda_stream
            self.ledger.routes.append([stream, pool])

    def route_ends(self, pool: PoolId) -> None:
        if self._active:
            self.sync()
            for i in range(len(self.ledger.routes) - 1, -1, -1):
                if self.ledger.routes[i][1] == pool:
                    del self.ledger.routes[i]
                    break

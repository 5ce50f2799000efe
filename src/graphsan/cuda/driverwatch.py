"""The memory watch for allocators that keep no block map: PyTorch's cudaMallocAsync backend
(and any pluggable allocator whose snapshots and history are refused).

Such a backend gives graphsan nothing to follow: no snapshot, no memory history, no trace
tracker, and its allocations and frees never reach PyTorch's GPU trace (seen on the H200 with
torch 2.11). What the driver knows is enough to keep watching:

- at capture end a candidate word is a reference when the driver names the allocation holding
  it (`cuMemGetAddressRange`); the graph's own memory (its memory-allocation nodes, which is
  how a capture allocates under this backend) is its temporaries, not watched;
- a watched allocation is remembered with the driver's buffer id, and before each replay of a
  graph that uses such memory the driver is asked again: an allocation that is gone, or whose
  id changed (freed and allocated anew at the same address), is a free found there, judged as
  any other (freed, or reowned by the allocation that holds the address now).

A graph stopped before its first launch needs one more thing: this backend allocates a graph's
memory when it launches, so the capture's outputs point at memory that was never allocated, and
PyTorch aborts the process when they are freed. Their storages are kept alive until the process
exits (`keep_alive`; the sanitizer says so in one line).

What it cannot give: the stack and phase of a free (it is found, not seen: reports say so),
allocation stacks, storage moves as such (they read as frees), pool replay order (no carves),
and an empty_cache that trims the pool reads as freed, not unmapped. Each replay of a watched
graph pays one driver call per allocation it references.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from graphsan.core.graph_state import GraphState
from graphsan.core.memory_map import AskedMap
from graphsan.core.patches import Patches
from graphsan.core.records import DEFAULT_POOL, FREED_UNSEEN, FreeEvent, PoolId, Release
from graphsan.core.timeline import Timeline
from graphsan.core.tracker import Tracker
from graphsan.cuda import storage_ops
from graphsan.cuda.context import Context, python_stack
from graphsan.cuda.device_reads import read_now
from graphsan.cuda.owners import gc_tensors, storages_of

Identity = tuple[int, int, int]  # an allocation's base, size and the driver's buffer id


def backend() -> str:
    """The CUDA allocator backend PyTorch runs ("native", "cudaMallocAsync"), "native" where
    this torch cannot say."""
    try:
        return str(torch.cuda.get_allocator_backend())
    except Exception:
        return "native"


def no_block_map() -> str:
    """Why the driver is asked: the backend keeps no block map."""
    return f"the {backend()} allocator backend keeps no block map and reports no frees"


@dataclass(eq=False)
class DriverWatch:
    """The allocator watch's interface (`cuda.allocator.AllocatorWatch`) answered through the
    driver; `judges_every_replay` tells the replay judge to look before every replay."""

    tracker: Tracker
    context: Context
    on_error: Callable[[BaseException], None]
    alloc_stacks: bool = True
    why: str = ""
    # the driver module (cuda.driver), loaded when first asked: nothing loads libcuda before
    # a graph is captured
    driver: Callable[[], object] | None = field(default=None, repr=False)
    timeline: Timeline | None = None
    last_release: Release | None = field(default=None, init=False)
    capture_pool: PoolId | None = field(default=None, init=False)
    # watched address -> its allocation at watch time
    ids: dict[int, Identity] = field(default_factory=dict, init=False)
    # the storages kept alive for graphs stopped before their first launch (their addresses)
    kept: set[int] = field(default_factory=set, init=False)
    device_type: str = "cuda"  # tensors on other devices hold no graph memory
    _active: bool = field(default=False, init=False)
    # empty_cache, wrapped to remember the last release
    _patches: Patches = field(default_factory=Patches, init=False)

    @property
    def event_source(self) -> str:
        return f"driver ({self.why})"

    def graph_walk(self):
        return None  # the walk goes through cuda-bindings

    # -- what the analysis asks --------------------------------------------------------------
    def view(
        self, device: int, sync: bool = True, own=(), own_pool: PoolId | None = None
    ) -> AskedMap:
        """Addresses answered by the driver; `own`: the capture's memory nodes."""
        freed = {
            wb.address: wb.size
            for g in self.tracker.graphs.values()
            for wb in g.blocks.values()
            if wb.freed is not None and wb.pool == DEFAULT_POOL
        }
        return AskedMap(self.driver().address_range, own, own_pool, freed)

    def sync(self) -> None:
        pass

    @staticmethod
    def site_frames(site) -> list:
        return []

    def capture_started(self, gid: int, stream: int, pool: PoolId | None) -> str:
        self.capture_pool = pool
        return f"graphsan capture {gid}"

    def capture_ended(self, tag: str, pool: PoolId) -> list:
        self.capture_pool = None
        return []  # no carves: the pool replay order needs the allocator's log

    def capture_failed(self, tag: str) -> None:
        self.capture_pool = None

    # -- frees, found before a replay ----------------------------------------------------------
    def _on_watch(self, addresses: list[int]) -> None:
        allocation = self.driver().allocation
        for a in addresses:
            ident = allocation(a)
            if ident is not None:
                self.ids[a] = ident

    def poll(self, state: GraphState) -> None:
        """Ask the driver about every allocation the graph watches: one that is gone, or was
        allocated anew at its address, counts as freed now."""
        allocation = self.driver().allocation
        for wb in list(state.blocks.values()):
            if wb.freed is not None or wb.address not in self.ids:
                continue
            if allocation(wb.address) != self.ids[wb.address]:
                self.ids.pop(wb.address, None)
                self.tracker.on_free(wb.address, self._free_found)

    # -- what the replay judge asks (core.memory_source.MemorySource) ------------------------
    judges_every_replay = True  # frees are found by asking before each replay
    mapped = None  # the driver cannot tell unmapped pages from freed memory here

    def prepare(self, state: GraphState) -> None:
        self.poll(state)

    @staticmethod
    def held(device: int) -> None:
        """No block map: nobody can say which outputs the caller holds."""
        return None

    def read_device(self, spans) -> list[bytes]:
        return read_now(self.driver, spans)

    def keep_alive(self, own) -> int:
        """This backend allocates a graph's memory (its memory-allocation nodes, `own`) when
        the graph launches, and PyTorch aborts the process when memory a graph never allocated
        is freed: the storages Python holds there (the capture's outputs) are kept alive until
        the process exits. Returns how many were kept."""
        ranges = sorted(own)
        starts = [start for start, _ in ranges]
        kept = 0
        for _, storage in storages_of(gc_tensors(), self.device_type):
            ptr = storage.data_ptr()
            i = bisect.bisect_right(starts, ptr) - 1
            if i < 0 or ptr >= ranges[i][0] + ranges[i][1] or ptr in self.kept:
                continue
            # a reference no one gives back: not even the interpreter's teardown frees it
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(storage))
            self.kept.add(ptr)
            kept += 1
        return kept

    @staticmethod
    def probe_refused() -> str | None:
        return "not probed: under this allocator backend the probe's captures would own memory"

    def _free_found(self) -> FreeEvent:
        phase, step = self.context.current()
        return FreeEvent((), phase, step, FREED_UNSEEN)

    def free_event(self) -> FreeEvent:
        """A free seen as it happens (pinned host memory, through its storage's finalizer)."""
        phase, step = self.context.current()
        return FreeEvent(python_stack(), phase, step, None, self.capture_pool)

    # -- start / stop ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._active:
            return
        self.tracker.mirror(self._on_watch)
        storage_ops.patch_empty_cache(self._patches, self)
        self._active = True

    def released(self) -> None:
        """`empty_cache()` returned: remembered as the last release (the driver cannot say what
        went back)."""
        with contextlib.suppress(Exception):
            phase, step = self.context.current()
            self.last_release = Release(tuple(python_stack()), phase, step)

    def stop(self) -> None:
        self._active = False
        if self.tracker.mirrored == self._on_watch:
            self.tracker.mirror(None)
        self._patches.restore()
        self.ids.clear()

"""What the replay judge (`MemorySource`), the capture analysis (`CaptureMemory`) and the
start-up probe (`ProbeMemory`) ask of the memory watch (pure: the protocols only).

Two watches answer the first two: `cuda.allocator.AllocatorWatch`, which follows the caching allocator's
events, and `cuda.driverwatch.DriverWatch`, which asks the driver where the allocator keeps no
block map (the cudaMallocAsync backend). The judge asks the same questions of both; what
differs is in the answers (a watch that cannot say gives None). Only the allocator watch lets
the probe run, and answers `ProbeMemory`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from graphsan.core.graph_state import GraphState
from graphsan.core.memory_map import MemoryMap, SegmentIndex
from graphsan.core.records import DataPtr, PoolId, Release


class MemorySource(Protocol):
    #: frees are found by asking before every replay of a watched graph, not seen as they happen
    judges_every_replay: bool
    #: the program's last empty_cache(), named by an `unmapped` finding
    last_release: Release | None

    def prepare(self, state: GraphState) -> None:
        """Before a judgement: bring what is known of the graph's memory up to date (asking
        the driver about every allocation the graph watches, or nothing where the allocator's
        events already told it)."""
        ...

    def view(self, device: int) -> MemoryMap:
        """The allocator's segments and blocks on `device` as of now."""
        ...

    def held(self, device: int) -> Callable[[], SegmentIndex] | None:
        """Who holds the pool's blocks now, asked only where a replay may write over one; None
        where the watch cannot say (no block map)."""
        ...

    @property
    def mapped(self) -> Callable[[DataPtr], bool] | None:
        """Whether an address's pages are mapped; None where an unmapped page cannot be told
        from freed memory."""
        ...

    def read_device(self, spans: Sequence[tuple[DataPtr, int]]) -> list[bytes]:
        """The bytes of each (address, size) of device memory (pointer tables), empty where it
        cannot be read now."""
        ...

    def keep_alive(self, own: Sequence[tuple[DataPtr, int]]) -> int:
        """A graph that allocates its own memory at launch (`own`) was stopped before its
        first launch: keep alive what Python holds there; how many storages were kept."""
        ...


class CaptureMemory(Protocol):
    """What the capture analysis asks of the memory watch, from a capture's begin to the
    watched graph (`runtime.capture`)."""

    def capture_started(self, gid: int, stream: int, pool: PoolId | None) -> str:
        """A capture began on `stream` into `pool` (None: a pool of its own, not known until
        it ends): frees from now until it ends are frees during a capture. Returns the tag of
        its entries in the allocator's log."""
        ...

    def capture_ended(self, tag: str, pool: PoolId) -> list:
        """The capture tagged `tag` ended into `pool`: the allocations it made, (address,
        requested size, allocation site) each, where the watch sees them."""
        ...

    def capture_failed(self, tag: str) -> None:
        """The capture tagged `tag` was invalidated: nothing of it is watched."""
        ...

    def view(self, device: int, sync: bool = True, own=(), own_pool: PoolId | None = None):
        """The memory a capture's arguments are confirmed against (`own`: the capture's own
        memory nodes, in `own_pool`)."""
        ...

    def graph_walk(self) -> object | None:
        """A compiled walk of a captured graph, where the watch loaded one; None otherwise."""
        ...

    def read_device(self, spans: Sequence[tuple[DataPtr, int]]) -> list[bytes]: ...

    def probe_refused(self) -> str | None:
        """Why the start-up probe may not run under this watch (None: it may; the watch then
        answers `ProbeMemory`)."""
        ...


class ProbeMemory(Protocol):
    """What the start-up probe asks of a watch that lets it run (`cuda.calibrate`)."""

    def probe_waits(self) -> bool:
        """The probe must wait for now: a watched capture is open, or eager allocations are
        routed to a graph pool."""
        ...

    def release_pool(self, pool: PoolId) -> str | None:
        """Give the probe's private pool back to the driver; None, or why not."""
        ...

    def captured_unseen(self) -> None:
        """Captures that bypass graphsan's hooks (the probe's) routed memory to pools."""
        ...

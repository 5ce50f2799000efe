"""What the replay judge asks of the memory watch (pure: the protocol only).

Two watches answer it: `cuda.allocator.AllocatorWatch`, which follows the caching allocator's
events, and `cuda.driverwatch.DriverWatch`, which asks the driver where the allocator keeps no
block map (the cudaMallocAsync backend). The judge asks the same questions of both; what
differs is in the answers (a watch that cannot say gives None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from graphsan.core.graph_state import GraphState
from graphsan.core.memory_map import MemoryMap, SegmentIndex
from graphsan.core.records import DataPtr, Release


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

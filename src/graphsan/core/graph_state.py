"""What graphsan keeps of one live graph (`GraphState`) and of each block graphs reference
(`WatchedBlock`), with the named transitions of a graph's state (pure: no CUDA, no torch).

A graph's state says whether its next replay must be judged (`dirty`), how it stands in its
pool's replay order (`order`, `reads`, `read_order`), and, for a graph that allocates its own
memory at launch, that memory and whether it ever launched. Only the tracker (`core.tracker`:
memory events) and the replay judge (`core.judgement`: replays) change it, through the methods
below; a test reads the code to keep it so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphsan.core.records import (
    DataPtr,
    Frame,
    FreeEvent,
    GraphId,
    GraphInfo,
    PoolId,
    Reference,
    ReferenceCounts,
)

if TYPE_CHECKING:
    from graphsan.core.baked import Baked
    from graphsan.core.pool_order import PoolOrder


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
    counts: ReferenceCounts
    dirty: bool = False  # its next replay is judged
    handed_over: int = 0  # blocks a later capture into the same pool consumed
    # its pool's replay order (graphsan.core.pool_order), which counts its replays when it
    # carved memory there; `reads`: it reads a range another graph of the pool writes and a
    # third re-carves, so each replay is checked against that order
    order: PoolOrder | None = None
    reads: bool = False
    read_order: PoolOrder | None = None  # the pool order that checks its reads
    # the graph's own memory, (address, bytes) of its memory-allocation nodes (how a capture
    # allocates under the cudaMallocAsync backend: the memory exists once the graph launched),
    # and whether a replay of it went ahead
    own: tuple[tuple[DataPtr, int], ...] = ()
    launched: bool = False
    # the state it baked at capture beside addresses: modes, values, entries (core.baked)
    baked: Baked | None = None
    # the stream its replay in progress launches on (where another graph's may race with it)
    stream: object = None

    # -- transitions (the tracker's and the replay judge's) ----------------------------------
    def mark_changed(self) -> None:
        """Memory the graph uses may have changed owner: its next replay is judged."""
        self.dirty = True

    def judged(self, again: bool) -> None:
        """A replay was judged; `again`: the next one is judged too."""
        self.dirty = again

    def block(self) -> None:
        """A replay was stopped: every later one is judged, and stopped while the cause lasts."""
        self.dirty = True

    def depends_on(self, baked: Baked | None) -> None:
        """What the graph baked at capture beside addresses (None or empty: nothing)."""
        self.baked = baked or None

    def replaying_on(self, stream: object) -> None:
        """Its replay about to launch runs on `stream`."""
        self.stream = stream

    def went_ahead(self) -> None:
        """A replay was let through to its launch."""
        self.launched = True

    def drop_own(self) -> tuple[tuple[DataPtr, int], ...]:
        """The graph's own memory, handed to whoever keeps it alive (once)."""
        own, self.own = self.own, ()
        return own

    def counted_in(self, order: PoolOrder) -> None:
        """Its pool is shared: its replays stamp the order of the ranges it carved."""
        self.order = order

    def checked_against(self, order: PoolOrder) -> None:
        """It reads (or writes over) another graph's range of the pool: each replay out of
        capture order is checked against `order`."""
        self.reads, self.read_order = True, order

    def hand_over(self, address: DataPtr) -> None:
        """A later capture into the same pool consumed the block: it is no longer watched."""
        self.blocks.pop(address, None)
        self.refs.pop(address, None)
        self.handed_over += 1

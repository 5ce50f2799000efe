"""The sanitizer's parts, built in the order they need each other.

The tracker asks the pinned-host registry and the replay orders about a block, so those two
come first (the orders share the tracker's dict of graphs, which is all they read of it); the
watches that feed the tracker (the allocator's, or the driver's where the backend keeps no
block map; the pinned host memory's) come after it, then the replay judge, which asks the
memory watch and learns from the recorder of what captures bake beside addresses (`cuda.baked`)
where a mode or an entry changed, and the capture analysis last, which hands each new graph to
the judge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphsan.core.eager import EagerInPools
from graphsan.core.judgement import ReplayJudge
from graphsan.core.pool_orders import ReplayOrders
from graphsan.core.races import Races
from graphsan.core.timeline import Timeline
from graphsan.core.tracker import Tracker
from graphsan.cuda import driverwatch
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.baked import BakedRecorder
from graphsan.cuda.context import Context
from graphsan.cuda.host import HostWatch, PinnedBlocks
from graphsan.cuda.streams import DeviceStreams, StreamWatch
from graphsan.runtime.capture import CaptureAnalysis


@dataclass(frozen=True)
class Parts:
    tracker: Tracker
    pool_orders: ReplayOrders
    memory: AllocatorWatch | driverwatch.DriverWatch
    host: HostWatch
    judge: ReplayJudge
    capture: CaptureAnalysis
    recorder: BakedRecorder
    streams: StreamWatch  # the orderings the program gives its streams


# (tracker, context, on_error, alloc_stacks, timeline, eager, driver) -> the memory watch
MemoryFactory = Callable[..., "AllocatorWatch | driverwatch.DriverWatch"]


def build(
    context: Context,
    timeline: Timeline,
    on_error: Callable[[BaseException], None],
    alloc_stacks: bool = True,
    rank: int | None = None,
    memory: MemoryFactory | None = None,
) -> Parts:
    """The parts; `memory` makes the memory watch (tests give a fake), else the allocator's
    watch, or the driver's where the allocator backend keeps no block map."""
    eager = EagerInPools()
    graphs: dict = {}
    backend = driverwatch.backend()
    native = backend == "native"
    site_frames = AllocatorWatch.site_frames if native else driverwatch.DriverWatch.site_frames
    pool_orders = ReplayOrders(graphs, site_frames, eager)
    pinned = PinnedBlocks()
    tracker = Tracker(
        graphs,
        host_owner=pinned.owner,
        order_reads=pool_orders.judges,
        handed_over=pool_orders.released,
    )
    if memory is not None:
        memory = memory(tracker, context, on_error, alloc_stacks, timeline, eager, driver)
    elif native:
        memory = AllocatorWatch(tracker, context, on_error, alloc_stacks, timeline, eager, driver)
    else:  # the driver sees no allocations, so no eager tensor in a graph's pool either
        why = driverwatch.no_block_map()
        memory = driverwatch.DriverWatch(
            tracker, context, on_error, alloc_stacks, why, driver, timeline
        )
    host = HostWatch(tracker, pinned, memory.free_event, on_error)
    recorder = BakedRecorder(context, tracker, on_error)
    races = Races()
    streams = StreamWatch(races, on_error, _capturing(memory))
    judge = ReplayJudge(
        tracker, pool_orders, memory, context.current, rank, recorder, races, DeviceStreams()
    )
    capture = CaptureAnalysis(memory, tracker, host, judge, timeline, recorder)
    return Parts(tracker, pool_orders, memory, host, judge, capture, recorder, streams)


def _capturing(memory) -> Callable[[int], bool]:
    """Whether a capture graphsan watches runs on a stream (its handle): the allocator's
    ledger knows each capture's stream; the driver's watch knows none."""
    if not isinstance(memory, AllocatorWatch):
        return lambda handle: False
    captures = memory.ledger.captures
    return lambda handle: any(stream == handle for stream, _ in list(captures.values()))


def driver():
    """graphsan.cuda.driver, imported on first use (it loads cuda-bindings and libcuda)."""
    from graphsan.cuda import driver

    return driver

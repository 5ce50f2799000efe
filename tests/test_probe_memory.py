"""The start-up probe's memory (graphsan.cuda.calibrate) on CPU: its eager tensors are routed to
its pool through torch's own calls, not graphsan's wrappers of them, and the allocator watch
gives the pool back only through the compiled library (else it says why). The probe itself and
the snapshot it leaves untouched are tested on the GPU (tests/test_gpu_probe_memory.py)."""

from __future__ import annotations

import torch

from graphsan.core.patches import Patches
from graphsan.core.tracker import Tracker
from graphsan.cuda import calibrate, storage_ops
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.context import Context


class Routes:
    """Listens to graphsan's wrappers of the routing calls."""

    def __init__(self) -> None:
        self.heard: list = []

    def route_begins(self, pool, per_thread) -> None:
        self.heard.append(("begin", pool))

    def route_ends(self, pool) -> None:
        self.heard.append(("end", pool))


def test_the_probe_routes_through_torchs_calls_not_graphsans_wrappers(monkeypatch):
    calls = []
    for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool"):
        monkeypatch.setattr(
            torch._C, name, lambda d, p, name=name: calls.append((name, d, p)), raising=False
        )
    monkeypatch.setattr(
        torch._C, "_cuda_releasePool", lambda d, p: calls.append(("release", d, p)), raising=False
    )
    listener, patches = Routes(), Patches()
    storage_ops.patch_pool_routing(patches, listener)
    try:
        route, unroute = calibrate._routing()
        route(0, (0, 9))
        unroute(0, (0, 9))
    finally:
        patches.restore()
    assert listener.heard == [], "graphsan's wrappers would count the probe's tensors as eager"
    assert calls == [
        ("_cuda_beginAllocateCurrentThreadToPool", 0, (0, 9)),
        ("_cuda_endAllocateToPool", 0, (0, 9)),
        ("release", 0, (0, 9)),
    ]


def test_without_the_compiled_tracker_the_probes_pool_stays_and_says_why():
    watch = AllocatorWatch(Tracker(), Context(), lambda err: None, alloc_stacks=False)
    assert watch.log is None
    assert watch.release_pool((0, 3)) == (
        "the compiled tracker is not loaded: the pool's memory stays cached until the "
        "program's own empty_cache()"
    )

"""The start-up probe's memory (graphsan.cuda.calibrate) on CPU: its eager tensors are routed to
its pool through torch's own calls, not graphsan's wrappers of them, and the allocator watch
gives the pool back only through the compiled library (else it says why). The probe runs end
to end over a fake allocator that refuses what PyTorch's refuses (tests/fake_cuda.py), each
family's launch replaced by its recorded H200 nodes; the probe's real launches and the snapshot
it leaves untouched are tested on the GPU (tests/test_gpu_probe_memory.py)."""

from __future__ import annotations

import torch

from graphsan.core.patches import Patches
from graphsan.core.tracker import Tracker
from graphsan.cuda import calibrate, storage_ops
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.context import Context
from tests import fake_cuda
from tests.test_argstructs import h200_probes


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
        monkeypatch.setattr(torch.cuda, "MemPool", None, raising=False)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 9))
        route = calibrate.Route(0)
        route.open()
        route.close()
    finally:
        patches.restore()
    assert listener.heard == [], "graphsan's wrappers would count the probe's tensors as eager"
    assert calls == [
        ("_cuda_beginAllocateCurrentThreadToPool", 0, (0, 9)),
        ("_cuda_endAllocateToPool", 0, (0, 9)),
        ("release", 0, (0, 9)),
    ]


def test_without_the_compiled_tracker_a_pool_that_emptied_itself_is_released(monkeypatch):
    """A dropped MemPool empties its own pool; a graph pool handle's pool stays cached
    without the compiled library, and the watch says why."""
    from graphsan.cuda import allocator

    watch = AllocatorWatch(Tracker(), Context(), lambda err: None, alloc_stacks=False)
    assert watch.tracelog is None
    left = {(0, 3): 0, (0, 4): 2}
    monkeypatch.setattr(allocator, "pool_segments", lambda pool: left[tuple(pool)])
    assert watch.release_pool((0, 3)) is None
    assert watch.release_pool((0, 4)) == (
        "the compiled tracker is not loaded: the pool's memory stays cached until the "
        "program's own empty_cache()"
    )


def test_the_probe_leaves_no_pool_holding_memory_without_the_compiled_library(monkeypatch):
    """On the GPU, without the compiled tracker, the probe left 4 segments in its pool: the
    program's snapshot and memory_stats showed them. Its pool is now a MemPool, which empties
    itself when the probe drops it."""
    alloc = fake_cuda.install_allocator(monkeypatch)
    monkeypatch.setattr(calibrate, "_LAUNCHES", recorded_launches(alloc))
    nothing_released = []
    layouts, _, kept = calibrate.calibrate(lambda stream: [], nothing_released.append)
    assert nothing_released and kept is None
    assert layouts.summary() == dict.fromkeys(calibrate_families(), "confirmed"), layouts.why
    assert alloc.pools_holding_segments() == {}, "the program's snapshot would show them"
    assert alloc.uses == {}, "a pool the probe made is still in use"
    assert alloc.aborted is None


def recorded_launches(alloc: fake_cuda.FakeAllocator) -> tuple:
    """Each family's launch as the probe makes it (eager inputs, a warm-up, a captured call
    whose output the graph owns), its nodes those the H200 recorded."""
    by_family: dict[str, list] = {}
    for probe in h200_probes():
        by_family.setdefault(probe.family, []).append(probe)

    def launch(family):
        def run(walk, route):
            inputs = [alloc.Tensor() for _ in range(3)]  # noqa: F841 (alive through the capture)
            probes = by_family[family]
            nodes, _ = calibrate._captured(
                lambda stream: [p.node for p in probes], route, alloc.Tensor, lambda out: {}
            )
            return [p for p in probes if p.node in nodes]

        return family, run

    return tuple(launch(family) for family in by_family)


def test_the_probe_confirms_every_family_and_leaves_no_pool_holding_memory(monkeypatch):
    """The allocator refuses a capture into a pool the thread's allocations are routed to: the
    probe pauses its route around each capture, keeps the pool's use counts even, lands the
    generator's graph-safe state in its own pool, and gives the pool back whole."""
    alloc = fake_cuda.install_allocator(monkeypatch)
    monkeypatch.setattr(calibrate, "_LAUNCHES", recorded_launches(alloc))
    layouts, _, kept = calibrate.calibrate(lambda stream: [], alloc.empty_cache)
    assert layouts.summary() == dict.fromkeys(calibrate_families(), "confirmed"), layouts.why
    assert kept is None
    assert alloc.pools_holding_segments() == {}, "the program's snapshot would show them"
    assert alloc.recording == [] and not alloc.generator_capturing
    assert alloc.uses == {}, "a pool the probe made is still in use"
    assert alloc.aborted is None


def test_a_capture_that_cannot_begin_stops_the_probe_and_says_why(monkeypatch):
    alloc = fake_cuda.install_allocator(monkeypatch)
    monkeypatch.setattr(calibrate, "_LAUNCHES", recorded_launches(alloc))

    def refused(graph, pool=None, capture_error_mode="global"):
        alloc._register(graph)
        alloc.generator_capturing = True
        alloc.uses[tuple(pool)] += 1  # torch takes a use of the pool before it can fail
        raise RuntimeError("CUDA error: operation not permitted")

    monkeypatch.setattr(alloc.Graph, "capture_begin", refused)
    layouts, _, kept = calibrate.calibrate(lambda stream: [], alloc.empty_cache)
    why = layouts.summary()
    first = "the probe stopped: a capture could not begin (RuntimeError: CUDA error: operation"
    assert all(w.startswith(first) for w in why.values()), why
    assert kept is not None and kept.endswith("segment(s) stayed: the pool is in use"), kept
    assert alloc.recording == []
    assert alloc.aborted is None, "the probe's MemPool was dropped while its pool was in use"
    assert calibrate._STRANDED, "the pool something still uses is kept for the process"
    calibrate._STRANDED.clear()


def calibrate_families() -> tuple[str, ...]:
    from graphsan.core.argstructs import FAMILIES

    return FAMILIES

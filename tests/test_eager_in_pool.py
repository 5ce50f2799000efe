"""Tensors eager code allocates into a graph's pool over memory the graph's capture carved (CPU):
the model (`core.eager`), the allocator adapter that finds them in its log, and the replay that
would write over one, through the sanitizer's hooks with the CUDA side faked."""

from __future__ import annotations

import random

import pytest
import torch

from graphsan.core.allocview import AllocatorView
from graphsan.core.eager import EagerInPools
from graphsan.core.tracker import Tracker
from graphsan.cuda import allocator, allocator_log, hooks
from graphsan.cuda.context import Context
from graphsan.report import StaleMemoryError, format_finding
from tests import fake_cuda

POOL, OTHER_POOL = (1, 3), (1, 4)


# -- the model ------------------------------------------------------------------------------
def test_a_tensor_over_a_carve_is_marked_on_each_graph_that_carved_there():
    e = EagerInPools()
    e.add_capture(1, 0, POOL, [(0x1000, 0x100, None), (0x3000, 0x100, None)])
    e.add_capture(2, 0, POOL, [(0x1080, 0x100, None)])
    assert e.allocated(0, POOL, 0x1040, 0x80, "site", "train", 3) == [1, 2]
    (t,) = e.marked(1)
    assert (t.start, t.size, t.site, t.when) == (0x1040, 0x80, "site", " in phase train, step 3")
    assert [m.writer for m in e.marked(2)] == [2]


@pytest.mark.parametrize(
    "device, pool, start, size",
    [
        (0, POOL, 0x1100, 0x100),  # just past the carve
        (0, POOL, 0x0F00, 0x100),  # just before it
        (0, OTHER_POOL, 0x1000, 0x100),  # another pool
        (1, POOL, 0x1000, 0x100),  # another device
        (0, POOL, 0x1000, 0),  # nothing
    ],
)
def test_a_tensor_beside_every_carve_marks_nothing(device, pool, start, size):
    e = EagerInPools()
    e.add_capture(1, 0, POOL, [(0x1000, 0x100, None)])
    assert e.allocated(device, pool, start, size) == [] and e.marks == {}


def test_a_later_capture_carving_the_memory_clears_the_mark():
    """The allocator hands a capture only free memory: the tensor went before it."""
    e = EagerInPools()
    e.add_capture(1, 0, POOL, [(0x1000, 0x100, None)])
    e.allocated(0, POOL, 0x1000, 0x100)
    e.add_capture(2, 0, OTHER_POOL, [(0x1000, 0x100, None)])  # another pool: no proof
    assert len(e.marked(1)) == 1
    e.add_capture(3, 0, POOL, [(0x10C0, 0x40, None)])
    assert e.marked(1) == [] and e.marks == {}


def test_a_newer_tensor_at_the_same_address_replaces_the_older_and_gone_takes_it():
    e = EagerInPools()
    e.add_capture(1, 0, POOL, [(0x1000, 0x100, None)])
    e.allocated(0, POOL, 0x1000, 0x100, "old")
    e.allocated(0, POOL, 0x1000, 0x80, "new")
    (t,) = e.marked(1)
    assert t.site == "new"
    e.gone(t)
    assert e.marks == {}


def test_forgetting_graphs_leaves_no_trace_of_them():
    rng = random.Random(7)
    e = EagerInPools()
    gids = list(range(1, 40))
    for gid in gids:
        carves = [(rng.randrange(0, 1 << 20, 256), rng.randrange(256, 8192, 256), None)]
        e.add_capture(gid, 0, POOL, carves * rng.randint(1, 2))
    for _ in range(30):
        e.allocated(0, POOL, rng.randrange(0, 1 << 20, 256), 512)
    rng.shuffle(gids)
    for gid in gids:
        e.forget(gid)
    assert e.marks == {} and e._carves == {} and e._of == {}


def test_marks_match_a_brute_force_overlap_on_random_carves():
    rng = random.Random(11)
    e = EagerInPools()
    carves: dict[int, list[tuple[int, int]]] = {}
    for gid in range(1, 25):
        cs = [(rng.randrange(0, 1 << 16, 64), rng.randrange(64, 4096, 64)) for _ in range(3)]
        carves[gid] = cs
        e.add_capture(gid, 0, POOL, [(a, n, None) for a, n in cs])
    for _ in range(200):
        start, size = rng.randrange(0, 1 << 16, 64), rng.randrange(64, 2048, 64)
        want = sorted(
            g for g, cs in carves.items() if any(a < start + size and start < a + n for a, n in cs)
        )
        assert sorted(e.allocated(0, POOL, start, size)) == want


# -- the adapter: the log's eager allocations into a routed pool ----------------------------
STREAM, SEG, MB2 = 0x5000, 0x7F00_1000_0000, 2 << 20


def _entry(action: str, addr: int, size: int, stream: int = STREAM, tag: str = "") -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "user_metadata": tag}


@pytest.fixture
def watch(monkeypatch):
    """An AllocatorWatch over a faked allocator log (`log`: what the next drain reads) whose
    view holds one segment of POOL; graph 1 carved its first 4 KiB."""
    fake = {"log": []}

    def snapshot(pool=(0, 0), traces=False):
        entries, fake["log"] = fake["log"], []
        return {"segments": [], "device_traces": [entries]}

    monkeypatch.setattr(allocator_log, "_snapshot", snapshot)
    monkeypatch.setattr(allocator_log, "_empty_pool_id", lambda: (0, 99))
    monkeypatch.setattr(
        allocator_log.AllocatorLog, "record_history", lambda self, clear=False: None
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 7}))
    eager = EagerInPools()
    eager.add_capture(1, 0, POOL, [(SEG, 4096, None)])
    w = allocator.AllocatorWatch(Tracker(), Context(), lambda err: None, eager=eager)
    w.ledger.views[0] = AllocatorView()
    seg = {"address": SEG, "total_size": MB2, "segment_pool_id": POOL, "blocks": []}
    w.ledger.views[0].seed({"segments": [seg]}, 0)
    w._active = True
    return w, fake, eager


def test_an_allocation_routed_into_the_pool_is_marked(watch):
    w, fake, eager = watch
    w.route_begins(POOL, per_thread=True)
    fake["log"] = [_entry("alloc", SEG, 1024)]
    w.route_ends(POOL)
    assert [(t.start, t.size) for t in eager.marked(1)] == [(SEG, 1024)]
    assert w.ledger.routes == []


def test_allocations_outside_a_route_or_on_another_stream_are_not_eager(watch):
    w, fake, eager = watch
    fake["log"] = [_entry("alloc", SEG, 1024)]
    w.sync()  # no route: a capture's own allocation or a snapshot's seed, not eager code
    w.route_begins(POOL, per_thread=False)  # this stream (7) only
    fake["log"] = [_entry("alloc", SEG + 1024, 1024, stream=STREAM)]
    w.route_ends(POOL)
    w.route_begins(OTHER_POOL, per_thread=True)  # a route to another pool
    fake["log"] = [_entry("alloc", SEG + 2048, 1024)]
    w.route_ends(OTHER_POOL)
    assert eager.marks == {}


def test_a_captures_tagged_allocation_inside_a_route_is_the_captures(watch):
    w, fake, eager = watch
    w.route_begins(POOL, per_thread=True)
    tag = w.capture_started(2, STREAM, None)
    fake["log"] = [_entry("alloc", SEG, 1024, tag=tag)]
    w.sync()
    w.capture_failed(tag)
    w.route_ends(POOL)
    assert eager.marks == {}


# -- the replay, through the sanitizer's hooks ----------------------------------------------
SLOT = 4096
A, B = fake_cuda.SEG, fake_cuda.SEG + SLOT


@pytest.fixture
def san(monkeypatch, attach, fake_sanitizer):
    """A sanitizer under `raise` whose one graph `g` reads A and carved B as scratch (free after
    the capture); `state["map"]` is the allocator view it sees."""
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    state["map"] = fake_cuda.one_segment([(SLOT, "active_allocated"), (SLOT, "inactive")], POOL)
    cls = fake_cuda.graph_class(monkeypatch, POOL, attach)
    s = fake_sanitizer(state, "raise")
    state["nodes"], state["carves"] = [fake_cuda.kernel(0, A, B)], [(B, SLOT, None)]
    g = cls()
    g.capture_begin(POOL)
    g.capture_end()
    return s, g, state


def _hold_b(state, held: bool) -> None:
    b = "active_allocated" if held else "inactive"
    state["map"] = fake_cuda.one_segment([(SLOT, "active_allocated"), (SLOT, b)], POOL)


def test_a_replay_over_a_held_eager_tensor_is_stopped_and_names_it(san):
    s, g, state = san
    g.replay()
    _hold_b(state, True)
    with s.context.phase("validation", step=4):
        s.memory._eager_allocated(0, POOL, B, SLOT)
    with pytest.raises(StaleMemoryError) as err:
        g.replay()
    assert g.launched == 1, "the replay that overwrites the tensor must not run"
    (f,) = err.value.findings
    assert f.kind == "live-output" and f.block_address == B and f.nbytes == SLOT
    assert (f.node, f.param, f.offset) == (0, 1, 0)  # the kernel's second argument, into B
    assert f.order.written_by is None and "eager code allocated into the pool" in f.now
    assert "in phase validation, step 4" in f.now
    text = format_finding(f)
    assert "eager code was handed the memory after the graph's capture" in text
    assert "allocate the tensor outside the pool" in text and "graph #None" not in text


def test_once_the_tensor_is_freed_replays_are_quiet_and_cost_no_more_asks(san):
    s, g, state = san
    _hold_b(state, True)
    s.memory._eager_allocated(0, POOL, B, SLOT)
    _hold_b(state, False)  # freed before the replay: the graph's scratch again
    for _ in range(3):
        g.replay()
    assert g.launched == 3 and s.findings == []
    assert s.pool_orders.eager.marks == {}
    assert not hooks.graph_state(g).dirty


def test_a_tensor_outside_the_graphs_carves_is_quiet(san):
    s, g, state = san
    s.memory._eager_allocated(0, POOL, B + SLOT, SLOT)
    g.replay()
    assert g.launched == 1 and s.findings == []

"""The process's replay orders (graphsan.core.pool_orders) over a plain tracker and memory map, no CUDA:
which graphs a shared pool checks, the findings it names, and the frees it takes from the
tracker."""

from __future__ import annotations

from graphsan.core.judgement import ReplayJudge
from graphsan.core.memory_map import MemoryMap
from graphsan.core.pool_orders import ReplayOrders
from graphsan.core.records import GraphInfo, Judged, Reference, When
from graphsan.core.tracker import Tracker
from tests.fake_memory import FakeMemory

SEG, SLOT, POOL = 0x7E00_0000_0000, 4096, (1, 3)
B, C, D, E = (SEG + i * SLOT for i in range(4))
SITE = [("model.py", 12, "forward")]


def pool_map() -> MemoryMap:
    blocks = [{"address": a, "size": SLOT, "state": "active_allocated"} for a in (B, C, D, E)]
    seg = {"address": SEG, "total_size": 4 * SLOT, "segment_pool_id": POOL, "blocks": blocks}
    return MemoryMap.from_snapshot({"segments": [seg]})


def capture(tracker, orders, gid, reads, carves):
    info = GraphInfo(gid, f"g{gid}", [], POOL, 0)
    refs = [Reference(0, "k", i, 0, a) for i, a in enumerate(reads)]
    view = pool_map()
    tracker.add_graph(info, refs, view)
    ReplayJudge(tracker, orders, FakeMemory()).join_order(
        info, [(a, SLOT, f"site{gid}") for a in carves], refs, view
    )
    return tracker.graphs[gid]


def three_successive():
    """g0 writes b, c, d; g1 reads c and writes e; g2 reads d and re-carves c."""
    tracker = Tracker()
    orders = ReplayOrders(tracker.graphs, site_frames=lambda site: SITE if site == "site0" else [])
    g0 = capture(tracker, orders, 0, [B, C, D], [B, C, D])
    g1 = capture(tracker, orders, 1, [C, E], [E])
    g2 = capture(tracker, orders, 2, [D, C], [C])
    return tracker, orders, (g0, g1, g2)


def test_the_reader_and_the_overwriter_are_checked_and_the_carvers_replays_are_counted():
    _, orders, (g0, g1, g2) = three_successive()
    # g1 reads c; g0 writes c, where g2 carved its output
    assert (g0.reads, g1.reads, g2.reads) == (True, True, False)
    assert g0.order is g2.order is orders.orders[(0, POOL)]
    assert orders.hazards(g0) == [] and orders.hazards(g1) == []


def test_a_finding_names_writer_and_carver_and_a_forgotten_carver_as_gone():
    tracker, orders, (g0, g1, g2) = three_successive()
    order = orders.orders[(0, POOL)]
    for gid in (0, 2):
        order.replayed(gid)
    (f,) = orders.judge(g1, lambda: When("eval", 7, Judged(rank=3, found_at=12.5)), view=None)
    o = f.order
    assert (f.kind, o.written_by, o.carved_by, f.block_address) == ("replay-order", 0, 2, C)
    assert (f.phase, f.step, f.rank, f.found_at) == ("eval", 7, 3, 12.5)
    assert f.alloc_stack == tuple(SITE)  # the producer's carve site, as the adapter reads it
    assert "graph #2 'g2'" in f.now
    orders.forget(2)
    tracker.forget(2)
    (f,) = orders.judge(g1, lambda: When("eval", 7, Judged()), view=None)
    assert "graph #2 (gone)" in f.now


def test_a_block_every_watcher_carved_or_reads_is_the_orders_to_judge():
    tracker, orders, _ = three_successive()
    c = tracker.live[C]
    assert c.graphs == {0, 1, 2} and orders.judges(c)
    orders.enabled = False
    assert not orders.judges(c)


def test_a_graph_alone_in_its_pool_that_carved_nothing_makes_no_order():
    tracker = Tracker()
    orders = ReplayOrders(tracker.graphs, site_frames=lambda site: [])
    capture(tracker, orders, 0, [B], [])
    assert orders.orders == {} and not orders.judges(tracker.live[B])


def test_a_pools_first_capture_waits_until_the_order_needs_it():
    tracker = Tracker()
    orders = ReplayOrders(tracker.graphs, site_frames=lambda site: [])
    g0 = capture(tracker, orders, 0, [B, C], [B, C])
    order = orders.orders[(0, POOL)]
    assert order.sequence == [] and g0.order is None  # alone: nothing to follow yet
    assert order.judges(0, B + 8) and not order.judges(0, D)  # its own carves, still aside
    assert order.sequence == [] and not order.judges(1, B) and order.sequence == [0]
    tracker2 = Tracker()
    orders2 = ReplayOrders(tracker2.graphs, site_frames=lambda site: [])
    capture(tracker2, orders2, 0, [B, C], [B, C])
    g1 = capture(tracker2, orders2, 1, [C], [D])  # a second capture joins: both in order
    order2 = orders2.orders[(0, POOL)]
    assert order2.sequence == [0, 1] and g1.order is order2
    assert tracker2.graphs[0].order is order2 and order2.reads[1][0][0].producer == 0
    orders2.forget(0)
    tracker3 = Tracker()
    orders3 = ReplayOrders(tracker3.graphs, site_frames=lambda site: [])
    capture(tracker3, orders3, 0, [B], [B])
    orders3.forget(0)  # forgotten while alone: never registered
    capture(tracker3, orders3, 1, [B], [B])
    assert orders3.orders[(0, POOL)].sequence == []

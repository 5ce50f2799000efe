"""A replay that writes over an output the caller still holds (graphsan.core.pool_order's
`Overwrite`, graphsan.core.pool_orders's `live-output` findings): a 1F1B pipeline's graphs replayed in
another schedule, capture-order cycles, graphs of one pool that pass no data, and a property test
against a simulation of the pool's memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.core.judgement import ReplayJudge
from graphsan.core.memory_map import MemoryMap
from graphsan.core.pool_order import PoolOrder, first_refs_into
from graphsan.core.pool_orders import ReplayOrders
from graphsan.core.records import GraphInfo, Judged, Reference, When
from graphsan.core.tracker import Tracker
from tests.fake_memory import FakeMemory

BASE, SLOT, POOL = 0x7E00_0000_0000, 4096, (1, 3)


def at(slot: int) -> int:
    return BASE + slot * SLOT


def ref(slot: int, node: int = 0) -> Reference:
    return Reference(node, f"k{node}", 0, 0, at(slot) + 8)


def carve(*slots: int):
    return [(at(s), SLOT, f"site{s}") for s in slots]


# 1F1B on one stage, two microbatches, captured in the schedule's order: forward mb0 keeps its
# activation (slot 0) and uses scratch (4); forward mb1 keeps slot 1 and reuses the scratch;
# backward mb1 reads slot 1 and writes its input gradient to 5 (slot 1 is dropped then);
# backward mb0 reads slot 0 and carves its input gradient from slot 1
F0, F1, B1, B0 = 0, 1, 2, 3
CAPTURES = {
    F0: (carve(0, 4), [ref(0), ref(4, 1)]),
    F1: (carve(1, 4), [ref(1), ref(4, 1)]),
    B1: (carve(5), [ref(1), ref(5, 1)]),
    B0: (carve(1), [ref(0), ref(1, 1)]),
}


def one_f_one_b(captures=CAPTURES) -> PoolOrder:
    o = PoolOrder()
    for gid, (carved, refs) in captures.items():
        o.add_graph(gid, carved, refs, first_refs_into(carved, refs))
    return o


def run(o: PoolOrder, sequence) -> list[tuple[int, int]]:
    """Replay `sequence`: (writer, producer) of each overwrite found, in order."""
    hits = []
    for g in sequence:
        hits += [(w.writer, w.producer) for w in o.overwritten(g)]
        o.replayed(g)
    return hits


def test_capture_order_and_its_restarts_are_quiet():
    assert run(one_f_one_b(), [F0, F1, B1, B0] * 4) == []


def test_another_schedule_writes_forward_mb1_over_backward_mb0s_output():
    assert run(one_f_one_b(), [F0, B0, F1]) == [(F1, B0)]
    o = one_f_one_b()
    assert run(o, [F0, B0]) == []
    (w,) = o.overwritten(F1)
    assert (w.start, w.end, w.site) == (at(1), at(2), "site1")
    assert o.first_ref(F1, w.start, w.end).address == ref(1).address


def test_outputs_of_the_last_pass_are_not_this_passs_to_protect():
    """Backward mb1 carves its gradient from the forwards' scratch: after a full pass the next
    one restarts at forward mb0, and forward mb1 may write over last pass's gradient."""
    captures = dict(CAPTURES)
    captures[B1] = (carve(4), [ref(1), ref(4, 1)])
    assert run(one_f_one_b(captures), [F0, F1, B1, B0, F0, B0, F1]) == [(F1, B0)]


def test_the_writer_having_run_after_the_producer_is_quiet():
    o = one_f_one_b()
    assert run(o, [F0, F1, B0, B1, B0]) == []  # backward mb0 ran last: its output is fresh
    assert run(o, [F0, F1]) == []  # a restart: the last pass's outputs were the caller's to read


def test_an_output_the_pools_graphs_have_all_read_since_is_handed_on():
    """Backward mb0's input gradient goes to a graph of the previous layer (6), not to the
    caller: once that reader replayed after backward mb0, forward mb1 may write over it."""
    captures = dict(CAPTURES)
    captures[6] = (carve(7), [ref(1), ref(7, 1)])  # reads backward mb0's gradient (slot 1)
    assert run(one_f_one_b(captures), [F0, B0, 6, F1]) == []
    # before its reader ran, the gradient is still fresh data that forward mb1 would destroy
    assert run(one_f_one_b(captures), [F0, B0, F1]) == [(F1, B0)]
    # read once, then written again by its producer: fresh again until the reader runs
    assert run(one_f_one_b(captures), [F0, B0, 6, B0, F1]) == [(F1, B0)]


def test_an_output_another_graph_ran_after_is_handed_on():
    """Per-layer graphs of one microbatch's backward captured in a 1F1B order: backward layer 1
    carves its input gradient from forward mb1's scratch, and backward layer 0 runs next, so the
    caller has copied that gradient on by the time forward mb1 replays (the lab's step replayed
    sequentially over graphs captured 1F1B, whose losses equal eager's). Only forward mb1 right
    after backward layer 1 is the hazard."""
    o = PoolOrder()
    captures = [
        (0, carve(0), [ref(0)]),  # forward mb0 (layer 0 and 1 in one graph here)
        (1, carve(1, 4), [ref(1), ref(4, 1)]),  # forward mb1: activation 1, scratch 4
        (2, carve(4), [ref(0), ref(4, 1)]),  # backward mb0, layer 1: gradient carved from 4
        (3, carve(5), [ref(0), ref(5, 1)]),  # backward mb0, layer 0
    ]
    for gid, carved, refs in captures:
        o.add_graph(gid, carved, refs, first_refs_into(carved, refs))
    assert run(o, [0, 2, 3, 1]) == []
    o = PoolOrder()
    for gid, carved, refs in captures:
        o.add_graph(gid, carved, refs, first_refs_into(carved, refs))
    assert run(o, [0, 3, 2, 1]) == [(1, 2)]


def test_graphs_that_pass_no_data_are_never_judged():
    """One graph per batch size in one pool, each output read before the next replay: a later
    capture's output sits in an earlier one's scratch, and any order is correct."""
    o = PoolOrder()
    o.add_graph(0, carve(0, 4), [ref(0), ref(4)])
    o.add_graph(1, carve(4), [ref(4)])  # its output in graph 0's scratch
    assert o.new_overwriters() == []
    assert run(o, [1, 0, 1, 0, 0, 1]) == []


def test_overwriters_are_announced_once_from_the_first_read():
    o = PoolOrder()
    o.add_graph(F0, *CAPTURES[F0])
    o.add_graph(F1, *CAPTURES[F1])
    assert o.new_overwriters() == []  # no graph reads another's output yet
    o.add_graph(B1, *CAPTURES[B1])
    assert o.new_overwriters() == [F0]  # forward mb1 carved forward mb0's scratch
    o.add_graph(B0, *CAPTURES[B0])
    assert o.new_overwriters() == [F1]
    assert o.new_overwriters() == []


def test_a_forgotten_producer_or_writer_is_quiet():
    o = one_f_one_b()
    o.forget(B0)
    assert run(o, [F0, B0, F1]) == []
    o = one_f_one_b()
    o.forget(F1)
    assert o.overwritten(F1) == []


def pool_map(live_slots) -> MemoryMap:
    blocks = [
        {
            "address": at(s),
            "size": SLOT,
            "state": "active_allocated" if s in live_slots else "inactive",
        }
        for s in range(8)
    ]
    seg = {"address": BASE, "total_size": 8 * SLOT, "segment_pool_id": POOL, "blocks": blocks}
    return MemoryMap.from_snapshot({"segments": [seg]})


def orders_1f1b():
    tracker = Tracker()
    orders = ReplayOrders(tracker.graphs, site_frames=lambda site: [("train.py", 7, site)])
    view = pool_map({0, 1, 5})
    states = {}
    for gid, (carved, refs) in CAPTURES.items():
        info = GraphInfo(gid, ["fwd mb0", "fwd mb1", "bwd mb1", "bwd mb0"][gid], [], POOL, 0)
        tracker.add_graph(info, refs, view)
        ReplayJudge(tracker, orders, FakeMemory()).join_order(info, carved, refs, view)
        states[gid] = tracker.graphs[gid]
    return orders, states


def test_the_finding_names_the_output_its_producer_the_node_and_both_replays():
    orders, states = orders_1f1b()
    assert states[F1].reads and states[F0].reads  # both may write over a later output
    order = orders.orders[(0, POOL)]
    for g in (F0, B0):
        order.replayed(g)
    overs = orders.overwritten(states[F1])
    judged = Judged(rank=2, found_at=5.0)
    (f,) = orders.live_outputs(
        states[F1].info, overs, pool_map({0, 1, 5}), When("train", 3, judged)
    )
    o = f.order
    assert (f.kind, o.written_by, f.block_address, o.replays) == ("live-output", B0, at(1), (2, 3))
    assert (f.node, f.address) == (0, ref(1).address)  # forward mb1's kernel that writes there
    assert f.alloc_stack == (("train.py", 7, "site1"),)  # where backward mb0 carved its output
    assert "graph #3 'bwd mb0'" in f.now and (f.phase, f.step, f.rank) == ("train", 3, 2)
    assert "pin cannot help" in f.likely_cause


def test_an_output_the_caller_dropped_is_no_finding():
    orders, states = orders_1f1b()
    order = orders.orders[(0, POOL)]
    for g in (F0, B0):
        order.replayed(g)
    overs = orders.overwritten(states[F1])
    assert orders.live_outputs(states[F1].info, overs, pool_map({0, 5}), When()) == []


# -- property: the model against the pool's memory ------------------------------------------


@st.composite
def programs(draw):
    """Captures into one pool: each carves a few of 6 slots (its outputs: those still its own
    when the program ends) and reads earlier graphs' slots; then a replay sequence."""
    n = draw(st.integers(2, 5))
    captures = []
    for _ in range(n):
        carved = sorted(set(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))))
        reads = sorted(set(draw(st.lists(st.integers(0, 5), max_size=2))))
        captures.append((carved, reads))
    sequence = draw(st.lists(st.integers(0, n - 1), max_size=14))
    return captures, sequence


def build(captures) -> tuple[PoolOrder, dict[int, int]]:
    o = PoolOrder()
    latest: dict[int, int] = {}
    for g, (carved, reads) in enumerate(captures):
        refs = [ref(s, i) for i, s in enumerate(carved + reads)]
        o.add_graph(g, carve(*carved), refs, first_refs_into(carve(*carved), refs))
        latest.update(dict.fromkeys(carved, g))
    return o, latest


@settings(max_examples=300, deadline=None)
@given(programs(), st.integers(1, 3))
def test_capture_order_cycles_are_always_quiet(program, cycles):
    captures, _ = program
    o, _ = build(captures)
    assert run(o, list(range(len(captures))) * cycles) == []


@settings(max_examples=400, deadline=None)
@given(programs())
def test_every_overwrite_found_really_destroys_fresh_data_of_a_later_graph(program):
    """Simulated memory: each slot holds the graph that wrote it last. Whatever the model finds,
    the slot holds the producer's data, the producer was captured after the writer and ran after
    it, and the writer carves that slot."""
    captures, sequence = program
    o, latest = build(captures)
    owner: dict[int, int] = {}
    ran: dict[int, int] = {}
    for t, g in enumerate(sequence):
        for w in o.overwritten(g):
            slots = range((w.start - BASE) // SLOT, (w.end - BASE + SLOT - 1) // SLOT)
            assert any(owner.get(s) == w.producer and latest[s] == w.producer for s in slots)
            assert w.producer > g and ran[w.producer] > ran.get(g, -1)
            assert set(slots) <= set(captures[g][0])
        for s in captures[g][0]:
            owner[s] = g
        ran[g] = t
        o.replayed(g)


@settings(max_examples=300, deadline=None)
@given(programs())
def test_a_later_graph_moved_before_an_earlier_one_that_overwrites_it_is_caught(program):
    """Capture order with graph j run right before graph i < j (i not the first: replaying
    that one starts a new pass): where i carves a slot whose latest carve is j's, and the pool
    passes data, j's fresh output there is found."""
    captures, _ = program
    n = len(captures)
    o, latest = build(captures)
    if not o.reads:
        return
    for i in range(1, n):
        for j in range(i + 1, n):
            if any(latest[s] == j for s in captures[i][0]):
                order = list(range(n))
                sequence = order + order[:i] + [j] + order[i:]
                o2, _ = build(captures)
                assert (i, j) in run(o2, sequence)
                return

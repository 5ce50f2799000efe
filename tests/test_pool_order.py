"""The replay order of graphs sharing a pool (graphsan.core.pool_order): PyTorch's own out-of-order
sequence, legal orders, restarts, and a simulation of the pool's memory as the reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.core.pool_order import PoolOrder
from graphsan.core.records import Reference

BASE = 0x7E00_0000_0000
SLOT = 4096


def ref(slot, node=0):
    return Reference(node, "k", 0, 0, BASE + slot * SLOT + 8)


def carve(*slots):
    return [(BASE + s * SLOT, SLOT, None) for s in slots]


def three_successive():
    """PyTorch's test_graph_three_successive in slots: g0 carves b, c, d; g1 reads c and carves
    e (c is freed while g1 is captured); g2 reads d and carves f over c's memory."""
    o = PoolOrder()
    b, c, d, e = 0, 1, 2, 3
    assert o.add_graph(0, carve(b, c, d), [ref(b), ref(c), ref(d)]) == set()
    assert o.add_graph(1, carve(e), [ref(c), ref(e)]) == set()
    assert o.add_graph(2, carve(c), [ref(d), ref(c, node=1)]) == {1}  # f re-carves c
    return o


def run(o, sequence):
    """Replay `sequence`; the graphs whose replay would hit a hazard, in order."""
    hit = []
    for g in sequence:
        if o.hazards(g):
            hit.append(g)
        o.replayed(g)
    return hit


def test_capture_order_and_restarts_are_clean():
    o = three_successive()
    assert run(o, [0, 1, 2] * 3) == []


def test_pytorchs_out_of_order_sequence_is_caught_at_the_reader():
    o = three_successive()
    assert run(o, [0, 1, 2, 0, 2, 1]) == [1]
    o.replayed(0)
    o.replayed(2)
    (c,) = o.hazards(1)
    assert (c.reader, c.producer, c.carver) == (1, 0, 2)
    assert (c.start, c.end) == (BASE + SLOT, BASE + 2 * SLOT) and c.ref.address == ref(1).address


def test_the_writer_running_again_clears_the_hazard():
    o = three_successive()
    assert run(o, [0, 2]) == [] and o.hazards(1)
    assert run(o, [0, 1]) == []


def test_a_carver_that_never_ran_is_no_hazard():
    o = three_successive()
    assert run(o, [1, 0, 1, 1]) == []


def test_temporaries_reused_by_every_graph_make_no_conflict():
    o = PoolOrder()
    for g in range(5):  # each graph carves and reads the same scratch slots
        assert o.add_graph(g, carve(0, 1), [ref(0), ref(1)]) == set()
    assert o.reads == {} and o.writes == {}  # nothing to stamp, nothing to check
    assert run(o, [4, 2, 0, 3, 1]) == []


def test_an_earlier_carver_replayed_after_the_writer_is_a_hazard_too():
    o = PoolOrder()
    o.add_graph(0, carve(0), [ref(0)])  # a temporary of g0
    o.add_graph(1, carve(0), [ref(0)])  # g1's output over it
    assert o.add_graph(2, [], [ref(0)]) == {2}  # g2 reads g1's output
    assert run(o, [0, 1, 2]) == []
    assert run(o, [1, 0, 2]) == [2]


def test_a_partial_overwrite_is_a_hazard():
    o = PoolOrder()
    o.add_graph(0, [(BASE, 2 * SLOT, None)], [])  # g0 writes two slots as one block
    o.add_graph(1, [], [ref(0)])  # g1 reads it
    assert o.add_graph(2, carve(1), []) == {1}  # g2 re-carves the second half only
    assert run(o, [0, 2, 1]) == [1]


def test_a_replay_pays_for_its_own_ranges_not_for_the_graphs_of_the_pool():
    o = PoolOrder()
    o.add_graph(0, carve(0), [])
    o.add_graph(1, [], [ref(0)])
    for g in range(2, 200):  # graphs with their own scratch, far from slot 0
        o.add_graph(g, carve(10 + g), [ref(10 + g)])
    assert 0 not in o.writes and len(o.reads[1]) == 1  # only g0 writes slot 0: no stamps
    assert all(g not in o.writes for g in range(2, 200))
    o.add_graph(200, carve(0), [])  # a second writer: now both stamp it
    assert len(o.writes[0]) == 1 and len(o.writes[200]) == 1


def test_a_forgotten_reader_is_never_checked():
    o = three_successive()
    o.forget(1)
    assert run(o, [0, 2, 1]) == []


# ----------------------------------------------------------------------------- simulation
SLOTS = 4


@st.composite
def programs(draw):
    graphs = draw(st.integers(2, 5))
    caps = [
        (
            draw(st.lists(st.integers(0, SLOTS - 1), max_size=3, unique=True)),
            draw(st.lists(st.integers(0, SLOTS - 1), max_size=3, unique=True)),
        )
        for _ in range(graphs)
    ]
    # a graph number replays it; a negative one -(g + 1) forgets g (the graph object died)
    replays = draw(st.lists(st.integers(-graphs, graphs - 1), max_size=16))
    return caps, replays


@settings(max_examples=300, deadline=None)
@given(programs())
def test_the_order_says_hazard_exactly_when_the_simulated_memory_was_overwritten(program):
    """Each slot remembers which graph wrote it last; a replay reads another graph's data when a
    slot it reads (produced by graph p) was last written by a graph other than p."""
    caps, replays = program
    o = PoolOrder()
    latest: dict[int, int] = {}
    reads: dict[int, dict[int, int]] = {}  # graph -> slot -> producer
    for g, (carved, used) in enumerate(caps):
        o.add_graph(g, carve(*carved), [ref(s) for s in used])
        for s in carved:
            latest[s] = g
        reads[g] = {s: latest[s] for s in used if s in latest and latest[s] != g}
    memory: dict[int, int] = {}  # slot -> the graph whose replay wrote it last
    gone: set[int] = set()
    for g in replays:
        if g < 0:  # a forgotten graph never replays again and is never checked
            if -g - 1 not in gone:
                gone.add(-g - 1)
                o.forget(-g - 1)
            continue
        if g in gone:
            continue
        expected = any(memory.get(s, p) != p for s, p in reads[g].items())
        assert bool(o.hazards(g)) == expected
        o.replayed(g)
        for s in caps[g][0]:
            memory[s] = g


def test_a_pass_in_capture_order_skips_the_range_checks_and_a_deviation_does_not():
    o = three_successive()
    assert not o.in_order(1)  # nothing replayed yet: the ranges decide
    o.replayed(0)
    assert o.in_order(1) and o.in_order(2)  # g1 and g2 each read only g0's output
    o.replayed(2)  # g2 before g1: g1 would read what g2 wrote over c
    assert not o.in_order(1) and o.hazards(1)
    o.replayed(0)  # a restart
    o.replayed(1)
    assert o.in_order(2) and not o.hazards(2)


def test_a_forgotten_first_carver_leaves_a_pass_that_starts_at_the_next():
    o = PoolOrder()
    o.add_graph(0, carve(0), [])
    o.add_graph(1, carve(1), [ref(0)])
    o.add_graph(2, carve(0), [ref(1)])  # re-carves g0's slot, which g1 reads
    o.forget(0)
    assert run(o, [1, 2, 1, 2]) == [1]  # g1 reads slot 0, which g2 overwrote
    assert not o.in_order(1)  # g1 reads from g0, which is gone: never clean by order alone


def test_a_forgotten_producer_leaves_its_readers_to_the_range_checks():
    """g2 reads g0's output, which g3 re-carves; g0 dies. A pass that restarts at g1 and reaches
    g3's place must not clear g2 by order: g3 overwrote the range and g0 never rewrites it."""
    o = PoolOrder()
    o.add_graph(0, carve(0), [])
    o.add_graph(1, carve(1), [])
    o.add_graph(2, [], [ref(0)])
    o.add_graph(3, carve(0), [])
    for g in (0, 1, 2, 3):
        o.replayed(g)
    o.forget(0)
    o.replayed(1)
    assert not o.in_order(2) and o.hazards(2)

"""Outputs the pool got back while the caller still used them (graphsan.core.pool_order's release
windows, `Overwrite.pending`): Transformer Engine's buffer reuse across microbatches, the window
graphs, partial carves, the finding's wording, and property tests against a simulation of the
pool's memory. The slot model is test_live_output's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.core.judgement import ReplayJudge
from graphsan.core.pool_order import PoolOrder, first_refs_into
from graphsan.core.pool_orders import ReplayOrders
from graphsan.core.records import GraphInfo, Judged, When
from graphsan.core.tracker import Tracker
from tests.fake_memory import FakeMemory
from tests.test_live_output import BASE, POOL, SLOT, at, carve, pool_map, ref

# -- outputs the pool got back while the caller still used them -------------------------------
# Transformer Engine's `_reuse_graph_input_output_buffers`, one stage, two microbatches captured
# in sequence: forward mb0 keeps an activation (slot 0, read by backward mb0) and hands the
# caller an output (slot 2, routing indices an eager backward needs); backward mb0 frees the
# activation while it is captured and carves its gradient (5); the forward's output goes back
# to the pool after that capture; forward mb1 carves both again; backward mb1 carves 6.
R0, RB0, R1, RB1 = 0, 1, 2, 3


def reuse_order() -> PoolOrder:
    o = PoolOrder()

    def add(gid, carved, refs):
        o.add_graph(gid, carve(*carved), refs, first_refs_into(carve(*carved), refs))

    add(R0, (0, 2), [ref(0), ref(2, 1)])
    o.release(at(0), SLOT, in_capture=True)  # backward mb0's capture frees the activation
    add(RB0, (5,), [ref(0), ref(5, 1)])
    o.release(at(0), SLOT, in_capture=False)  # were it outside: backward mb0 reads it
    o.release(at(2), SLOT, in_capture=False)  # the output, after backward mb0's capture
    add(R1, (0, 2), [ref(0), ref(2, 1)])
    add(RB1, (6,), [ref(0), ref(6, 1)])
    return o


def run_all(o: PoolOrder, sequence) -> list[tuple[int, int, int | None]]:
    """As `run`, and every replay with a finding is one the hooks ask about (`in_order` is
    their shortcut past the judgement)."""
    hits = []
    for g in sequence:
        found = [(w.writer, w.producer, w.pending) for w in o.overwritten(g)]
        assert not (found and o.in_order(g)), (g, found)
        hits += found
        o.replayed(g)
    return hits


def test_a_released_output_is_safe_in_capture_order():
    assert run_all(reuse_order(), [R0, RB0, R1, RB1] * 3) == []


def test_forward_mb1_before_backward_mb0_writes_over_the_released_output():
    o = reuse_order()
    assert run_all(o, [R0]) == []
    (w,) = o.overwritten(R1)
    assert (w.writer, w.producer, w.pending) == (R1, R0, RB0)
    assert (w.start, w.end, w.site) == (at(2), at(3), "site2")  # not the activation (slot 0)
    assert o.hazards(RB0) == []  # not yet: forward mb1 has not replayed
    o.replayed(R1)
    assert [c.carver for c in o.hazards(RB0)] == [R1]  # the activation is replay-order's


def test_the_1f1b_schedule_is_caught_every_step_and_the_sequential_one_never():
    one_f_one_b_steps = [R0, R1, RB0, RB1] * 3
    assert [h[:2] for h in run_all(reuse_order(), one_f_one_b_steps)] == [(R1, R0)] * 3
    assert run_all(reuse_order(), [R0, RB0, R1, RB1, R0, RB0]) == []


def test_out_of_capture_order_the_window_having_replayed_since_is_quiet():
    """Backward mb1 out of turn (the pass leaves capture order), but backward mb0 ran after
    forward mb0: the caller was done with the output when forward mb1 carves it again."""
    assert run_all(reuse_order(), [R0, RB0, RB1, R1]) == []
    assert run_all(reuse_order(), [R0, RB1, R1]) == [(R1, R0, RB0)]


def test_only_the_capture_the_release_followed_is_waited_for():
    """Captured 1F1B with reuse (forward mb1's output goes back after backward mb1, with
    backward mb0 between them) and replayed sequentially: backward mb0 ran before forward mb1,
    yet the caller waited for backward mb1 only, which ran; so forward mb2 may carve it."""

    def built():
        o = PoolOrder()
        for gid, slots, reads, released in [
            (0, (0, 6), (), ()),  # forward mb0: output 0, activation 6
            (1, (1, 7), (), ()),  # forward mb1: output 1, activation 7
            (2, (4,), (6,), (0,)),  # backward mb0; output 0 goes back after it
            (3, (5,), (7,), (1,)),  # backward mb1; output 1 goes back after it
            (4, (1,), (), ()),  # forward mb2 carves output 1's memory
        ]:
            refs = [ref(s, i) for i, s in enumerate(slots + reads)]
            o.add_graph(gid, carve(*slots), refs, first_refs_into(carve(*slots), refs))
            for s in released:
                o.release(at(s), SLOT, in_capture=False)
        return o

    assert [r.window for r in built().reuses[4]] == [(2, 3)]
    assert run_all(built(), [0, 2, 1, 3, 4]) == []
    assert run_all(built(), [0, 1, 2, 4]) == [(4, 1, 3)]


def test_a_release_before_any_other_capture_is_the_callers_own_business():
    o = PoolOrder()
    o.add_graph(0, carve(2), [ref(2)], first_refs_into(carve(2), [ref(2)]))
    o.release(at(2), SLOT, in_capture=False)  # dropped right after its capture
    o.add_graph(1, carve(4), [ref(4), ref(7)], first_refs_into(carve(4), [ref(4)]))
    o.add_graph(2, carve(2), [ref(2), ref(4, 1)], first_refs_into(carve(2), [ref(2)]))
    assert o.reuses == {}
    assert run_all(o, [0, 2, 1]) == []


def test_memory_freed_during_a_capture_is_that_captures_work():
    """Graph 2's capture frees graph 0's tensor (its own consumption, or a module swapping a
    cached tensor nobody reads) and carves it again: no caller held it for graph 1's sake."""
    o = PoolOrder()
    o.add_graph(0, carve(2), [ref(2)], first_refs_into(carve(2), [ref(2)]))
    o.add_graph(1, carve(4), [ref(4), ref(7)], first_refs_into(carve(4), [ref(4)]))
    o.release(at(2), SLOT, in_capture=True)
    o.add_graph(2, carve(2), [ref(2), ref(4, 1)], first_refs_into(carve(2), [ref(2)]))
    assert o.reuses == {}
    assert run_all(o, [0, 2]) == []


def test_a_forgotten_window_graph_no_longer_holds_the_output():
    o = reuse_order()
    o.forget(RB0)
    assert run_all(o, [R0, R1]) == []
    o = reuse_order()
    o.forget(R0)
    assert run_all(o, [R0, R1]) == []


def test_a_partly_carved_release_keeps_its_other_part():
    o = PoolOrder()
    big = [(at(0), 2 * SLOT, "big")]
    o.add_graph(0, big, [ref(0), ref(1)], first_refs_into(big, [ref(0)]))
    o.add_graph(1, carve(5), [ref(5), ref(0, 1)], first_refs_into(carve(5), [ref(5)]))
    o.release(at(0), 2 * SLOT, in_capture=False)
    o.add_graph(2, carve(0), [ref(0)], first_refs_into(carve(0), [ref(0)]))
    o.add_graph(3, carve(1), [ref(1)], first_refs_into(carve(1), [ref(1)]))
    assert sorted(r.writer for rs in o.reuses.values() for r in rs) == []  # graph 1 reads it
    o = PoolOrder()
    o.add_graph(0, big, [ref(0), ref(1)], first_refs_into(big, [ref(0)]))
    o.add_graph(1, carve(5), [ref(5), ref(7, 1)], first_refs_into(carve(5), [ref(5)]))
    o.release(at(0), 2 * SLOT, in_capture=False)
    o.add_graph(2, carve(0), [ref(0), ref(5, 1)], first_refs_into(carve(0), [ref(0)]))
    o.add_graph(3, carve(1), [ref(1)], first_refs_into(carve(1), [ref(1)]))
    assert {g: [(r.start, r.end) for r in rs] for g, rs in o.reuses.items()} == {
        2: [(at(0), at(1))],
        3: [(at(1), at(2))],
    }


def test_the_finding_for_a_released_output_names_the_capture_that_held_it():
    tracker = Tracker()
    orders = ReplayOrders(tracker.graphs, site_frames=lambda site: [("train.py", 9, site)])
    labels = ["fwd mb0", "bwd mb0", "fwd mb1", "bwd mb1"]
    captures = [((0, 2), [ref(0), ref(2, 1)]), ((5,), [ref(0), ref(5, 1)])]
    captures += [((0, 2), [ref(0), ref(2, 1)]), ((6,), [ref(0), ref(6, 1)])]
    for gid, (slots, refs) in enumerate(captures):
        info = GraphInfo(gid, labels[gid], [], POOL, 0)
        view = pool_map(set(slots) | {0, 2})
        tracker.add_graph(info, refs, view)
        ReplayJudge(tracker, orders, FakeMemory()).join_order(info, carve(*slots), refs, view)
        if gid == RB0:
            wb = tracker.graphs[R0].blocks[at(2)]
            orders.released(wb, in_capture=False)
    state = tracker.graphs[R1]
    order = orders.orders[(0, POOL)]
    order.replayed(R0)
    assert state.reads
    overs = orders.overwritten(state)
    # the allocator's view says nothing: the caller's tensor owns no block there
    (f,) = orders.live_outputs(state.info, overs, pool_map(set()), When("train", 4, Judged()))
    assert (f.kind, f.block_address, f.nbytes) == ("live-output", at(2), SLOT)
    assert f.order.written_by == R0
    assert "graph #1 'bwd mb0'" in f.now and "graph #0 'fwd mb0'" in f.now
    assert f.alloc_stack == (("train.py", 9, "site2"),)


@st.composite
def released_programs(draw):
    """Captures into one pool, each carving a few of 6 slots and reading earlier slots; after
    each capture some slots whose latest carve is an earlier graph's go back to the pool; then
    a replay sequence."""
    n = draw(st.integers(2, 5))
    captures = []
    for _ in range(n):
        carved = sorted(set(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))))
        reads = sorted(set(draw(st.lists(st.integers(0, 5), max_size=2))))
        released = sorted(set(draw(st.lists(st.integers(0, 5), max_size=2))))
        captures.append((carved, reads, released))
    sequence = draw(st.lists(st.integers(0, n - 1), max_size=14))
    return captures, sequence


def build_released(captures):
    """The order, and per slot its release window at each capture: slot -> (producer, place of
    the capture after which the pool got it back)."""
    o = PoolOrder()
    latest: dict[int, int] = {}
    released: dict[tuple[int, int], int] = {}  # (writer, slot) -> the capture before release
    pending: dict[int, int] = {}
    for g, (carved, reads, rel) in enumerate(captures):
        refs = [ref(s, i) for i, s in enumerate(carved + reads)]
        o.add_graph(g, carve(*carved), refs, first_refs_into(carve(*carved), refs))
        for s in carved:
            if s in pending:
                released[(g, s)] = pending.pop(s)
        latest.update(dict.fromkeys(carved, g))
        for s in rel:
            if latest.get(s, g) != g and s not in pending:
                o.release(at(s), SLOT, in_capture=False)
                pending[s] = g
    return o, latest, released


@settings(max_examples=300, deadline=None)
@given(released_programs(), st.integers(1, 3))
def test_capture_order_cycles_with_released_outputs_are_quiet(program, cycles):
    captures, _ = program
    o, _, _ = build_released(captures)
    assert run_all(o, list(range(len(captures))) * cycles) == []


@settings(max_examples=400, deadline=None)
@given(released_programs())
def test_every_released_output_found_is_fresh_and_its_window_unfinished(program):
    """Simulated memory: each slot holds the graph that wrote it last. A finding on a released
    output means the slot holds the producer's data from after the writer last ran, and the
    capture the release came right after has not run since the producer did."""
    captures, sequence = program
    o, _, _ = build_released(captures)
    owner: dict[int, int] = {}
    ran: dict[int, int] = {}
    for t, g in enumerate(sequence):
        for w in o.overwritten(g):
            if w.pending is None:
                continue
            slot = (w.start - BASE) // SLOT
            assert owner.get(slot) == w.producer and ran[w.producer] > ran.get(g, -1)
            assert w.producer < w.pending < g and ran.get(w.pending, -1) < ran[w.producer]
            assert slot in captures[g][0]
        for s in captures[g][0]:
            owner[s] = g
        ran[g] = t
        o.replayed(g)

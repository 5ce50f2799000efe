"""Replays that may run at the same time (graphsan.core.streams, graphsan.core.races), pure: the
orderings a program gives its streams (the same stream, an event recorded and waited for,
`wait_stream`, the host waiting), which graphs' memory conflicts (one writes what the other
touches), and a property test of the vector clocks against the happens-before relation of
random programs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from graphsan.core.races import Footprint, Races, conflict
from graphsan.core.streams import MAX_IN_FLIGHT, StreamOrder

S1, S2, S3 = (0, 0x10), (0, 0x20), (0, 0x30)  # (device, handle)
BASE = 0x7E00_0000_0000


def fp(carved=(), referenced=()) -> Footprint:
    """A footprint from slot numbers (4 KiB each): the slots carved, and those referenced."""
    return Footprint.of(
        [(BASE + s * 4096, 4096, f"site{s}") for s in carved],
        [(BASE + s * 4096, BASE + (s + 1) * 4096) for s in referenced],
    )


def busy(*streams):
    return lambda stream: stream in streams


def races_of(**footprints) -> Races:
    races = Races()
    for name, f in footprints.items():
        races.add(int(name[1:]), f)
    return races


# A writes slot 0 (its scratch); B carved its output from A's freed scratch
A_AND_B = {"g1": fp(carved=[0, 1]), "g2": fp(carved=[0], referenced=[5])}


def test_one_stream_never_races():
    races = races_of(**A_AND_B)
    races.launched(1, S1)
    assert races.racing(2, S1, busy(S1)) is None


def test_two_streams_with_nothing_between_race_while_the_first_runs():
    races = races_of(**A_AND_B)
    races.launched(1, S1)
    race = races.racing(2, S2, busy(S1))
    assert race is not None
    assert (race.graph, race.stream, race.other, race.other_stream) == (2, S2, 1, S1)
    assert (race.start, race.end) == (BASE, BASE + 4096)
    assert race.writer == 2 and race.site == "site0"  # both carved slot 0: the one replaying
    assert races.racing(2, S2, busy()) is None  # the first stream is idle: its replay is done


def test_wait_stream_orders_the_second_after_the_first():
    races = races_of(**A_AND_B)
    races.launched(1, S1)
    races.ordering.recorded("e", S1)  # s2.wait_stream(s1) records an event on s1 ...
    races.ordering.waited(S2, "e")  # ... and makes s2 wait for it
    assert races.racing(2, S2, busy(S1)) is None


def test_an_event_recorded_before_the_replay_does_not_order_it():
    races = races_of(**A_AND_B)
    races.ordering.recorded("e", S1)
    races.launched(1, S1)
    races.ordering.waited(S2, "e")
    assert races.racing(2, S2, busy(S1)) is not None


def test_an_event_never_recorded_orders_nothing():
    races = races_of(**A_AND_B)
    races.launched(1, S1)
    races.ordering.waited(S2, "never")
    assert races.racing(2, S2, busy(S1)) is not None


def test_ordering_is_transitive_through_a_third_stream():
    races = races_of(**A_AND_B)
    races.launched(1, S1)
    races.ordering.recorded("a", S1)
    races.ordering.waited(S3, "a")
    races.ordering.recorded("b", S3)
    races.ordering.waited(S2, "b")
    assert races.racing(2, S2, busy(S1, S3)) is None


def test_the_host_waiting_orders_every_later_launch():
    for wait in ("all", "stream", "event"):
        races = races_of(**A_AND_B)
        races.launched(1, S1)
        if wait == "all":
            races.ordering.host_waited_for_all()
        elif wait == "stream":
            races.ordering.host_waited_for_stream(S1)
        else:
            races.ordering.recorded("e", S1)
            races.ordering.host_waited_for_event("e")
        assert races.racing(2, S2, busy(S1)) is None, wait
        races.launched(1, S1)  # a later replay on the first stream is in flight again
        assert races.racing(2, S2, busy(S1)) is not None, wait


def test_disjoint_memory_and_reads_of_the_same_memory_never_conflict():
    assert conflict(fp(carved=[0]), fp(carved=[1], referenced=[2])) is None
    assert conflict(fp(referenced=[3]), fp(referenced=[3])) is None  # both only read
    assert conflict(fp(carved=[3]), fp(referenced=[3])) == (
        (BASE + 3 * 4096, BASE + 4 * 4096),
        True,
    )
    assert conflict(fp(referenced=[3]), fp(carved=[3]))[1] is False
    races = races_of(g1=fp(carved=[0]), g2=fp(carved=[7]))  # separate pools: ranges apart
    races.launched(1, S1)
    assert races.racing(2, S2, busy(S1)) is None


def test_a_graph_replayed_on_two_streams_at_once_races_with_itself():
    races = races_of(g1=fp(carved=[0]))
    races.launched(1, S1)
    race = races.racing(1, S2, busy(S1))
    assert race is not None and (race.graph, race.other) == (1, 1)


def test_a_forgotten_graph_races_with_nothing():
    races = races_of(**A_AND_B)
    races.launched(1, S1)
    races.forget(1)
    assert races.racing(2, S2, busy(S1)) is None


def test_what_a_stream_keeps_in_flight_is_bounded():
    order = StreamOrder()
    for _ in range(MAX_IN_FLIGHT + 50):
        order.launched(S1, 1)
    assert len(order.in_flight[S1]) == MAX_IN_FLIGHT
    order.host_waited_for_stream(S1)
    assert not order.in_flight[S1] and list(order.unordered(S2)) == []


# -- property: the clocks against happens-before -----------------------------------------------
STREAMS = (S1, S2, S3)


@st.composite
def programs(draw):
    """Replays, events recorded and waited for, and host waits, on three streams."""
    ops = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["replay", "replay", "record", "wait", "sync", "sync_all"]))
        stream = draw(st.sampled_from(STREAMS))
        event = draw(st.integers(0, 2))
        ops.append((kind, stream, event))
    return ops


@settings(max_examples=300, deadline=None)
@given(programs())
def test_a_replay_is_unordered_exactly_when_no_chain_of_orderings_leads_to_the_next_launch(ops):
    """Ground truth: a graph of happens-before edges (stream order, record -> wait, a host wait
    -> every later launch); a replay is ordered before a launch on `s` when a path leads from
    it to `s`'s next operation."""
    order = StreamOrder()
    nodes = []  # (stream, launch number or None)
    edges: dict[int, set[int]] = {}
    last_on: dict = {}
    recorded_at: dict[int, int] = {}
    host_waits: list[int] = []  # nodes the host waited for: every later node comes after

    def node(stream, n=None) -> int:
        i = len(nodes)
        nodes.append((stream, n))
        edges[i] = set()
        if stream in last_on:
            edges[last_on[stream]].add(i)
        last_on[stream] = i
        for w in host_waits:
            edges[w].add(i)
        return i

    replays = []
    for kind, stream, event in ops:
        if kind == "replay":
            n = order.launched(stream, 1)
            replays.append((node(stream, n), stream, n))
        elif kind == "record":
            order.recorded(event, stream)
            recorded_at[event] = node(stream)
        elif kind == "wait":
            order.waited(stream, event)
            i = node(stream)
            if event in recorded_at:
                edges[recorded_at[event]].add(i)
        elif kind == "sync":
            order.host_waited_for_stream(stream)
            if stream in last_on:
                host_waits.append(last_on[stream])
        else:
            order.host_waited_for_all()
            host_waits += list(last_on.values())

    def reaches(a: int, b: int) -> bool:
        seen, todo = set(), [a]
        while todo:
            x = todo.pop()
            if x == b:
                return True
            if x in seen:
                continue
            seen.add(x)
            todo += edges[x]
        return False

    for target in STREAMS:
        probe = node(target)  # the next launch on `target`
        unordered = {(s, n) for s, n, _ in order.unordered(target)}
        for i, s, n in replays:
            if s == target:
                continue
            expected = not reaches(i, probe)
            assert ((s, n) in unordered) == expected, (ops, target, s, n)
        del nodes[probe]  # the probe is no operation of the program
        for e in edges.values():
            e.discard(probe)
        del edges[probe]
        last_on[target] = next(
            (i for i in range(len(nodes) - 1, -1, -1) if nodes[i][0] == target), None
        )
        if last_on[target] is None:
            del last_on[target]

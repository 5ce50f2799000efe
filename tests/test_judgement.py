"""The replay judge (graphsan.core.judgement) through its seam, the memory watch it asks
(`MemorySource`), faked without torch (tests/fake_memory.py): when a replay is judged, what the
verdict finds with what the watch can and cannot say, a pointer table rewritten since the
capture, and what a decision leaves in the graph's state."""

from __future__ import annotations

import sys

import pytest

from graphsan.core.judgement import ReplayJudge
from graphsan.core.memory_map import MemoryMap
from graphsan.core.pool_orders import ReplayOrders
from graphsan.core.records import DEFAULT_POOL, FreeEvent, GraphInfo, Reference
from graphsan.core.tracker import Tracker
from tests.fake_memory import FakeMemory

SEG = 0x7F00_0000_0000
A, B, TABLE = SEG, SEG + 4096, SEG + 8192  # two 4 KiB blocks and a pointer table


def memory_map(states: dict[int, str], expandable: bool = False) -> MemoryMap:
    """One default-pool segment of three 4 KiB blocks (A, B, the table) in `states`
    (`expandable`: its pages are mapped and unmapped one by one)."""
    blocks = [
        {"address": a, "size": 4096, "state": states.get(a, "active_allocated")}
        for a in (A, B, TABLE)
    ]
    seg = {"address": SEG, "total_size": 3 * 4096, "segment_pool_id": DEFAULT_POOL}
    seg["is_expandable"] = expandable
    return MemoryMap.from_snapshot({"segments": [dict(seg, blocks=blocks)]})


def judge_of(memory: FakeMemory, refs: list[Reference]):
    """A judge over one graph that reads `refs`, captured with every block alive."""
    tracker = Tracker()
    orders = ReplayOrders(tracker.graphs, site_frames=lambda site: [])
    judge = ReplayJudge(tracker, orders, memory, lambda: ("train", 3))
    info = GraphInfo(1, "g", [("train.py", 5, "capture")], (1, 0), 0)
    state = tracker.add_graph(info, refs, memory_map({}))
    judge.watch(state)
    return judge, tracker, state


def free(tracker: Tracker, address: int) -> None:
    tracker.on_free(address, lambda: FreeEvent([("train.py", 99, "evaluate")], "eval", 2))


def test_a_watch_that_sees_frees_is_asked_only_after_one():
    memory = FakeMemory()
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, A)])
    assert not judge.needs(state)  # nothing freed: the replay goes by
    free(tracker, A)
    assert judge.needs(state)
    memory.now = memory_map({A: "inactive"})
    verdict = judge.verdict(state)
    (f,) = verdict.findings
    assert verdict.judged and (f.kind, f.block_address, f.phase) == ("freed", A, "eval")
    assert memory.asked == ["prepare", "view"]


def test_a_watch_that_finds_frees_by_asking_is_asked_before_every_replay():
    memory = FakeMemory(judges_every_replay=True)
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, A)])
    for _ in range(2):  # nothing freed: judged, quiet, and judged again next time
        assert judge.needs(state)
        assert judge.verdict(state).findings == []
        judge.decided(state, stopped=False)
    assert memory.asked.count("prepare") == 2
    memory.on_prepare = lambda s: free(tracker, A)  # the driver no longer knows A
    memory.now = memory_map({A: "inactive"})
    assert [f.kind for f in judge.verdict(state).findings] == ["freed"]


@pytest.mark.parametrize("knows", [True, False])
def test_an_unmapped_page_needs_a_watch_that_knows_the_mapping(knows):
    memory = FakeMemory(knows_mapping=knows)
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, A)])
    free(tracker, A)
    memory.now = memory_map({A: "inactive"}, expandable=True)  # empty_cache unmapped A's page
    memory.unmapped.add(A)
    (f,) = judge.verdict(state).findings
    # without the driver's answer an unmapped page of a cached segment reads as freed
    assert f.kind == ("unmapped" if knows else "freed")


@pytest.mark.parametrize("knows", [True, False])
def test_a_watch_that_cannot_name_holders_still_judges_the_graphs_memory(knows):
    memory = FakeMemory(knows_holders=knows)
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, A)])
    free(tracker, A)
    memory.now = memory_map({A: "inactive"})
    assert [f.kind for f in judge.verdict(state).findings] == ["freed"]


def test_a_pointer_table_rewritten_since_the_capture_drops_the_stale_reference():
    via_table = Reference(0, "k", 1, 0, B, through=TABLE, slot=8)
    memory = FakeMemory()
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, TABLE), via_table])
    free(tracker, B)
    memory.now = memory_map({B: "inactive"})
    memory.device[TABLE] = (0).to_bytes(8, "little") + A.to_bytes(8, "little")  # B's slot: A now
    assert judge.verdict(state).findings == []
    assert "read_device" in memory.asked and B not in state.blocks


def test_a_pointer_table_that_still_names_the_freed_block_is_a_finding():
    via_table = Reference(0, "k", 1, 0, B, through=TABLE, slot=8)
    memory = FakeMemory()
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, TABLE), via_table])
    free(tracker, B)
    memory.now = memory_map({B: "inactive"})
    memory.device[TABLE] = (0).to_bytes(8, "little") + B.to_bytes(8, "little")
    (f,) = judge.verdict(state).findings
    assert (f.kind, f.block_address, f.through) == ("freed", B, TABLE)


def test_a_stopped_graph_stays_judged_and_one_stopped_before_its_launch_keeps_its_memory():
    memory = FakeMemory()
    judge, tracker, state = judge_of(memory, [Reference(0, "k", 1, 0, A)])
    state.own = [(B, 4096)]  # memory the allocator makes when the graph first launches
    free(tracker, A)
    judge.verdict(state)
    assert judge.decided(state, stopped=True) == 1 and memory.kept == [(B, 4096)]
    assert judge.needs(state)  # blocked: every later replay is judged again


def test_the_judge_loads_without_torch():
    assert "torch" not in sys.modules or "graphsan.core.judgement" in sys.modules
    import subprocess

    code = (
        "import sys; import graphsan.core.judgement, tests.fake_memory; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0

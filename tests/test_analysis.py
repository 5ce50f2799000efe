"""The pure core on synthetic records: every finding kind, the no-false-alarm cases, and the
allocation stacks a finding shows. Scanning packed argument buffers is test_scan_references.py's."""

from __future__ import annotations

import json

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import (
    DEFAULT_POOL,
    FreeEvent,
    GraphInfo,
    OtherUse,
    Reference,
)
from graphsan.core.tracker import Tracker
from graphsan.report import finding_from_dict, finding_to_dict, format_finding, one_line

SEG = 0x7F00_0000_0000
POOL = (1, 0)


def snapshot(*segments):
    """segments: (address, pool, [(offset, size, state), ...], expandable)"""
    out = []
    for addr, pool, blocks, *rest in segments:
        total = sum(b[1] for b in blocks)
        out.append(
            {
                "address": addr,
                "total_size": total,
                "segment_pool_id": pool,
                "is_expandable": bool(rest and rest[0]),
                "blocks": [
                    {
                        "address": addr + off,
                        "size": size,
                        "state": state,
                        "frames": [{"filename": "train.py", "line": 10 + off % 7, "name": "f"}],
                    }
                    for off, size, state in blocks
                ],
            }
        )
    return {"segments": out}


def event(op=None, capture_pool=None):
    return lambda: FreeEvent([("train.py", 99, "evaluate")], "eval", 100, op, capture_pool)


def graph(gid=1, pool=POOL):
    return GraphInfo(gid, f"g{gid}", [("train.py", 5, "capture")], pool, 0)


def ref(addr, node=0, kernel="k"):
    return Reference(node, kernel, 1, 8, addr)


# default segment: [A: 4 KiB active][B: 4 KiB active][C: 8 KiB free]; pool segment: [P: 4 KiB active][Q: 4 KiB free]
A, B, C = SEG, SEG + 4096, SEG + 8192
PSEG = SEG + (1 << 30)
P, Q = PSEG, PSEG + 4096


def capture_map():
    return MemoryMap.from_snapshot(
        snapshot(
            (
                SEG,
                DEFAULT_POOL,
                [
                    (0, 4096, "active_allocated"),
                    (4096, 4096, "active_allocated"),
                    (8192, 8192, "inactive"),
                ],
            ),
            (PSEG, POOL, [(0, 4096, "active_allocated"), (4096, 4096, "inactive")]),
        )
    )


def tracker_with(refs, gid=1):
    t = Tracker()
    state = t.add_graph(graph(gid), refs, capture_map())
    return t, state


def test_classifies_references_at_capture():
    t, state = tracker_with([ref(A + 16), ref(B, node=3), ref(P), ref(Q), ref(0x1234_5678_0000)])
    c = state.counts
    assert (c.default, c.own, c.temporary, c.foreign, c.references) == (2, 1, 1, 1, 5)
    assert set(state.blocks) == {A, B, P}
    assert not state.dirty


def test_untouched_memory_gives_no_finding():
    t, state = tracker_with([ref(A), ref(B)])
    assert not t.on_free(C, event())  # unwatched block: ignored
    assert not state.dirty
    assert t.judge(1, capture_map()) == []


def test_freed_in_default_pool():
    t, state = tracker_with([ref(A + 16, node=2, kernel="gemm"), ref(A + 32, node=5)])
    assert t.on_free(A, event())
    assert state.dirty
    now = MemoryMap.from_snapshot(
        snapshot((SEG, DEFAULT_POOL, [(0, 8192, "inactive"), (8192, 8192, "inactive")]))
    )
    (f,) = t.judge(1, now)
    assert (f.kind, f.node, f.kernel, f.param, f.offset) == ("freed", 2, "gemm", 1, 8)
    assert (f.address, f.block_address, f.nbytes) == (A + 16, A, 4096)
    assert (f.phase, f.step, f.other_nodes) == ("eval", 100, 1)
    assert f.free_stack[-1] == ("train.py", 99, "evaluate")
    assert f.alloc_stack and f.pool == "default pool"
    assert not state.dirty


def test_a_finding_names_the_other_graphs_that_use_the_block():
    # as in TE #3316: the forward graph (re-quantizing into the workspace) replays first and is
    # stopped; the report must still name the backward graph's kernel that reads the buffer
    t, _ = tracker_with([ref(A, node=4, kernel="where_kernel")])
    t.add_graph(graph(2), [ref(B, node=1), ref(A + 64, node=7, kernel="gemm_dgrad")], capture_map())
    t.add_graph(graph(3), [ref(B)], capture_map())
    t.on_free(A, event())
    now = MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 16384, "inactive")])))
    (f,) = t.judge(1, now)
    assert f.also_used_by == (OtherUse(2, "g2", 7, "gemm_dgrad", 1, 8),)
    text = format_finding(f)
    assert "also used by:\n      graph #2 'g2' node 7: gemm_dgrad param 1+8" in text
    assert finding_from_dict(json.loads(json.dumps(finding_to_dict(f)))) == f
    t.forget(2)
    t.graphs[1].dirty = True
    assert t.judge(1, now)[0].also_used_by == ()


def test_a_free_after_the_snapshot_waits_for_the_next_judgement():
    # the snapshot was taken, then another thread freed the block: the snapshot still shows it
    # allocated, which must not read as "re-owned by a live allocation" (itself)
    t, state = tracker_with([ref(A)])
    as_of = t.free_seq
    before = capture_map()  # A still allocated here
    t.on_free(A, event())
    assert t.judge(1, before, as_of=as_of) == [] and state.dirty
    after = MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 16384, "inactive")])))
    (f,) = t.judge(1, after, as_of=t.free_seq)
    assert f.kind == "freed" and not state.dirty


def test_reowned_when_a_new_tensor_takes_the_block():
    t, _ = tracker_with([ref(A)])
    t.on_free(A, event())
    now = MemoryMap.from_snapshot(
        snapshot((SEG, DEFAULT_POOL, [(0, 2048, "active_allocated"), (2048, 14336, "inactive")]))
    )
    (f,) = t.judge(1, now)
    assert f.kind == "reowned" and "2048 B" in f.now


def test_unmapped_when_the_segment_is_gone():
    t, _ = tracker_with([ref(B)])
    t.on_free(B, event())
    (f,) = t.judge(1, MemoryMap.from_snapshot(snapshot()))
    assert f.kind == "unmapped"


def test_unmapped_when_only_part_of_the_block_is_still_mapped():
    # a 3 MiB block straddling two 2 MiB pages of an expandable segment; after the free and
    # empty_cache the second page is gone: the snapshot lists only the first as a segment
    big = 3 << 20
    snap = snapshot(
        (SEG, DEFAULT_POOL, [(0, big, "active_allocated"), (big, 1 << 20, "inactive")], True)
    )
    t = Tracker()
    t.add_graph(graph(), [ref(A)], MemoryMap.from_snapshot(snap))
    t.on_free(A, event())
    after = MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 2 << 20, "inactive")], True)))
    assert t.judge(1, after, is_mapped=lambda a: True)[0].kind == "unmapped"
    # the same when the snapshot still lists the range but the driver has no pages behind it
    t.graphs[1].dirty = True
    whole = MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 4 << 20, "inactive")], True)))
    asked = []

    def mapped(addr):
        asked.append(addr)
        return addr < SEG + (2 << 20)

    assert t.judge(1, whole, is_mapped=mapped)[0].kind == "unmapped"
    assert asked == [SEG, SEG + (2 << 20)]  # one question per page


def test_memory_handed_out_again_as_several_segments_is_judged_by_all_of_them():
    # a 20 MiB default-pool block freed and released; cudaMalloc then returns its range as a
    # 2 MiB private-pool segment (free) followed by an 18 MiB default-pool one (allocated)
    big = 20 << 20
    t = Tracker()
    snap = snapshot((SEG, DEFAULT_POOL, [(0, big, "active_allocated")]))
    t.add_graph(graph(), [ref(A)], MemoryMap.from_snapshot(snap))
    t.on_free(A, event())
    two = 2 << 20
    after = MemoryMap.from_snapshot(
        snapshot(
            (SEG, POOL, [(0, two, "inactive")]),
            (SEG + two, DEFAULT_POOL, [(0, big - two, "active_allocated")]),
        )
    )
    assert after.segments_in(A, A + big) == after.segments  # both, in address order
    (f,) = t.judge(1, after)
    assert f.kind == "reowned" and f"{big - two} B" in f.now
    # both parts free: still a finding (a private pool other than the block's own may take it)
    t.graphs[1].dirty = True
    free = MemoryMap.from_snapshot(
        snapshot(
            (SEG, POOL, [(0, two, "inactive")]),
            (SEG + two, DEFAULT_POOL, [(0, big - two, "inactive")]),
        )
    )
    assert t.judge(1, free)[0].kind == "freed"


def test_the_driver_is_asked_about_expandable_segments_only():
    # cudaMalloc'd memory has no allocation handle: the question would wrongly say "unmapped"
    t, _ = tracker_with([ref(A)])
    t.on_free(A, event())
    after = MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 16384, "inactive")])))
    assert t.judge(1, after, is_mapped=lambda a: False)[0].kind == "freed"


def test_unmapped_in_expandable_segment_by_driver_answer():
    t = Tracker()
    snap = snapshot(
        (SEG, DEFAULT_POOL, [(0, 4096, "active_allocated"), (4096, 4096, "inactive")], True)
    )
    t.add_graph(graph(), [ref(A)], MemoryMap.from_snapshot(snap))
    t.on_free(A, event())
    after = MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 8192, "inactive")], True)))
    assert t.judge(1, after, is_mapped=lambda a: True)[0].kind == "freed"
    t.graphs[1].dirty = True
    assert t.judge(1, after, is_mapped=lambda a: False)[0].kind == "unmapped"


def test_moved_by_resize():
    t, _ = tracker_with([ref(A)])
    t.on_free(A, event(op="resize_"))
    now = MemoryMap.from_snapshot(
        snapshot((SEG, DEFAULT_POOL, [(0, 8192, "inactive"), (8192, 8192, "active_allocated")]))
    )
    (f,) = t.judge(1, now)
    assert f.kind == "moved" and f.free_op == "resize_"
    assert "resize_" in f.likely_cause


def test_private_pool_free_is_harmless_until_recarved():
    t, state = tracker_with([ref(P)])
    t.on_free(P, event())
    assert state.dirty
    free_pool = MemoryMap.from_snapshot(snapshot((PSEG, POOL, [(0, 8192, "inactive")])))
    assert t.judge(1, free_pool) == []  # nobody else can have it yet
    assert not state.dirty
    t.on_alloc(P + 64)  # a later capture carves the freed range
    assert state.dirty
    recarved = MemoryMap.from_snapshot(
        snapshot(
            (
                PSEG,
                POOL,
                [(0, 1024, "inactive"), (1024, 2048, "active_allocated"), (3072, 5120, "inactive")],
            )
        )
    )
    (f,) = t.judge(1, recarved)
    assert f.kind == "pool-reuse" and "own private pool" in f.pool


def test_pool_reuse_names_the_graph_that_recarved():
    t, _ = tracker_with([ref(P)])
    t.on_free(P, event())
    recarved = MemoryMap.from_snapshot(
        snapshot((PSEG, POOL, [(0, 4096, "active_allocated"), (4096, 4096, "inactive")]))
    )
    t.add_graph(graph(2), [ref(P)], recarved)
    (f,) = t.judge(1, recarved)
    assert f.kind == "pool-reuse" and "g2" in f.now


def test_hand_over_inside_a_capture_of_the_same_pool_is_not_a_finding():
    t, state = tracker_with([ref(P), ref(A)])
    t.on_free(P, event(capture_pool=POOL))  # e.g. backward capture consumed saved activations
    assert not state.dirty and P not in state.blocks
    t.on_alloc(P)
    assert not state.dirty
    assert t.judge(1, capture_map()) == []


def test_default_pool_memory_already_free_at_capture_end():
    t = Tracker()
    snap = snapshot((SEG, DEFAULT_POOL, [(0, 4096, "inactive"), (4096, 4096, "active_allocated")]))
    state = t.add_graph(graph(), [ref(A)], MemoryMap.from_snapshot(snap))
    assert state.dirty
    (f,) = t.judge(1, MemoryMap.from_snapshot(snap))
    assert f.kind == "freed" and f.free_op == "freed before capture ended"
    assert "already free when the capture ended" in one_line(f)
    assert "freed: before the capture ended" in format_finding(f)


def test_a_free_without_user_frames_is_said_to_come_from_torch():
    t, _ = tracker_with([ref(A)])
    t.on_free(A, lambda: FreeEvent([], "train", 3, None, None))  # e.g. autograd's thread
    (f,) = t.judge(
        1, MemoryMap.from_snapshot(snapshot((SEG, DEFAULT_POOL, [(0, 16384, "inactive")])))
    )
    assert "freed at torch internals (no Python frames of yours" in one_line(f)
    assert "      <torch internals (no Python frames" in format_finding(f)


def test_forgotten_graph_stops_watching():
    t, state = tracker_with([ref(A)])
    t.forget(1)
    assert not t.on_free(A, event())
    assert t.live == {}


def test_graph_destroyed_then_memory_freed_and_another_graph_still_judged():
    t = Tracker()
    m = capture_map()
    t.add_graph(graph(1), [ref(A)], m)
    s2 = t.add_graph(graph(2), [ref(A), ref(B)], m)
    t.forget(1)
    t.on_free(A, event())
    assert s2.dirty
    assert [f.graph.id for f in t.judge(2, MemoryMap.from_snapshot(snapshot()))] == [2]


def test_release_marks_graphs_with_freed_memory():
    t, state = tracker_with([ref(P)])
    t.on_free(P, event())
    t.judge(1, MemoryMap.from_snapshot(snapshot((PSEG, POOL, [(0, 8192, "inactive")]))))
    t.on_release()
    assert state.dirty


def test_allocation_stacks_keep_only_user_frames():
    from graphsan.cuda.context import user_frames

    snap = snapshot((SEG, DEFAULT_POOL, [(0, 4096, "active_allocated")]))
    snap["segments"][0]["blocks"][0]["frames"] = [
        {"filename": "/home/me/train.py", "line": 9, "name": "make_input"},
        {"filename": "<frozen runpy>", "line": 88, "name": "_run_code"},
    ]
    m = MemoryMap.from_snapshot(snap, frame_filter=user_frames)
    assert m.locate(A)[1].frames == [("/home/me/train.py", 9, "make_input")]

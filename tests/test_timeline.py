"""The timeline the report pages are drawn from: the bounded event recorder, the per-graph
node summary, and the times the sanitizer records at capture, at a watched free and at the
replay it judges (CUDA faked, as in test_sanitizer_cpu)."""

from __future__ import annotations

import pytest

from graphsan.core.records import KernelArgs
from graphsan.core.timeline import Timeline, node_summary
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError
from tests import fake_cuda as fake_cuda_pieces

T0 = 1_780_000_000.0
MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float> >(int)"
GEMM = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_gemm>(Params)"


# ----------------------------------------------------------------------------- the timeline
def test_timeline_keeps_the_first_events_and_counts_the_rest():
    tl = Timeline(rank=0, limit=3)
    for i in range(5):
        tl.free(0x1000 + i, T0 + i, [("train.py", 10, "evaluate")], "eval", 1, None)
    assert [e["block"] for e in tl.events] == [0x1000, 0x1001, 0x1002] and tl.dropped == 2
    assert tl.events[0] == {
        "t": T0,
        "kind": "free",
        "rank": 0,
        "block": 0x1000,
        "phase": "eval",
        "step": 1,
        "op": None,
        "site": "train.py:10 in evaluate",
    }


def test_timeline_folds_clean_judgements_and_records_only_phase_changes():
    tl = Timeline()
    for _ in range(3):
        tl.replay(7, "g", 0, 1, findings=0, stopped=False)
        tl.replay(8, "h", 0, 1, findings=0, stopped=False)  # another graph: still folds
    assert [e.get("count", 1) for e in tl.events] == [3, 3]
    tl.free(0x10, T0, [], "eval", 1, None)  # something happened: a new entry
    tl.replay(7, "g", 0, 1, findings=0, stopped=False)
    tl.replay(7, "g", 0, 1, findings=1, stopped=True)
    assert [(e["kind"], e.get("outcome"), e.get("count", 1)) for e in tl.events[2:]] == [
        ("free", None, 1),
        ("replay", "clean", 1),
        ("replay", "stopped", 1),
    ]
    tl2 = Timeline()
    for phase, step in [("train", 0), ("train", 1), ("eval", 1), ("eval", 1), ("train", 2)]:
        tl2.phase(phase, step)
    assert [(e["phase"], e["step"]) for e in tl2.events] == [
        ("train", 0),
        ("eval", 1),
        ("train", 2),
    ]


def test_node_summary_is_bounded_and_names_each_kernel_once():
    nodes = [KernelArgs(i, GEMM if i % 2 else MUL, b"", []) for i in range(10)]
    s = node_summary(nodes, limit=4)
    assert s == {"names": [MUL, GEMM], "nodes": [0, 1, 0, 1], "total": 10}


# --------------------------------------------------------------- the sanitizer records times
SEG = fake_cuda_pieces.SEG
_map = fake_cuda_pieces.one_segment


@pytest.fixture
def fake_cuda(monkeypatch):
    return fake_cuda_pieces.install(monkeypatch, MUL, stream=0xAB)


class FakeGraph:
    def pool(self):
        return (1, 3)


def test_the_sanitizer_times_capture_free_and_stopped_replay(fake_cuda):
    san = fake_cuda_pieces.started(fake_cuda, "raise", hooks=False)
    san.memory._active = True  # the allocator callbacks without torch's GPU trace
    g = FakeGraph()
    san.capture_begin(g, None)
    san.after_capture_end(g, san.before_capture_end(g))
    state = hooks.graph_state(g)
    (stats,) = san.report().graphs
    assert stats["captured_at"] > 0 and stats["node_summary"]["names"] == [MUL]
    san.memory._on_free(SEG + 4096)  # a block no graph uses: nothing recorded
    assert [e["kind"] for e in san.timeline.events] == ["capture"]
    san.memory._on_free(SEG)
    fake_cuda["map"] = _map([(8192, "inactive")])
    with pytest.raises(StaleMemoryError):
        san.before_replay(g, state)
    rep = san.report()
    kinds = [e["kind"] for e in rep.events]
    assert kinds == ["capture", "free", "replay"]
    cap, free, replay = rep.events
    assert cap["stream"] == 0xAB and cap["graph"] == 1 and cap["begin"] <= cap["t"]
    assert free["block"] == SEG and replay["outcome"] == "stopped"
    (f,) = rep.findings
    assert f.freed_at == free["t"] and f.found_at == replay["t"]
    assert stats["captured_at"] == cap["t"] <= f.freed_at <= f.found_at

"""Replay order through the sanitizer's hooks on CPU (the CUDA side faked): PyTorch's
three-graph sequence in one shared pool, under each policy, through graphsan's wrappers and
through torch 2.14.1's graph hooks."""

from __future__ import annotations

import pytest

from graphsan.core.records import FreeEvent
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError, format_finding
from graphsan.report.json_report import Report
from tests import fake_cuda

SEG, SLOT, POOL = fake_cuda.SEG, 4096, (1, 3)
B, C, D, E = (SEG + i * SLOT for i in range(4))


@pytest.fixture(params=fake_cuda.ATTACHMENTS)
def env(monkeypatch, request):
    """Each test twice: through graphsan's wrappers (torch 2.11), and through torch 2.14.1's
    graph hooks (tests/torch_hooks.py)."""
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    state["map"] = fake_cuda.one_segment([(SLOT, "active_allocated")] * 4, pool=POOL)
    state["cls"] = fake_cuda.graph_class(monkeypatch, POOL, request.param)
    return state


def capture(env, san, nodes, carves):
    g = env["cls"]()
    env["nodes"], env["carves"] = nodes, [(a, SLOT, None) for a in carves]
    g.capture_begin(POOL)
    g.capture_end()
    return g


def three_successive(env, policy, start):
    """g0 writes b, c, d; g1 reads c and writes e; g2 reads d and re-carves c (freed meanwhile)."""
    san = start(env, policy)
    k = fake_cuda.kernel
    g0 = capture(env, san, [k(0, B, C, D)], [B, C, D])
    g1 = capture(env, san, [k(0, C, E)], [E])
    g2 = capture(env, san, [k(0, D), k(1, C)], [C])
    return san, (g0, g1, g2)


def test_capture_order_and_restarts_replay_untouched(env, fake_sanitizer):
    san, gs = three_successive(env, "raise", fake_sanitizer)
    for _ in range(3):
        for g in gs:
            g.replay()
    assert [g.launched for g in gs] == [3, 3, 3] and san.findings == []


def test_out_of_order_replay_raises_before_launch_and_names_both_graphs(env, fake_sanitizer):
    san, (g0, g1, g2) = three_successive(env, "raise", fake_sanitizer)
    g0.replay(), g1.replay(), g2.replay()
    g0.replay(), g2.replay()
    with pytest.raises(StaleMemoryError) as err:
        g1.replay()
    assert g1.launched == 1, "the stale replay must not run"
    (f,) = err.value.findings
    ids = [hooks.graph_state(g).info.id for g in (g0, g1, g2)]
    assert f.kind == "replay-order" and f.graph.id == ids[1]
    assert (f.order.written_by, f.order.carved_by) == (ids[0], ids[2])
    assert f.block_address == C and f.nbytes == SLOT and f.param == 0 and f.node == 0
    text = format_finding(f)
    assert f"graph #{ids[2]}" in text and f"graph #{ids[0]}" in text and "freed" not in text
    g0.replay()
    g1.replay()  # the writer ran again: the order is legal again
    assert g1.launched == 2


def test_warn_and_record_let_the_replay_go_on_and_the_report_round_trips(
    env, fake_sanitizer, tmp_path, capsys
):
    san, (g0, g1, g2) = three_successive(env, "warn", fake_sanitizer)
    for g in (g0, g2, g1, g0, g2, g1):
        g.replay()
    assert g1.launched == 2
    assert capsys.readouterr().err.count("REPLAY-ORDER") == 1  # printed once
    path = str(tmp_path / "r.json")
    san.report().save(path)
    back = Report.load(path)
    assert back.findings == san.findings and back.findings[0].order.carved_by is not None


def test_a_graph_alone_in_its_pool_pays_no_tick_until_the_pool_is_shared(env, fake_sanitizer):
    san = fake_sanitizer(env, "raise")
    g0 = capture(env, san, [fake_cuda.kernel(0, B, C)], [B, C])
    s0 = hooks.graph_state(g0)
    assert s0.order is None and not s0.reads
    g1 = capture(env, san, [fake_cuda.kernel(0, C)], [D])
    assert s0.order is not None and hooks.graph_state(g1).order is s0.order


def test_replay_order_can_be_turned_off(env, fake_sanitizer):
    san = fake_sanitizer(env, "raise")
    san.replay_order = False
    k = fake_cuda.kernel
    g0 = capture(env, san, [k(0, B, C, D)], [B, C, D])
    g1 = capture(env, san, [k(0, C, E)], [E])
    g2 = capture(env, san, [k(0, D), k(1, C)], [C])
    for g in (g0, g2, g1):
        g.replay()
    assert san.orders == {} and san.findings == []


def test_an_output_dropped_between_captures_is_the_replay_orders_to_judge(env, fake_sanitizer):
    """The user drops g0's output c after g1's capture (not inside it), so g2's capture
    re-carves c: legal in capture order, a replay-order finding out of it, never pool-reuse."""
    san = fake_sanitizer(env, "raise")
    k = fake_cuda.kernel
    g0 = capture(env, san, [k(0, B, C, D)], [B, C, D])
    g1 = capture(env, san, [k(0, C, E)], [E])
    assert san.tracker.on_free(C, lambda: FreeEvent([("train.py", 9, "step")], "train", 1))
    g2 = capture(env, san, [k(0, D), k(1, C)], [C])
    for _ in range(3):
        for g in (g0, g1, g2):
            g.replay()
    assert san.findings == [] and g1.launched == 3
    g0.replay(), g2.replay()
    with pytest.raises(StaleMemoryError) as err:
        g1.replay()
    assert [f.kind for f in err.value.findings] == ["replay-order"]


def test_a_pool_block_no_graph_carved_is_still_judged_when_freed(env, fake_sanitizer):
    """A block of the pool that g1 reads but no capture carved (made eagerly into the pool):
    the replay order knows nothing of it, so its free and re-carving stay the tracker's."""
    san = fake_sanitizer(env, "raise")
    k = fake_cuda.kernel
    g0 = capture(env, san, [k(0, B)], [B])
    g1 = capture(env, san, [k(0, C, E)], [E])
    assert san.tracker.on_free(C, lambda: FreeEvent([("train.py", 9, "step")], "train", 1))
    g2 = capture(env, san, [k(0, C)], [C])
    g0.replay()
    with pytest.raises(StaleMemoryError) as err:
        g1.replay()
    assert [f.kind for f in err.value.findings] == ["pool-reuse"]
    assert g2.launched == 0


def test_an_output_the_pool_got_back_between_captures_is_protected(env, fake_sanitizer):
    """TE's buffer reuse: forward mb0's output (c) goes back to the pool once backward mb0 is
    captured, and forward mb1 carves it; forward mb1 right after forward mb0 is stopped."""
    san = fake_sanitizer(env, "raise")
    k = fake_cuda.kernel
    f0 = capture(env, san, [k(0, B, C)], [B, C])
    b0 = capture(env, san, [k(0, B, D)], [D])
    assert san.tracker.on_free(C, lambda: FreeEvent([("graph.py", 3, "reuse")], "train", 1))
    f1 = capture(env, san, [k(0, C, E)], [C, E])
    b1 = capture(env, san, [k(0, C, D)], [])
    for _ in range(2):
        for g in (f0, b0, f1, b1):
            g.replay()
    assert san.findings == []
    f0.replay()
    with pytest.raises(StaleMemoryError) as err:
        f1.replay()
    assert f1.launched == 2, "the replay that overwrites the output must not run"
    (f,) = err.value.findings
    ids = [hooks.graph_state(g).info.id for g in (f0, b0, f1)]
    assert f.kind == "live-output" and f.graph.id == ids[2] and f.order.written_by == ids[0]
    assert f.block_address == C and f"graph #{ids[1]}" in f.now

"""Coverage beyond stale inputs on real CUDA graphs: replay order in a shared pool, pinned host
memory, pointer tables, and graphsan disabling itself on internal errors. Each program runs in
a subprocess, most with graphsan off (the corruption it prevents) and on."""

from __future__ import annotations

import pytest

from tests.gpu_programs import prefetch, run_program

pytestmark = pytest.mark.gpu

PROGRAMS = ["replay_order", "pointer_table", "internal_faults", "host_pinned", "shared_pool_ok"]
TABLE_CASES = ("free", "rewrite", "ok")
FAULTS = ("node", "view", "free")
HOST_CASES = ("free", "refill")


@pytest.fixture(scope="module", autouse=True)
def _all_programs_side_by_side():
    prefetch(
        [("replay_order", p, None) for p in ("off", "raise")]
        + [("pointer_table", "raise", {"TABLE_CASE": c}) for c in TABLE_CASES]
        + [("internal_faults", "raise", {"GRAPHSAN_FAULT": f}) for f in FAULTS]
        + [("host_pinned", p, {"HOST_CASE": c}) for p in ("off", "raise") for c in HOST_CASES]
        + [("shared_pool_ok", "raise", None)]
    )


def _kinds(result):
    return [f["kind"] for f in result["findings"]]


def test_out_of_order_replay_corrupts_without_graphsan():
    rc, result, log = run_program("replay_order", policy="off")
    assert rc == 0, log[-3000:]
    assert result["e_in_order"] == 5.0
    assert result["e_out_of_order"] == 10.0, "g1 read f's memory (7 + 3)"


def test_out_of_order_replay_raises_before_launch():
    rc, result, log = run_program("replay_order", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["in_order"] == ["replayed"] * 6, result
    assert result["out_of_order"] == "raised", log[-3000:]
    assert result["error_kinds"] == ["replay-order"]
    assert result["e_out_of_order"] == 5.0, "the stale replay never ran"
    assert result["f"] == 7.0 and result["healthy"]
    assert "prog_replay_order.py" in result["error_text"]


@pytest.mark.parametrize("fault", FAULTS)
def test_an_internal_fault_disables_graphsan_once_and_training_goes_on(fault):
    rc, result, log = run_program("internal_faults", "raise", env={"GRAPHSAN_FAULT": fault})
    assert rc == 0, log[-3000:]
    assert result["losses_finite"] and result["loss_went_down"] and result["healthy"]
    reason = result["disabled_reason"] or ""
    assert ("injected" if fault != "node" else "internal error") in reason, log[-3000:]
    assert log.count("disables itself") <= 1 and "Traceback" not in log, log[-3000:]


def test_a_freed_buffer_named_in_a_pointer_table_raises_before_the_fault():
    rc, result, log = run_program("pointer_table", "raise", env={"TABLE_CASE": "free"})
    assert rc == 0, log[-3000:]
    assert result["replay"] == "raised", log[-3000:]
    assert result["healthy"], "the graph never launched: the context is intact"
    (f,) = result["findings"]
    assert f["kind"] == "unmapped" and f["through"] is not None and f["through_slot"] == 8
    assert "scale_rows" in f["kernel"] and f["param"] == 0
    assert "indirect" in f["text"]


@pytest.mark.parametrize("case", ["rewrite", "ok"])
def test_pointer_tables_and_index_tensors_raise_nothing_when_correct(case):
    rc, result, log = run_program("pointer_table", "raise", env={"TABLE_CASE": case})
    assert rc == 0, log[-3000:]
    assert result["findings"] == [] and result["replay"] == "replayed", log[-3000:]
    assert result["correct"] and result["healthy"]


def test_a_freed_pinned_batch_is_copied_from_the_next_batch_without_graphsan():
    rc, result, log = run_program("host_pinned", "off", env={"HOST_CASE": "free"})
    assert rc == 0, log[-3000:]
    if not result["same_pages"]:
        pytest.skip("the pinned-memory cache did not hand the pages to the next batch this time")
    assert result["y"] == 14.0, "the replay copied the next batch (7 * 2)"


def test_a_freed_pinned_batch_raises_before_launch():
    rc, result, log = run_program("host_pinned", "raise", env={"HOST_CASE": "free"})
    assert rc == 0, log[-3000:]
    assert result["graph_counts"]["host"] == 1, result["graph_counts"]
    assert result["replay"] == "raised" and result["healthy"], log[-3000:]
    (f,) = result["findings"]
    assert f["host"] and f["kind"] in ("freed", "reowned") and f["param"] == "src"
    assert f["pool"] == "pinned host memory"
    assert "prog_host_pinned.py" in f["text"]  # the pin_memory() and del sites


def test_a_pinned_batch_refilled_in_place_replays_clean():
    rc, result, log = run_program("host_pinned", "raise", env={"HOST_CASE": "refill"})
    assert rc == 0, log[-3000:]
    assert result["findings"] == [] and result["replay"] == "replayed" and result["y"] == 6.0


def test_many_graphs_in_one_pool_trained_in_order_raise_nothing():
    rc, result, log = run_program("shared_pool_ok", "raise")
    assert rc == 0, log[-3000:]
    assert result["findings"] == [], [f["text"] for f in result["findings"]][:2]
    assert result["losses_finite"] and result["loss_went_down"] and result["healthy"]
    assert result["shared_pools"] == 1, "the 16 graphs share one pool and are followed"

"""Issue 15 on real CUDA graphs (H200): replay order in a shared pool, pinned host memory,
pointer tables, and graphsan disabling itself on internal errors. Each program runs in a
subprocess, most with graphsan off (the corruption it prevents) and on."""

from __future__ import annotations

import pytest

from tests.gpu_programs import prefetch, run_program

pytestmark = pytest.mark.gpu

PROGRAMS = ["replay_order"]


@pytest.fixture(scope="module", autouse=True)
def _all_programs_side_by_side():
    prefetch([(n, p, None) for n in PROGRAMS for p in ("off", "raise")])


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


@pytest.mark.parametrize("fault", ["node", "view", "free"])
def test_an_internal_fault_disables_graphsan_once_and_training_goes_on(fault):
    rc, result, log = run_program("internal_faults", "raise", env={"GRAPHSAN_FAULT": fault})
    assert rc == 0, log[-3000:]
    assert result["losses_finite"] and result["loss_went_down"] and result["healthy"]
    reason = result["disabled_reason"] or ""
    assert ("injected" if fault != "node" else "internal error") in reason, log[-3000:]
    assert log.count("disables itself") <= 1 and "Traceback" not in log, log[-3000:]

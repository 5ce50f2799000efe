"""Live outputs on a real GPU. A pipeline schedule: four graphs of one pool captured in a 1F1B
order, replayed in capture order (quiet and correct) and in another schedule, which writes
forward mb1's activation over backward mb0's gradient while the caller holds it. And a tensor
allocated eagerly into a graph's pool over the graph's freed scratch."""

from __future__ import annotations

import pytest

from tests.gpu_programs import prefetch, run_program

pytestmark = pytest.mark.gpu

POLICIES = ("off", "raise", "pin")


@pytest.fixture(scope="module", autouse=True)
def _all_policies_side_by_side():
    prefetch([(name, p, None) for name in ("pipeline_schedule", "eager_in_pool") for p in POLICIES])


def test_the_other_schedule_corrupts_the_gradient_without_graphsan():
    rc, result, log = run_program("pipeline_schedule", policy="off")
    assert rc == 0, log[-3000:]
    assert result["recarved"] and result["in_order"] == (["replayed"] * 4 + [True]) * 3
    assert result["schedule"] == ["replayed"] * 3
    assert result["grad0_correct"] is False, "forward mb1 did not overwrite the gradient"
    assert result["healthy"]


def test_graphsan_stops_forward_mb1_before_it_overwrites_the_gradient():
    rc, result, log = run_program("pipeline_schedule", policy="raise")
    assert rc == 0, log[-3000:]
    assert result["recarved"] and result["in_order"] == (["replayed"] * 4 + [True]) * 3, log[-3000:]
    assert result["schedule"] == ["replayed", "replayed", "raised"], log[-3000:]
    assert result["error_kinds"] == ["live-output"]
    assert result["grad0_correct"] is True and result["healthy"]
    text = result["error_text"]
    assert "LIVE-OUTPUT" in text and "pin cannot help" in text
    assert "prog_pipeline_schedule.py" in text  # the gradient's allocation site
    (f,) = result["findings"]
    assert f["written_by"] is not None and f["label"].startswith("prog_pipeline_schedule.py")


def test_under_pin_the_pinned_activation_leaves_the_gradient_its_own_memory_or_pin_raises():
    """pin keeps forward mb1's activation alive for its graph, so backward mb0's gradient is
    carved elsewhere and the other schedule is correct; where the gradient did take that
    memory, pin cannot help (an order, not a lifetime) and raises like `raise`."""
    rc, result, log = run_program("pipeline_schedule", policy="pin")
    assert rc == 0, log[-3000:]
    assert result["in_order"] == (["replayed"] * 4 + [True]) * 3, log[-3000:]
    if result["recarved"]:
        assert result["schedule"] == ["replayed", "replayed", "raised"], log[-3000:]
        assert result["error_kinds"] == ["live-output"]
    else:
        assert result["schedule"] == ["replayed"] * 3, log[-3000:]
    assert result["grad0_correct"] is True and result["healthy"]


def test_a_replay_writes_its_scratch_over_a_tensor_allocated_eagerly_into_its_pool():
    rc, result, log = run_program("eager_in_pool", policy="off")
    assert rc == 0, log[-3000:]
    assert result["recarved"], "the pool did not hand the graph's scratch to the eager tensor"
    assert result["first"] == "replayed" and result["kept_intact"] is False
    assert result["after_del"] == ["replayed"] * 2 and result["y_correct"] and result["healthy"]


@pytest.mark.parametrize("policy", ["raise", "pin"])
def test_graphsan_names_the_eager_allocation_and_is_quiet_once_it_is_gone(policy):
    """pin cannot keep an eager tensor out of memory the graph writes, so it raises like raise."""
    rc, result, log = run_program("eager_in_pool", policy=policy)
    assert rc == 0, log[-3000:]
    assert result["recarved"], log[-3000:]
    assert result["first"] == "raised" and result["kept_intact"] is True, log[-3000:]
    assert result["error_kinds"] == ["live-output"]
    assert "prog_eager_in_pool.py" in result["error_text"]  # where the eager tensor was allocated
    assert result["after_del"] == ["replayed"] * 2, log[-3000:]
    assert result["y_correct"] and result["healthy"]
    (f,) = result["findings"]
    assert f["written_by"] is None

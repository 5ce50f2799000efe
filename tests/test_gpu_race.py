"""Replays that race across streams, on a GPU (tests/gpu/programs/prog_race.py): without
graphsan, a graph's output carved from another's scratch and replayed beside it on a second
stream makes the first graph's result wrong; graphsan stops that replay before its launch,
naming both graphs and both streams; every ordering the program can give (wait_stream, an event
waited for, the host waiting) and separate pools are quiet."""

from __future__ import annotations

import pytest

from tests.gpu_programs import prefetch, run_program

pytestmark = pytest.mark.gpu

QUIET = [("wait_stream", "same"), ("event", "same"), ("host", "same"), ("none", "separate")]


@pytest.fixture(scope="module", autouse=True)
def _all_side_by_side():
    runs = [("race", "off", {"RACE_ORDER": "none"}), ("race", "raise", {"RACE_ORDER": "none"})]
    runs += [("race", "raise", {"RACE_ORDER": o, "RACE_POOL": p}) for o, p in QUIET]
    prefetch(runs)


def test_without_graphsan_the_race_computes_garbage():
    rc, result, log = run_program("race", policy="off", env={"RACE_ORDER": "none"})
    assert rc == 0, log[-3000:]
    assert result["wrong_rounds"] > 0 and result["healthy"], result


def test_graphsan_stops_the_racing_replay_before_its_launch():
    rc, result, log = run_program("race", policy="raise", env={"RACE_ORDER": "none"})
    assert rc == 0, log[-3000:]
    assert "raised" in result["rounds"] and result["error_kinds"] == ["replay-race"], result
    assert result["wrong_rounds"] == 0 and result["healthy"], "no racing replay ran"
    text = result["error_text"]
    assert "REPLAY-RACE" in text and "stream" in text and "prog_race.py" in text, text


@pytest.mark.parametrize(("order", "pool"), QUIET)
def test_an_ordered_or_disjoint_pair_is_quiet(order, pool):
    rc, result, log = run_program(
        "race", policy="raise", env={"RACE_ORDER": order, "RACE_POOL": pool}
    )
    assert rc == 0, log[-3000:]
    assert result["rounds"] == ["replayed"] * 5 and result["findings"] == [], result
    assert result["wrong_rounds"] == 0

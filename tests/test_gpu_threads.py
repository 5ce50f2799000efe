"""Threads capturing, replaying and freeing at once on a GPU (tests/gpu/programs/prog_threads.py),
under every policy: each thread's correct replays run and compute the right result, each stale
replay is judged as its policy says (stopped, or reported once, naming that thread's graph, or
pinned and right), no finding lands on a correct graph, graphsan stays enabled, and every thread
ends within the program's time limit (a deadlock fails the test)."""

from __future__ import annotations

import pytest

from tests.gpu_programs import prefetch, run_program

pytestmark = pytest.mark.gpu

POLICIES = ["off", "raise", "warn", "record", "pin"]


@pytest.fixture(scope="module", autouse=True)
def _all_side_by_side():
    prefetch([("threads", policy, None) for policy in POLICIES], workers=5)


def rounds_of(policy):
    rc, result, log = run_program("threads", policy=policy)
    assert rc == 0 and result is not None, log[-3000:]
    assert result["alive"] == 0, f"{result['alive']} thread(s) still running: a deadlock"
    assert result["errors"] == [], result["errors"][:5]
    assert result["healthy"] and result["disabled_reason"] is None, result["disabled_reason"]
    assert len(result["rounds"]) == 6 * 25, len(result["rounds"])
    return result


def test_without_graphsan_the_stale_rounds_compute_garbage_and_the_others_are_right():
    result = rounds_of("off")
    rounds = result["rounds"]
    assert all(r["right"] for r in rounds if not r["stale"])
    assert any(not r["right"] for r in rounds if r["stale"]), "the stale rounds show the hazard"


@pytest.mark.parametrize("policy", ["raise", "warn", "record", "pin"])
def test_each_policy_judges_exactly_the_stale_rounds_of_each_thread(policy):
    result = rounds_of(policy)
    rounds = result["rounds"]
    stale = {r["label"] for r in rounds if r["stale"]}
    assert stale, "the program made some rounds stale"
    assert all(r["right"] for r in rounds if not r["stale"]), "a correct replay went wrong"
    found = {f["label"] for f in result["findings"]}
    assert found <= stale, f"findings on correct graphs: {sorted(found - stale)[:5]}"
    if policy == "raise":
        assert {r["label"] for r in rounds if r["outcome"] == "raised"} == stale
        assert found == stale
    elif policy in ("warn", "record"):
        assert all(r["outcome"] == "ran" for r in rounds)
        assert found == stale
    else:  # pin: the freed input is held by the graph, so the stale replay is right
        assert all(r["outcome"] == "ran" and r["right"] for r in rounds)

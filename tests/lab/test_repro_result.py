"""The repro results are typed: a result goes through JSON and back unchanged, in the very
format `graphsan repro --json` has written all along (the HTML matrix page reads it), and a
child's result file that does not fit is one error naming the field."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from graphsan.command_line import write_result
from graphsan.lab import repro
from graphsan.lab.choices import StatePolicy
from graphsan.lab.repro import CaseResult, RankResult, ResultError, logparse
from graphsan.lab.repro.result import describe_ranks


def result_file(data) -> str:
    """What a child writes to its result file: `data` on one RESULT line."""
    out = io.StringIO()
    write_result(data, out)
    return out.getvalue()


# a result with every field set, as `graphsan repro --json` writes it (json.dumps)
FULL = (
    '{"outcome": "StaleMemoryError", "iteration": 6, "finding": "reowned: x, freed in '
    'clear_workspace", "symptom": "CUDA error: an illegal memory access", "losses": [5.0, '
    '4.75, NaN], "eval_losses": [[5, 4.5]], "kinds": ["freed", "reowned"], "report": '
    '"graphsan: 1 finding\\n  reowned", "pinned": {"blocks": 1, "bytes": 2097152}, "startup": '
    '{"imports": 1.5, "cuda context": 2.25}, "ranks": [{"rank": 0, "outcome": '
    '"StaleMemoryError", "iteration": 6, "finding": "reowned: x", "symptom": ""}, {"rank": 1, '
    '"outcome": "stopped after a peer rank failed", "iteration": null, "finding": "", '
    '"symptom": "waited"}], "wall_s": 12.5, "timeline": [3.5, 4.0], "log_tail": "ITERATION 5 '
    't=4.0\\n", "comparison": "loss vs eager: max rel diff 1.0e-04 up to validation, inf '
    'after", "rel_diff": [0.0, 0.0001, Infinity], "rel_diff_before": 0.0001, '
    '"rel_diff_after": Infinity, "compared_from": 6, "reference_outcome": "trained through, 10 s", '
    '"reference_timeline": [3.0], "reference_losses": [5.0, 4.75, 4.5], '
    '"reference_eval_losses": [[5, 4.4]], "matched": false, "mismatch": "expected trained '
    'through"}'
)
EMPTY = (
    '{"outcome": "trained through", "iteration": null, "finding": "", "symptom": "", '
    '"losses": [], "eval_losses": [], "kinds": [], "report": "", "pinned": null, "startup": '
    '{}, "ranks": [], "wall_s": 0.0, "timeline": [], "log_tail": "", "comparison": "", '
    '"rel_diff": [], "rel_diff_before": null, "rel_diff_after": null, '
    '"compared_from": null, "reference_outcome": "", "reference_timeline": null, "reference_losses": null, '
    '"reference_eval_losses": null, "matched": null, "mismatch": ""}'
)
# case 4 as `graphsan repro --list --json` writes it (indent 1)
CASE_4 = """{
 "case": 4,
 "title": "graphsan raise",
 "recipe": "super-mixed",
 "graphed_modules": [
  "attn",
  "mamba",
  "moe_router",
  "moe_preprocess"
 ],
 "state": "te218",
 "graphsan": "raise",
 "empty_cache": true,
 "compare_with_eager": false,
 "expected": [
  "StaleMemoryError"
 ],
 "finding_freed_in": "clear_workspace",
 "about": "stopped before the replay, naming out_proj's weight workspace",
 "schedule": "sequential",
 "captured_in": null,
 "finding_kinds": [],
 "reuse_graph_buffers": false
}"""


@pytest.mark.parametrize("text", [FULL, EMPTY], ids=["full", "empty"])
def test_a_result_round_trips_through_json_in_the_same_format(text):
    res = CaseResult.from_json(json.loads(text))
    assert json.dumps(res.to_json()) == text
    assert CaseResult.from_json(json.loads(json.dumps(res.to_json()))) == res
    assert text != EMPTY or res == CaseResult()


def test_a_result_written_when_every_comparison_split_at_validation_reads_the_same():
    earlier = json.loads(FULL)
    del earlier["compared_from"]
    earlier["rel_diff_before_eval"] = earlier.pop("rel_diff_before")
    earlier["rel_diff_after_eval"] = earlier.pop("rel_diff_after")
    assert CaseResult.from_json(earlier) == CaseResult.from_json(json.loads(FULL))
    uncompared = json.loads(EMPTY)
    uncompared["rel_diff_after_eval"] = uncompared.pop("rel_diff_after")
    assert CaseResult.from_json(uncompared).compared_from is None


def test_the_fields_are_typed_and_frozen():
    res = CaseResult.from_json(json.loads(FULL))
    assert res.ranks[1] == RankResult(1, "stopped after a peer rank failed", symptom="waited")
    assert res.ranks[1].kind is repro.Outcome.PEER_FAILED
    assert res.eval_losses == ((5, 4.5),) and res.reference_eval_losses == ((5, 4.4),)
    assert isinstance(res.losses, tuple) and res.kind is repro.Outcome.STALE_MEMORY_ERROR
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.outcome = "trained through"
    # lists given in code become tuples, so a result built either way compares equal
    assert CaseResult(losses=[1.0], eval_losses=[[5, 1.0]]) == CaseResult(
        losses=(1.0,), eval_losses=((5, 1.0),)
    )
    assert res.replace(matched=True).matched is True and res.matched is False


def test_a_case_lists_in_the_same_format():
    assert json.dumps(repro.BY_NUMBER[4].to_json(), indent=1) == CASE_4
    assert repro.BY_NUMBER[4].state is StatePolicy.TE218
    written_by_name = dataclasses.replace(repro.BY_NUMBER[6], state="fixed")
    assert written_by_name.state is StatePolicy.FIXED
    with pytest.raises(ValueError, match="case 6: state bogus: expected one of fixed, te218"):
        dataclasses.replace(repro.BY_NUMBER[6], state="bogus")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"iteration": "six"}, "field 'iteration': expected an integer or null, got 'six'"),
        ({"iteration": True}, "field 'iteration': expected an integer or null, got True"),
        ({"losses": [5.0, "x"]}, "field 'losses[1]': expected a number, got 'x'"),
        ({"losses": 5.0}, "field 'losses': expected a list, got 5.0"),
        ({"eval_losses": [[5]]}, "field 'eval_losses[0]': expected an [iteration, loss] pair"),
        ({"eval_losses": [[5.5, 1.0]]}, "field 'eval_losses[0][0]': expected an integer"),
        ({"startup": {"imports": "soon"}}, "field 'startup[\"imports\"]': expected a number"),
        ({"pinned": [1]}, "field 'pinned': expected an object or null, got [1]"),
        ({"matched": "yes"}, "field 'matched': expected true, false or null, got 'yes'"),
        ({"ranks": [{"rank": 0}]}, "field 'ranks[0].outcome': missing"),
        ({"ranks": [{"rank": -1, "outcome": "x"}]}, "field 'ranks[0].rank': expected a rank"),
        ({"ranks": ["rank 0"]}, "field 'ranks[0]': expected an object, got str"),
        ({"outcome": None}, "field 'outcome': expected a string, got None"),
    ],
)
def test_a_field_that_does_not_fit_is_named(change, message):
    data = dict(json.loads(FULL), **change)
    with pytest.raises(ResultError) as err:
        CaseResult.from_json(data)
    assert str(err.value).startswith(message), err.value
    # from a child: one line that names the field, not a traceback in the parent
    res = logparse.result_of(result_file(data), "ITERATION 5 t=4.0\n", 0)
    assert res.outcome == logparse.UNREADABLE and res.kind is repro.Outcome.OTHER
    assert res.symptom.startswith(f"the child's result file: {message}"), res.symptom
    assert res.iteration == 6 and "\n" not in res.symptom


def test_a_result_that_is_no_object_or_no_json_is_named_too():
    with pytest.raises(ResultError, match="the result: expected an object, got list"):
        CaseResult.from_json([1, 2])
    res = logparse.result_of('RESULT {"outcome": "trained', "", 0)
    assert res.outcome == logparse.UNREADABLE
    assert res.symptom.startswith("the child's result file: the RESULT line is not JSON (")
    listed = logparse.result_of(result_file([1, 2]), "", 0)  # no object: read_result says so
    assert listed.outcome == logparse.UNREADABLE
    assert listed.symptom == (
        "the child's result file: the RESULT line holds an array; expected a JSON object"
    )
    # unknown keys are a newer writer's: ignored
    assert CaseResult.from_json({"outcome": "trained through", "later": 1}) == CaseResult()


def test_the_ranks_are_described_in_one_line():
    ranks = CaseResult.from_json(json.loads(FULL)).ranks
    assert describe_ranks(ranks) == (
        "rank 0: StaleMemoryError (iteration 6); rank 1: stopped after a peer rank failed"
    )
    assert describe_ranks(ranks, short=True) == (
        "rank 0: StaleMemoryError @6; rank 1: stopped after a peer rank failed"
    )

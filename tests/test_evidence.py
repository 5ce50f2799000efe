"""A finding's evidence is typed by kind: replay-order and live-output findings hold an
`OrderEvidence`, the kinds about baked state a `BakedEvidence` (where the state changed is its
`changed_at`, never the free stack), the others neither. The JSON report stays flat, as every
schema version wrote it, and the (de)serialiser rebuilds the typed evidence; the text says what
each kind's evidence says."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from graphsan.core.kinds import Kind
from graphsan.core.records import (
    BakedEvidence,
    Finding,
    GraphInfo,
    Judged,
    OrderEvidence,
    Reference,
    When,
)
from graphsan.report import Report, StaleMemoryError, finding_from_dict, finding_to_dict
from graphsan.report.pages.trace import _finding_args
from graphsan.report.text import format_finding, one_line

GRAPH = GraphInfo(4, "train step", (("train.py", 40, "capture"),), (1, 0), 0)
REF = Reference(7, "void add_one(float*)", 0, 8, 0x7F00_0000_1000)
ALLOC = (("train.py", 12, "make"),)
FREE = (("train.py", 30, "main"), ("train.py", 22, "evaluate"))
SWITCH = (("train.py", 60, "main"), ("train.py", 31, "validate"))
WHEN = When("eval", 5, Judged(rank=1, found_at=1_780_000_006.0))
BLOCK = (0x7F00_0000_0000, 8192)
MEMORY = ("freed", "reowned", "moved", "unmapped", "pool-reuse")

# the flat keys of a finding in the report's JSON, in the order every version wrote them
JSON_KEYS = [
    *("kind", "graph", "node", "kernel", "param", "offset", "address", "nbytes"),
    *("block_address", "pool", "alloc_stack", "free_stack", "phase", "step", "free_op", "now"),
    *("other_nodes", "rank", "also_used_by", "freed_at", "found_at", "written_by", "carved_by"),
    *("replays", "streams", "through", "through_slot", "host", "caveat", "entry", "captured"),
    *("current",),
    *("modules", "likely_cause"),
]


def memory_finding(kind: str) -> Finding:
    return Finding.at(
        kind,
        GRAPH,
        REF,
        When("eval", 5, WHEN.judged),
        block=BLOCK,
        pool="default pool",
        alloc_stack=ALLOC,
        free_stack=FREE,
        free_op="resize_" if kind == "moved" else None,
        now="free in the allocator's cache",
    )


def order_finding(kind: str, written_by: int | None = 2) -> Finding:
    evidence = {
        "replay-order": OrderEvidence(written_by=written_by, carved_by=9),
        "replay-race": OrderEvidence(written_by=written_by, streams=(0x10, 0x20)),
    }.get(kind, OrderEvidence(written_by=written_by, replays=(3, 5) if written_by else None))
    return Finding.at(
        kind, GRAPH, REF, WHEN, evidence, block=BLOCK, pool="default pool", alloc_stack=ALLOC
    )


def baked_finding(kind: str, changed_at=SWITCH) -> Finding:
    evidence = {
        "mode": BakedEvidence(captured="train", current="eval", modules=("Net.drop",)),
        "baked-value": BakedEvidence(
            entry="Adam.param_groups[0]['lr']", captured="0.001", current="0.0005"
        ),
        "superseded": BakedEvidence(
            entry="Net.lin.weight",
            captured="a Parameter of shape (4, 4) at 0x7f0000001000",
            current="a Parameter of shape (4, 4) at 0x7f0000009000",
        ),
    }[kind]
    ref = REF if kind == "superseded" else Reference(-1, "", "", 0, 0)
    block = BLOCK if kind == "superseded" else (0, 0)
    evidence = dataclasses.replace(evidence, changed_at=changed_at)
    return Finding.at(kind, GRAPH, ref, When("validation", 40, WHEN.judged), evidence, block=block)


def every_kind() -> list[Finding]:
    out = [memory_finding(k) for k in MEMORY]
    out += [order_finding("replay-order"), order_finding("live-output")]
    out.append(order_finding("replay-race"))
    out.append(order_finding("live-output", written_by=None))  # eager code's tensor
    out += [baked_finding(k) for k in ("mode", "baked-value", "superseded")]
    out.append(baked_finding("baked-value", changed_at=()))  # found by comparing at the replay
    assert {f.kind for f in out} == set(Kind)
    return out


# ----------------------------------------------------------------------------- the shape
@pytest.mark.parametrize("kind", list(Kind))
def test_each_kind_holds_its_own_evidence_and_no_other(kind):
    f = next(f for f in every_kind() if f.kind is kind)
    assert isinstance(f.order, OrderEvidence) is kind.order
    assert isinstance(f.baked, BakedEvidence) is kind.baked
    if not kind.order:
        assert f.order is None
    if not kind.baked:
        assert f.baked is None
    # the public fields stay readable on every finding
    for name in ("kind", "graph", "node", "kernel", "param", "offset", "address", "nbytes"):
        getattr(f, name)
    assert (f.alloc_stack, f.phase, f.step) is not None and isinstance(f.free_stack, tuple)


def test_a_baked_finding_has_no_free_stack_and_says_where_it_changed():
    f = baked_finding("mode")
    assert f.free_stack == () and f.baked.changed_at == SWITCH
    assert (f.phase, f.step) == ("validation", 40)  # the change's, not the judgement's
    with pytest.raises(ValueError, match="free_stack is .*expected it empty in a finding of kind"):
        dataclasses.replace(f, free_stack=SWITCH)


def test_an_order_finding_has_no_baked_evidence_and_a_memory_finding_neither():
    f = order_finding("replay-order")
    assert f.baked is None and f.order == OrderEvidence(written_by=2, carved_by=9)
    with pytest.raises(ValueError, match="baked is .*expected None in a finding of kind"):
        dataclasses.replace(f, baked=BakedEvidence(entry="x"))
    freed = memory_finding("freed")
    assert freed.order is None and freed.baked is None
    with pytest.raises(ValueError, match="order is .*expected None in a finding of kind freed"):
        dataclasses.replace(freed, order=OrderEvidence())


def test_a_kind_given_no_evidence_gets_its_empty_evidence():
    bare = dict(graph=GRAPH, node=0, kernel="k", param=0, offset=0, address=1, nbytes=1)
    bare |= dict(block_address=1, pool="")
    live = Finding(kind="live-output", **bare)
    assert live.order == OrderEvidence() and live.baked is None
    assert "eager code allocated a tensor into the graph's memory pool" in live.likely_cause
    mode = Finding(kind="mode", **bare)
    assert mode.baked == BakedEvidence() and mode.order is None
    with pytest.raises(ValueError, match="expected OrderEvidence"):
        Finding(kind="replay-order", order=BakedEvidence(), **bare)


# ----------------------------------------------------------------------------- the JSON
@pytest.mark.parametrize("f", every_kind(), ids=lambda f: str(f.kind))
def test_each_kind_round_trips_through_the_flat_json(f):
    d = finding_to_dict(f)
    assert list(d) == JSON_KEYS
    assert json.loads(json.dumps(d)) == json.loads(json.dumps(finding_to_dict(f)))
    back = finding_from_dict(json.loads(json.dumps(d)))
    assert back == f and back.flat() == f.flat()
    assert Finding.of(**f.flat()) == f


def as_json(f: Finding) -> dict:
    return json.loads(json.dumps(finding_to_dict(f)))


def test_the_json_keeps_a_baked_change_under_free_stack_and_empty_fields_elsewhere():
    mode = as_json(baked_finding("mode"))
    assert mode["free_stack"] == [list(x) for x in SWITCH]
    assert (mode["modules"], mode["captured"], mode["current"]) == (["Net.drop"], "train", "eval")
    assert (mode["written_by"], mode["carved_by"], mode["replays"]) == (None, None, None)
    freed = as_json(memory_finding("freed"))
    assert freed["free_stack"] == [list(x) for x in FREE]
    assert (freed["entry"], freed["modules"], freed["written_by"]) == (None, [], None)
    live = as_json(order_finding("live-output"))
    assert (live["written_by"], live["replays"], live["entry"]) == (2, [3, 5], None)


def _saved(tmp_path, version: int, findings: list[dict], name: str = "r.json") -> Report:
    data = {"schema": "graphsan.report", "version": version, "rank": 1, "policy": "raise"}
    data |= {"findings": findings, "graphs": [], "pinned": {}}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return Report.load(str(path))


def test_reports_of_older_versions_load_with_typed_evidence(tmp_path):
    fs = every_kind()
    now = Report(fs, rank=1)
    findings = now.to_dict()["findings"]
    # v8 added the baked kinds and their fields: a v8 report holds every kind
    v8 = _saved(tmp_path, 8, findings, "v8.json")
    assert v8.findings == fs and v8.render().split("\n", 2)[2] == now.render().split("\n", 2)[2]
    mode = next(f for f in v8.findings if f.kind == "mode")
    assert mode.free_stack == () and mode.baked.changed_at == SWITCH
    # v4 added replay-order (written_by, carved_by); replays, caveat and the baked fields came
    # later, and a file of v4 holds none of them
    later = ("replays", "caveat", "entry", "captured", "current", "modules")
    order = finding_to_dict(order_finding("replay-order"))
    v4 = _saved(tmp_path, 4, [{k: v for k, v in order.items() if k not in later}], "v4.json")
    assert v4.findings[0].order == OrderEvidence(written_by=2, carved_by=9)
    assert v4.findings[0].baked is None
    # v1: no also_used_by, no order fields at all
    early = ("also_used_by", "freed_at", "found_at", "written_by", "carved_by", "through")
    early += ("through_slot", "host")
    freed = finding_to_dict(memory_finding("freed"))
    v1 = _saved(
        tmp_path, 1, [{k: v for k, v in freed.items() if k not in early + later}], "v1.json"
    )
    (f,) = v1.findings
    assert (f.order, f.baked, f.free_stack) == (None, None, FREE)
    assert format_finding(f) == format_finding(memory_finding("freed"))


def test_a_saved_finding_holding_another_kinds_evidence_is_one_line_naming_it(tmp_path):
    freed = dict(finding_to_dict(memory_finding("freed")), written_by=3)
    with pytest.raises(ValueError) as err:
        _saved(tmp_path, 9, [finding_to_dict(memory_finding("unmapped")), freed])
    message = str(err.value)
    assert "findings[1].written_by is 3; expected it empty in a finding of kind freed" in message
    assert "\n" not in message


# ----------------------------------------------------------------------------- the text
def test_each_kind_reads_as_its_evidence_says():
    texts = {(str(f.kind), f.order and f.order.written_by): f for f in every_kind()}
    order = texts["replay-order", 2]
    assert "order: replayed after graph #9 overwrote the range and before graph #2" in (
        format_finding(order)
    )
    assert "written by graph #2, overwritten by graph #9" in one_line(order)
    live = texts["live-output", 2]
    assert "this would be the pool's replay #5; graph #2 wrote the output at replay #3" in (
        format_finding(live)
    )
    assert "holds graph #2's output" in one_line(live)
    eager = texts["live-output", None]
    assert "eager code was handed the memory" in format_finding(eager)
    freed = texts["freed", None]
    assert "freed (phase eval, step 5) at (most recent call last):" in format_finding(freed)
    assert "freed at train.py:22 in evaluate (phase eval, step 5)" in one_line(freed)


def test_a_baked_finding_reads_as_a_change_not_a_free():
    mode = baked_finding("mode")
    text = format_finding(mode)
    assert "  modules: Net.drop\n  at capture: train\n  now: eval" in text
    assert "switched (phase validation, step 40) at (most recent call last):" in text
    assert "train.py:31 in validate" in text and "freed" not in text
    assert one_line(mode).endswith("changed at train.py:31 in validate (phase validation, step 40)")
    lr = baked_finding("baked-value", changed_at=())
    assert "changed before this replay (phase validation, step 40): by a plain assignment" in (
        format_finding(lr)
    )
    assert "Adam.param_groups[0]['lr']" in one_line(lr) and "changed at" not in one_line(lr)
    superseded = format_finding(baked_finding("superseded"))
    assert "  entry: Net.lin.weight" in superseded and "re-pointed (phase" in superseded


def test_the_error_head_counts_findings_of_every_kind():
    err = StaleMemoryError([baked_finding("mode"), order_finding("replay-order")])
    assert str(err).startswith(
        "graphsan: replay stopped before launch: 2 finding(s)\n\n[rank 1] MODE: "
    )
    assert "stale reference" not in str(err)


def test_the_trace_names_where_baked_state_changed_not_where_it_was_freed():
    assert _finding_args(baked_finding("mode"))["changed at"] == "train.py:31 in validate"
    assert "freed at" not in _finding_args(baked_finding("mode"))
    assert _finding_args(memory_finding("freed"))["freed at"] == "train.py:22 in evaluate"


@pytest.mark.parametrize("f", every_kind(), ids=lambda f: str(f.kind))
def test_the_selftest_verdict_reads_each_kind_from_the_childs_result(f):
    from graphsan.command_line import read_result, write_result
    from graphsan.selftest.child import _finding
    from graphsan.selftest.runner import BUG, CAUGHT, judge

    result = {"outcome": "stopped", "graphs": 1, "findings": [_finding(f)], "kinds": [f.kind]}
    sent = io.StringIO()
    write_result(result, sent)
    verdict = judge("twin", BUG, read_result(sent.getvalue()), "", 0)
    assert (verdict.verdict, verdict.detail) == (CAUGHT, one_line(f))

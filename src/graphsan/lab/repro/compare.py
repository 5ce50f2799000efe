"""Judging a result: the loss comparison with the eager run, and the match with the case."""

from __future__ import annotations

import math

from graphsan.lab.repro.cases import EVAL_AT, ITERS, LOSS_RTOL, Case, Outcome
from graphsan.lab.repro.result import CaseResult


def compare(res: CaseResult, ref: CaseResult) -> str:
    """Per-iteration loss against the eager run, over the iterations both have (a case that
    stopped on a NaN loss has fewer); NaN counts as an infinite difference. Fills `res`'s
    relative differences and returns the comparison in words."""
    a, b = res.losses, ref.losses
    if len(b) < ITERS or not all(math.isfinite(y) for y in b):
        return f"inconclusive: the eager reference {ref.outcome or 'gave no losses'}"
    n = min(len(a), len(b))
    if n <= EVAL_AT:
        return "no losses after validation to compare"
    rel = [
        abs(x - y) / max(abs(y), 1e-12) if math.isfinite(x) else math.inf
        for x, y in zip(a[:n], b[:n], strict=True)
    ]
    before, after = max(rel[:EVAL_AT]), max(rel[EVAL_AT:])
    res.rel_diff_before_eval, res.rel_diff_after_eval, res.rel_diff = before, after, rel
    return f"loss vs eager: max rel diff {before:.1e} up to validation, {after:.1e} after"


def add_comparison(res: CaseResult, ref: CaseResult) -> None:
    """Compare with the eager reference; losses off by more than LOSS_RTOL after validation
    turn a run that trained through into silent corruption."""
    res.comparison = compare(res, ref)
    res.reference_timeline = ref.timeline
    res.reference_losses = ref.losses
    res.reference_eval_losses = ref.eval_losses
    res.reference_outcome = f"{ref.outcome}, {ref.wall_s:.0f} s"
    after = res.rel_diff_after_eval
    if res.kind is Outcome.TRAINED_THROUGH and after is not None and after > LOSS_RTOL:
        res.outcome = Outcome.SILENT_CORRUPTION.value


def judge(case: Case, res: CaseResult) -> str:
    """Why the result does not match the case's expectation ("" when it does)."""
    kind = res.kind
    if kind not in case.expected:
        return f"expected {' or '.join(case.expected_values())}"
    it = res.iteration
    if kind is not Outcome.TRAINED_THROUGH and it is not None and it <= EVAL_AT:
        return f"ended in iteration {it}; expected after validation (iteration {EVAL_AT})"
    if case.finding_freed_in and f"in {case.finding_freed_in}" not in res.finding:
        return f"expected graphsan's finding to name memory freed in {case.finding_freed_in}"
    if case.compare and kind is Outcome.TRAINED_THROUGH and res.rel_diff_after_eval is None:
        return f"expected a comparison with eager; {res.comparison or 'there was none'}"
    # on several ranks, a rank that failed by itself failed as the case expects (one that
    # trained through touched no stale memory; one that stopped waited for a failed peer)
    for x in res.ranks:
        rank_kind = Outcome.of(x["outcome"])
        passive = (Outcome.TRAINED_THROUGH, Outcome.PEER_FAILED)
        if rank_kind not in case.expected and rank_kind not in passive:
            return f"rank {x['rank']} ended in {x['outcome']}; expected {' or '.join(case.expected_values())}"
    return ""

"""Judging a result: the loss comparison with the eager run, and the match with the case."""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphsan.lab.repro.cases import AFTER_EVAL, EVAL_AT, ITERS, LOSS_RTOL, Case, Outcome
from graphsan.lab.repro.result import CaseResult


@dataclass(frozen=True)
class Comparison:
    """A case's losses against the eager reference run's: the relative difference at every
    iteration both have (NaN counted as infinite), the largest up to the case's split and from
    it on (None: nothing to compare), and all of it in words. The split is the first iteration
    in which the case can go wrong (`Case.fails_from`): after validation for the #3316 cases,
    the first graphed step for the schedule cases."""

    text: str
    rel_diff: tuple[float, ...] = ()
    before: float | None = None
    after: float | None = None
    split: int = AFTER_EVAL


def compare(res: CaseResult, ref: CaseResult, split: int = AFTER_EVAL) -> Comparison:
    """Per-iteration loss against the eager run, over the iterations both have (a case that
    stopped on a NaN loss has fewer), split at iteration `split`; where the losses part by more
    than LOSS_RTOL, the words name the first such iteration and both losses."""
    a, b = res.losses, ref.losses
    if len(b) < ITERS or not all(math.isfinite(y) for y in b):
        return Comparison(f"inconclusive: the eager reference {ref.outcome or 'gave no losses'}")
    n = min(len(a), len(b))
    up_to, after_words, from_on = _span_words(split)
    if n < split:
        return Comparison(f"no losses {from_on} to compare", split=split)
    rel = tuple(
        abs(x - y) / max(abs(y), 1e-12) if math.isfinite(x) else math.inf
        for x, y in zip(a[:n], b[:n], strict=True)
    )
    before, after = max(rel[: split - 1], default=0.0), max(rel[split - 1 :])
    text = f"loss vs eager: max rel diff {before:.1e} {up_to}, {after:.1e} {after_words}"
    off = next((i for i, d in enumerate(rel) if d > LOSS_RTOL), None)
    if off is not None:
        text += f"; first off by more than {LOSS_RTOL:g} at iteration {off + 1}: "
        text += f"{a[off]:.4g} vs eager {b[off]:.4g}"
    return Comparison(text, rel, before, after, split)


def _span_words(split: int) -> tuple[str, str, str]:
    """A split in words: up to it, after it beside that, and after it alone."""
    if split == AFTER_EVAL:
        return "up to validation", "after", "after validation"
    return f"up to iteration {split - 1}", f"from iteration {split}", f"from iteration {split}"


def add_comparison(res: CaseResult, ref: CaseResult, split: int = AFTER_EVAL) -> CaseResult:
    """`res` compared with the eager reference (split at iteration `split`, see `compare`);
    losses off by more than LOSS_RTOL from the split on turn a run that trained through into
    silent corruption."""
    c = compare(res, ref, split)
    if c.after is not None:
        res = res.replace(
            rel_diff=c.rel_diff,
            rel_diff_before=c.before,
            rel_diff_after=c.after,
            compared_from=c.split,
        )
        if res.kind is Outcome.TRAINED_THROUGH and c.after > LOSS_RTOL:
            res = res.replace(outcome=Outcome.SILENT_CORRUPTION.value)
    return res.replace(
        comparison=c.text,
        reference_timeline=ref.timeline,
        reference_losses=ref.losses,
        reference_eval_losses=ref.eval_losses,
        reference_outcome=f"{ref.outcome}, {ref.wall_s:.0f} s",
    )


def judge(case: Case, res: CaseResult) -> str:
    """Why the result does not match the case's expectation ("" when it does)."""
    kind = res.kind
    expected = " or ".join(case.expected_values())
    if kind not in case.expected:
        return f"expected {expected}"
    it = res.iteration
    if kind is not Outcome.TRAINED_THROUGH and it is not None and it < case.fails_from:
        if case.fails_from == AFTER_EVAL:
            return f"ended in iteration {it}; expected after validation (iteration {EVAL_AT})"
        return f"ended in iteration {it}; expected from iteration {case.fails_from}"
    if case.finding_freed_in and f"in {case.finding_freed_in}" not in res.finding:
        return f"expected graphsan's finding to name memory freed in {case.finding_freed_in}"
    if case.finding_kinds and not res.finding.startswith(
        tuple(f"{k}:" for k in case.finding_kinds)
    ):
        return f"expected graphsan's first finding to be {' or '.join(sorted(case.finding_kinds))}"
    if case.compare and kind is Outcome.TRAINED_THROUGH and res.rel_diff_after is None:
        return f"expected a comparison with eager; {res.comparison or 'there was none'}"
    # on several ranks, a rank that failed by itself failed as the case expects (one that
    # trained through touched no stale memory; one that stopped waited for a failed peer)
    passive = (Outcome.TRAINED_THROUGH, Outcome.PEER_FAILED)
    for x in res.ranks:
        if x.kind not in case.expected and x.kind not in passive:
            return f"rank {x.rank} ended in {x.outcome}; expected {expected}"
    return ""

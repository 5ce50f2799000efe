"""The markdown tables: the cases, and the results with their verdicts."""

from __future__ import annotations

import sys

from graphsan.lab.repro.cases import Case
from graphsan.lab.repro.result import CaseResult, describe_ranks


def print_cases(cases: list[Case], out=None) -> None:
    out = out or sys.stdout
    print(
        "| case | title | recipe | graphed modules | state | graphsan | empty_cache | expected |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|", file=out)
    for c in cases:
        expected = " or ".join(c.expected_values())
        print(
            f"| {c.n} | {c.title} | {c.precision} | {','.join(c.scopes)} | {c.state} | "
            f"{c.graphsan} | {'yes' if c.empty_cache else 'no'} | {expected}: {c.about} |",
            file=out,
        )


def print_results(results: list[tuple[Case, CaseResult]], out=None) -> None:
    """The results; on several ranks a column says what each rank saw."""
    out = out or sys.stdout
    ranked = any(r.ranks for _, r in results)
    print(
        "| case | recipe | graphed modules | state | graphsan | outcome | as expected | "
        "iteration | evidence | graphsan's finding | "
        + ("what each rank saw | " if ranked else "")
        + "wall s |",
        file=out,
    )
    print("|---" * (12 if ranked else 11) + "|", file=out)
    for c, r in results:
        evidence = "; ".join(x for x in (r.symptom, r.comparison) if x)
        finding = r.finding
        if len(r.kinds) > 1:
            finding += f" (kinds: {', '.join(r.kinds)})"
        matched = "yes" if r.matched else f"NO: {r.mismatch}"
        print(
            f"| {c.n} | {c.precision} | {','.join(c.scopes)} | {c.state} | {c.graphsan} | "
            f"{r.outcome} | {_cell(matched)} | {r.iteration or '-'} | "
            f"{_cell(evidence)} | {_cell(finding)} | "
            + (f"{_cell(describe_ranks(r.ranks, short=True))} | " if ranked else "")
            + f"{r.wall_s:.1f} |",
            file=out,
        )


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ") or "-"

"""Identical findings folded into one row of the HTML report: the findings of one graph, node,
argument and kind (a finding made again at every replay, or on every rank) share a row
that says how many there were, where and when; the page details the first of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphsan.core.records import Finding, frame_text
from graphsan.report.pages.report_common import rel
from graphsan.report.text import no_free_stack, where_stack

FREE_SITES_SHOWN = 3  # distinct free sites a folded row names; the rest are counted


def fold_key(f: Finding) -> tuple:
    """What makes findings identical on the page: graph (id and label), node, argument, kind."""
    return (f.kind, f.graph.id, f.graph.label, f.node, f.param, f.offset)


def group_key(f: Finding) -> tuple:
    """What rows of one group share when the page has too many to detail: kind and graph."""
    return (f.kind, f.graph.id, f.graph.label)


@dataclass
class Fold:
    """The findings that share one `fold_key`, in the order the reports list them."""

    finding: Finding  # the first one: the page details it
    source: dict[str, Any]  # the report it came from (report_page's source dict)
    seen: dict[str, Finding] = field(default_factory=dict)  # the first finding per report
    count: int = 0
    first_found: float | None = None
    last_found: float | None = None
    steps: set[int] = field(default_factory=set)
    phases: dict[str, None] = field(default_factory=dict)  # in order, without repeats
    # innermost free frames, or change frames of baked state (without one, what the page says
    # instead), texts made once each
    free_sites: dict[Any, None] = field(default_factory=dict)

    def add(self, name: str, f: Finding) -> None:
        self.count += 1
        self.seen.setdefault(name, f)
        if f.found_at is not None:
            if self.first_found is None or f.found_at < self.first_found:
                self.first_found = f.found_at
            if self.last_found is None or f.found_at > self.last_found:
                self.last_found = f.found_at
        if f.step is not None:
            self.steps.add(f.step)
        if f.phase:
            self.phases.setdefault(f.phase)
        where = where_stack(f)
        self.free_sites.setdefault(where[-1] if where else no_free_stack(f))


def fold_findings(sources: list[dict[str, Any]]) -> list[Fold]:
    """Every finding of every source, folded by `fold_key`, in order of first appearance."""
    folds: dict[tuple, Fold] = {}
    for src in sources:
        for f in src["report"].findings:
            key = fold_key(f)
            fold = folds.get(key)
            if fold is None:
                fold = folds[key] = Fold(f, src)
            fold.add(src["name"], f)
    return list(folds.values())


def fold_view(fold: Fold, t0: float | None) -> dict[str, Any]:
    """What a folded row and its block say beyond the first finding: how many, when found,
    and in which steps, phases and places their memory was freed."""
    steps = sorted(fold.steps)
    if not steps:
        step_text = ""
    elif len(steps) == 1:
        step_text = f"step {steps[0]}"
    else:
        step_text = f"steps {steps[0]} to {steps[-1]}"
    sites = [s if isinstance(s, str) else frame_text(s) for s in fold.free_sites]
    return {
        "fold_key": fold_key(fold.finding),
        "count": fold.count,
        "count_text": f"{fold.count:,}",
        "first": rel(fold.first_found, t0),
        "last": rel(fold.last_found, t0),
        "fold_when": ", ".join([*fold.phases, step_text] if step_text else fold.phases),
        "free_sites": sites[:FREE_SITES_SHOWN],
        "more_sites": max(len(sites) - FREE_SITES_SHOWN, 0),
    }

"""Reports of several processes: ranks merged into one summary, and pytest-xdist's workers
combined into one report.

`merge_reports` groups findings that are the same bug seen on several ranks (same kind, graph
label, node, kernel and free site) and says which ranks saw each one. `combine` makes one report
of several processes' reports (each worker of one test run): every finding, graph, event and
suppressed finding of each, graph ids renumbered so that one process's graphs never take
another's findings.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from graphsan.core.locations import location
from graphsan.core.records import Finding, OrderEvidence
from graphsan.report.json_report import Report
from graphsan.report.text import format_finding, where_stack


def finding_signature(f: Finding) -> tuple:
    # the free (or change) site by its location: ranks on hosts with other install paths agree
    stack = where_stack(f)
    free = (location(stack[-1][0]), *stack[-1][1:]) if stack else None
    return (f.kind, f.graph.label, f.node, f.kernel, f.param, f.offset, free, f.phase, f.step)


def merge_reports(reports: list[Report], names: list[str] | None = None) -> str:
    """One summary over several ranks' reports."""
    names = names or [f"report {i}" for i in range(len(reports))]
    groups: dict[tuple, tuple[Finding, list[str]]] = {}
    for report, name in zip(reports, names, strict=True):
        who = f"rank {report.rank}" if report.rank is not None else name
        for f in report.findings:
            sig = finding_signature(f)
            if sig not in groups:
                groups[sig] = (f, [])
            if who not in groups[sig][1]:
                groups[sig][1].append(who)
    graphs = sum(len(r.graphs) for r in reports)
    lines = [
        f"graphsan: {len(reports)} report(s), {graphs} graph(s), "
        f"{sum(len(r.findings) for r in reports)} finding(s), {len(groups)} distinct"
    ]
    clean = [
        (f"rank {r.rank}" if r.rank is not None else n)
        for r, n in zip(reports, names, strict=True)
        if not r.findings
    ]
    for f, ranks in groups.values():
        lines.append("")
        lines.append(f"seen on {', '.join(ranks)}:")
        lines.append(format_finding(f))
    if clean:
        lines.append("")
        lines.append(f"no findings on {', '.join(clean)}")
    return "\n".join(lines)


def report_from_json(text: str, where: str) -> Report:
    """A report handed over as JSON text (an xdist worker's), checked as a saved one is;
    ValueError naming `where` otherwise."""
    from graphsan.report.json_report import _report_from_dict  # the loader, without a file

    try:
        return _report_from_dict(json.loads(text))
    except ValueError as err:  # not JSON, or a field off the schema (SchemaError)
        raise ValueError(f"{where}: not a valid graphsan report: {err}") from None


def distinct(findings: list[Finding]) -> int:
    """How many different bugs `findings` are, counted as `merge_reports` groups them."""
    return len({finding_signature(f) for f in findings})


def combine(reports: list[Report]) -> Report:
    """One report of several processes' reports (the first one's settings: policy, rank,
    provenance and the rest; watched where any of them watched). Graph ids are shifted per
    report past the previous reports' largest id."""
    if not reports:
        return Report()
    findings, graphs, events, suppressed = [], [], [], []
    pinned: dict[str, Any] = {}
    layouts: dict[str, Any] = {}
    shift = dropped = 0
    for rep in reports:
        findings += [_shifted(f, shift) for f in rep.findings]
        suppressed += [(name, _shifted(f, shift)) for name, f in rep.suppressed]
        graphs += [dict(g, id=g["id"] + shift) if "id" in g else g for g in rep.graphs]
        events += [dict(e, graph=e["graph"] + shift) if "graph" in e else e for e in rep.events]
        pinned = _added(pinned, rep.pinned)
        layouts.update(rep.layouts)
        dropped += rep.events_dropped
        shift += _largest_graph_id(rep)
    events.sort(key=lambda e: e.get("t", 0.0))  # times are the epoch's: workers line up
    said = [r.watched for r in reports if r.watched is not None]
    reasons = [r.disabled_reason for r in reports if r.disabled_reason]
    return dataclasses.replace(
        reports[0],
        findings=findings,
        graphs=graphs,
        events=events,
        events_dropped=dropped,
        pinned=pinned,
        layouts=layouts,
        suppressed=suppressed,
        allocator_log=next((r.allocator_log for r in reports if r.allocator_log), None),
        # watched where any process watched; idle (and why) only where none did
        watched=any(said) if said else None,
        disabled_reason="; ".join(dict.fromkeys(reasons)) or None,
    )


def _largest_graph_id(rep: Report) -> int:
    ids = [g["id"] for g in rep.graphs if isinstance(g.get("id"), int)]
    ids += [f.graph.id for f in rep.findings] + [f.graph.id for _, f in rep.suppressed]
    return max(ids, default=0)


def _shifted(f: Finding, shift: int) -> Finding:
    """`f` with every graph id it holds moved by `shift`."""
    if not shift:
        return f
    return dataclasses.replace(
        f,
        graph=dataclasses.replace(f.graph, id=f.graph.id + shift),
        also_used_by=tuple(dataclasses.replace(u, graph=u.graph + shift) for u in f.also_used_by),
        order=f.order and _shifted_order(f.order, shift),
    )


def _shifted_order(o: OrderEvidence, shift: int) -> OrderEvidence:
    return dataclasses.replace(
        o,
        written_by=None if o.written_by is None else o.written_by + shift,
        carved_by=None if o.carved_by is None else o.carved_by + shift,
    )


def _added(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two pin summaries added up, key by key (counts summed, per-site tables merged)."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict):
            out[key] = _added(out.get(key) or {}, value)
        elif isinstance(value, (int, float)) and isinstance(out.get(key), (int, float)):
            out[key] = out[key] + value
        else:
            out.setdefault(key, value)
    return out

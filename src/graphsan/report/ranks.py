"""Multi-rank reports: one JSON report per rank, merged into one summary.

`merge_reports` groups findings that are the same bug seen on several ranks (same kind, graph
label, node, kernel and free site) and says which ranks saw each one.
"""

from __future__ import annotations

from graphsan.core.records import Finding
from graphsan.report.json_report import Report
from graphsan.report.text import format_finding


def finding_signature(f: Finding) -> tuple:
    free = tuple(f.free_stack[-1]) if f.free_stack else None
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

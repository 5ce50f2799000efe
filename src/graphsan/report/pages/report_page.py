"""The HTML report: reports (one per rank) -> a view model -> `report.html.j2`.

The view model is plain dicts and lists; the template only lays them out. Geometry of the SVG
timelines is computed here, so the template holds no arithmetic. This module assembles the page
and its tables (the reports read, their graphs, findings by rank); identical findings share a
row (report_fold); each finding's block is report_finding's (its life: report_life), the process
timeline report_overview's. Thousands of distinct rows are grouped by kind and graph, and only
the first rows get blocks (DETAILED, LISTED).
"""

from __future__ import annotations

import math
import os
from typing import Any

from graphsan.core.records import frame_text
from graphsan.report.json_report import SCHEMA_VERSION, Report
from graphsan.report.pages.report_common import clock, rel
from graphsan.report.pages.report_finding import finding_view, graph_nodes, nodes_anchor, row_view
from graphsan.report.pages.report_fold import (
    FREE_SITES_SHOWN,
    Fold,
    fold_findings,
    fold_view,
    group_key,
)
from graphsan.report.pages.report_overview import overview
from graphsan.report.pages.templating import render, replay_index
from graphsan.report.text import attachment_line, provenance_line

# a page of thousands of distinct findings stays one that opens in seconds: every row is
# counted, up to LISTED rows are listed in the findings table, up to DETAILED get a block of
# their own (the first of each kind and graph first), and beyond DETAILED rows the table opens
# with one row per kind and graph
DETAILED = 50
LISTED = 5_000
SPANS_SHOWN = 8  # runs of node numbers a group's row names


def render_report(reports: list[Report], names: list[str]) -> str:
    return render("report.html.j2", **report_view(reports, names))


def report_view(reports: list[Report], names: list[str]) -> dict[str, Any]:
    """Everything the template shows, computed once."""
    sources = [_source(r, n, i) for i, (r, n) in enumerate(zip(reports, names, strict=True))]
    t0 = _earliest(reports)
    folds = fold_findings(sources)
    detailed = _detailed(folds)
    findings = []
    for n, fold in enumerate(folds, 1):
        if n - 1 in detailed:
            view = finding_view(n, fold.finding, fold.source, fold.seen, t0)
        else:
            view = row_view(n, fold.finding, fold.seen)
        view |= fold_view(fold, t0) | {"detailed": n - 1 in detailed, "listed": n <= LISTED}
        if not view["listed"]:
            view["anchor"] = None  # nothing on the page to link to
        findings.append(view)
    listed = findings[:LISTED]
    kinds = sorted({f["kind"] for f in findings})
    total = sum(len(r.findings) for r in reports)
    idle = [_watch_view(s) for s in sources if s["report"].watched is False]
    return {
        "title": _title(sources, findings, len(idle)),
        "idle": idle,
        "all_idle": len(idle) == len(sources),
        "stopped": [
            _watch_view(s) for s in sources if s["report"].watched and s["report"].disabled_reason
        ],
        # pages say a report is old only when it is (times came with schema v3)
        "before_v3": all(r.loaded_version is not None and r.loaded_version < 3 for r in reports),
        "sources": [_source_view(s, t0, findings) for s in sources],
        "findings": findings,
        "listed": listed,
        "details": [f for f in findings if f["detailed"]],
        "groups": _groups(findings) if len(findings) > DETAILED else [],
        "kinds": kinds,
        "total_findings": total,
        "folded": total > len(findings),
        "graphs_total": sum(len(r.graphs) for r in reports),
        "multi": len(reports) > 1,
        "matrix": _rank_matrix(sources, listed),
        "overview": overview(sources, findings, t0),
        "t0": clock(t0) if t0 is not None else None,
        "has_times": t0 is not None,
    }


def _detailed(folds: list[Fold]) -> set[int]:
    """The rows whose findings get a block of their own (by index): all of them up to
    DETAILED; beyond, the first row of each kind and graph, then the first rows, DETAILED in
    all (a page of thousands of blocks would take minutes to open)."""
    if len(folds) <= DETAILED:
        return set(range(len(folds)))
    chosen: dict[int, None] = {}
    firsts: dict[tuple, int] = {}
    for i, fold in enumerate(folds):
        firsts.setdefault(group_key(fold.finding), i)
    for i in [*firsts.values(), *range(len(folds))]:
        if len(chosen) == DETAILED:
            break
        chosen.setdefault(i)
    return set(chosen)


def _groups(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows gathered by kind and graph: how many rows and findings each group holds, the
    nodes and free places they name, and where its first row is."""
    groups: dict[tuple, dict[str, Any]] = {}
    for f in findings:
        key = (f["kind"], f["graph_id"], f["label"])
        g = groups.get(key)
        if g is None:
            g = groups[key] = {
                "kind": f["kind"],
                "graph_id": f["graph_id"],
                "label": f["label"],
                "first": f,
                "rows": 0,
                "count": 0,
                "nodes": set(),
                "free_sites": {},
            }
        g["rows"] += 1
        g["count"] += f["count"]
        g["nodes"].add(f["node"])
        g["free_sites"].setdefault(f["free_site"])
    out = []
    for g in groups.values():
        nodes, sites = sorted(g.pop("nodes")), list(g.pop("free_sites"))
        g["nodes_text"] = _spans(nodes)
        g["free_sites"] = sites[:FREE_SITES_SHOWN]
        g["more_sites"] = max(len(sites) - FREE_SITES_SHOWN, 0)
        g["rows_text"], g["count_text"] = f"{g['rows']:,}", f"{g['count']:,}"
        out.append(g)
    return out


def _spans(numbers: list[int]) -> str:
    """Sorted numbers as runs: "0-3, 7, 9-12" (the first SPANS_SHOWN runs, then how many more)."""
    runs: list[list[int]] = []
    for x in numbers:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    texts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    more = f" and {len(texts) - SPANS_SHOWN} more" if len(texts) > SPANS_SHOWN else ""
    return ", ".join(texts[:SPANS_SHOWN]) + more


def _title(sources, findings, idle: int) -> str:
    who = f"{len(sources)} ranks" if len(sources) > 1 else sources[0]["name"]
    if idle == len(sources):
        return f"graphsan: not watched, {who}"
    return f"graphsan: {sum(f['count'] for f in findings)} finding(s), {who}"


def _watch_view(src: dict[str, Any]) -> dict[str, Any]:
    """A report in which graphsan was idle or disabled itself: its name and why."""
    return {"name": src["name"], "reason": src["report"].disabled_reason or "no reason recorded"}


def _source(report: Report, path: str, index: int) -> dict[str, Any]:
    name = f"rank {report.rank}" if report.rank is not None else os.path.basename(path)
    graphs = {g.get("id"): g for g in report.graphs}
    by_kind: dict[str, list[dict[str, Any]]] = {"phase": [], "release": []}
    for e in report.events:
        if e.get("kind") in by_kind:
            by_kind[e["kind"]].append(e)
    return {
        "report": report,
        "name": name,
        "path": path,
        "index": index,
        "graphs": graphs,
        "phases": by_kind["phase"],
        "releases": by_kind["release"],
        "replays": replay_index(report.events),
    }


def _node_lists(src: dict[str, Any], findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The listed nodes of each graph of `src` that a finding's block names, once per graph."""
    named = {
        f["graph_id"]
        for f in findings
        if f["detailed"] and f["nodes"].get("all_anchor") == nodes_anchor(src, f["graph_id"])
    }
    out = []
    for gid in sorted(named):
        g = src["graphs"].get(gid) or {}
        out.append(
            {
                "anchor": nodes_anchor(src, gid),
                "graph_id": gid,
                "label": g.get("label", ""),
                "rows": graph_nodes(src, gid),
                "total": g["node_summary"].get("total", 0),
            }
        )
    return out


def _source_view(
    src: dict[str, Any], t0: float | None, findings: list[dict[str, Any]]
) -> dict[str, Any]:
    r: Report = src["report"]
    graphs = []
    for g in r.graphs:
        site = g.get("capture_site") or []
        graphs.append(
            {
                "id": g.get("id"),
                "label": g.get("label", ""),
                "nodes": g.get("nodes", 0),
                "kernels": g.get("kernels", 0),
                "references": g.get("references", 0),
                "watched": g.get("watched_blocks", 0),
                "replays_judged": g.get("replays_judged", 0),
                "captured": rel(g.get("captured_at"), t0),
                "site": frame_text(site[-1]) if site else "",
                "analysis_ms": g.get("analysis_ms"),
            }
        )
    return {
        "name": src["name"],
        "path": src["path"],
        "policy": r.policy,
        "findings": len(r.findings),
        "graphs": graphs,
        "events": len(r.events),
        "dropped": r.events_dropped,
        "pinned": r.pinned,
        "made": provenance_line(r.provenance, r.loaded_version, SCHEMA_VERSION),
        "attached": attachment_line(
            r.provenance, r.allocator_log, r.loaded_version, SCHEMA_VERSION
        ),
        "node_lists": _node_lists(src, findings),
    }


# ----------------------------------------------------------------------------- many ranks
def _rank_matrix(sources, findings) -> dict[str, Any]:
    cols = [s["name"] for s in sources]
    rows = []
    for f in findings:
        rows.append(
            {
                "n": f["n"],
                "anchor": f["anchor"],
                "kind": f["kind"],
                "what": f"graph '{f['label']}' node {f['node']} {f['kernel_short']}",
                "cells": [f["kind"] if c in f["ranks"] else "" for c in cols],
            }
        )
    clean = [s["name"] for s in sources if not s["report"].findings]
    return {"cols": cols, "rows": rows, "clean": clean}


def _earliest(reports: list[Report]) -> float | None:
    times = []
    for r in reports:
        times += [e["t"] for e in r.events if isinstance(e.get("t"), (int, float))]
        times += [e["begin"] for e in r.events if isinstance(e.get("begin"), (int, float))]
        times += [g["captured_at"] for g in r.graphs if g.get("captured_at") is not None]
        for f in r.findings:
            times += [t for t in (f.freed_at, f.found_at) if t is not None]
    times = [t for t in times if math.isfinite(t)]  # a time that is not a number is not drawn
    return min(times) if times else None

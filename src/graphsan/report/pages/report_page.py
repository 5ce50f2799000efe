"""The HTML report: reports (one per rank) -> a view model -> `report.html.j2`.

The view model is plain dicts and lists; the template only lays them out. Geometry of the SVG
timelines is computed here, so the template holds no arithmetic.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from graphsan.core.records import FREED_BEFORE_CAPTURE, Finding, OtherUse, frame_text
from graphsan.report.json_report import Report
from graphsan.report.pages.templating import nice_ticks, render, replay_index
from graphsan.report.ranks import finding_signature
from graphsan.report.text import NO_FREE_FRAMES, no_free_stack, short_kernel, when

NODE_WINDOW = 6  # nodes shown either side of the offending one (the rest fold away)
SVG_WIDTH = 960


def render_report(reports: list[Report], names: list[str]) -> str:
    return render("report.html.j2", **report_view(reports, names))


def report_view(reports: list[Report], names: list[str]) -> dict[str, Any]:
    """Everything the template shows, computed once."""
    sources = [_source(r, n, i) for i, (r, n) in enumerate(zip(reports, names, strict=True))]
    t0 = _earliest(reports)
    groups: dict[tuple, dict[str, Any]] = {}
    for src in sources:
        for f in src["report"].findings:
            sig = finding_signature(f)
            g = groups.get(sig)
            if g is None:
                g = groups[sig] = {"finding": f, "source": src, "seen": {}}
            g["seen"].setdefault(src["name"], f)
    findings = [
        _finding_view(n, g["finding"], g["source"], g["seen"], t0)
        for n, g in enumerate(groups.values(), 1)
    ]
    kinds = sorted({f["kind"] for f in findings})
    total = sum(len(r.findings) for r in reports)
    return {
        "title": _title(sources, findings),
        "sources": [_source_view(s, t0) for s in sources],
        "findings": findings,
        "kinds": kinds,
        "total_findings": total,
        "graphs_total": sum(len(r.graphs) for r in reports),
        "multi": len(reports) > 1,
        "matrix": _rank_matrix(sources, findings),
        "overview": _overview(sources, findings, t0),
        "t0": _clock(t0) if t0 is not None else None,
        "has_times": t0 is not None,
    }


def _title(sources, findings) -> str:
    who = f"{len(sources)} ranks" if len(sources) > 1 else sources[0]["name"]
    return f"graphsan: {len(findings)} finding(s), {who}"


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


def _source_view(src: dict[str, Any], t0: float | None) -> dict[str, Any]:
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
                "captured": _rel(g.get("captured_at"), t0),
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
    }


# ----------------------------------------------------------------------------- one finding
def _finding_view(n: int, f: Finding, src, seen: dict[str, Finding], t0) -> dict[str, Any]:
    free_site = frame_text(f.free_stack[-1]) if f.free_stack else no_free_stack(f)
    head, params, tail = kernel_signature(f.kernel)
    return {
        "n": n,
        "anchor": f"finding-{n}",
        "kind": f.kind,
        "graph_id": f.graph.id,
        "label": f.graph.label,
        "capture_site": frame_text(f.graph.capture_site[-1]) if f.graph.capture_site else "",
        "node": f.node,
        "kernel": f.kernel,
        "kernel_short": short_kernel(f.kernel),
        "signature": {"head": head, "params": params, "tail": tail},
        "param": f.param,
        "offset": f.offset,
        "address": f"{f.address:#x}",
        "block": f"{f.block_address:#x}",
        "nbytes": f.nbytes,
        "size": human_bytes(f.nbytes),
        "pool": f.pool,
        "other_nodes": f.other_nodes,
        "now": f.now,
        "cause": f.likely_cause,
        "phase": f.phase,
        "step": f.step,
        "when": when(f.phase, f.step).strip(" ()"),
        "free_op": f.free_op,
        "free_site": free_site,
        "alloc_site": frame_text(f.alloc_stack[-1]) if f.alloc_stack else "not recorded",
        "alloc_stack": [frame_text(x) for x in f.alloc_stack],
        "free_stack": [frame_text(x) for x in f.free_stack],
        "capture_stack": [frame_text(x) for x in f.graph.capture_site],
        "also": [_also_view(u, src, t0) for u in f.also_used_by],
        "ranks": list(seen),
        "nodes": _nodes_view(f, src["graphs"].get(f.graph.id)),
        "life": _life(f, src, t0),
    }


def _also_view(u: OtherUse, src, t0) -> dict[str, Any]:
    g = src["graphs"].get(u.graph, {})
    return {
        "graph": u.graph,
        "label": u.label,
        "node": u.node,
        "kernel": u.kernel,
        "kernel_short": short_kernel(u.kernel),
        "param": u.param,
        "offset": u.offset,
        "captured": _rel(g.get("captured_at"), t0),
    }


def _nodes_view(f: Finding, stats: dict[str, Any] | None) -> dict[str, Any]:
    """The graph's nodes around the offending one, from the report's node summary (graphs
    captured before report schema v3 have none: only the referencing node is known)."""
    summary = (stats or {}).get("node_summary")
    if not summary or not summary.get("nodes"):
        row = {"index": f.node, "short": short_kernel(f.kernel), "full": f.kernel, "hit": True}
        return {"known": False, "window": [row], "all": [], "total": None, "shown": 0}
    names = summary.get("names", [])
    rows = []
    for i, k in enumerate(summary["nodes"]):
        full = names[k] if 0 <= k < len(names) else "?"
        rows.append({"index": i, "short": short_kernel(full), "full": full, "hit": i == f.node})
    total = summary.get("total", len(rows))
    if f.node < len(rows):
        lo, hi = max(f.node - NODE_WINDOW, 0), min(f.node + NODE_WINDOW + 1, len(rows))
        window = rows[lo:hi]
    else:  # beyond the summary's bound: show the node on its own after the first ones
        window = [
            *rows[: NODE_WINDOW * 2],
            {"index": f.node, "short": short_kernel(f.kernel), "full": f.kernel, "hit": True},
        ]
    return {
        "known": True,
        "window": window,
        "all": rows,
        "total": total,
        "shown": len(rows),
        "before": window[0]["index"] if window else 0,
        "after": max(total - 1 - window[-1]["index"], 0) if window else 0,
    }


def kernel_signature(name: str) -> tuple[str, list[str], str]:
    """Split a demangled kernel name into (what comes before its parameter list, the
    parameters, what follows), so a page can mark one parameter; ("name", [], "") when the
    name has no parameter list (Triton kernels, memcpy)."""
    depth, open_at = 0, -1
    for i, ch in enumerate(name):
        if ch in "<([":
            if ch == "(" and depth == 0:
                open_at = i
            depth += 1
        elif ch in ">)]":
            depth = max(depth - 1, 0)
            if ch == ")" and depth == 0 and open_at >= 0 and i == len(name.rstrip()) - 1:
                inner = name[open_at + 1 : i]
                return name[: open_at + 1], _split_params(inner), name[i:]
    return name, [], ""


def _split_params(inner: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in inner:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth = max(depth - 1, 0)
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    last = "".join(cur).strip()
    if last:
        out.append(last)
    return out


def _life(f: Finding, src: dict[str, Any], t0: float | None) -> dict[str, Any]:
    """The block's life, in order: allocation, each capture that references it, the free, what
    became of the memory, the replay that was judged; with an SVG strip when times exist."""
    report, graphs = src["report"], src["graphs"]
    stopped = report.policy in ("raise", "pin")
    own = graphs.get(f.graph.id, {})
    steps: list[dict[str, Any]] = [
        {
            "kind": "alloc",
            "t": None,
            "what": "allocated",
            "detail": f"{human_bytes(f.nbytes)} in the {f.pool}",
            "site": frame_text(f.alloc_stack[-1]) if f.alloc_stack else "",
        },
        {
            "kind": "capture",
            "t": own.get("captured_at"),
            "what": f"captured by graph #{f.graph.id} '{f.graph.label}'",
            "detail": f"node {f.node} ({short_kernel(f.kernel)}) param {f.param}+{f.offset}",
            "site": frame_text(f.graph.capture_site[-1]) if f.graph.capture_site else "",
        },
    ]
    for u in f.also_used_by:
        steps.append(
            {
                "kind": "capture",
                "t": graphs.get(u.graph, {}).get("captured_at"),
                "what": f"captured by graph #{u.graph} '{u.label}'",
                "detail": f"node {u.node} ({short_kernel(u.kernel)}) param {u.param}+{u.offset}",
                "site": "",
            }
        )
    if f.kind in ("replay-order", "live-output"):
        free_what, free_site = "", ""  # nothing was freed: a graph overwrites the range
    elif f.free_op == FREED_BEFORE_CAPTURE and not f.free_stack:
        free_what, free_site = "already free when the capture ended", ""
    else:
        free_what = "freed" + (f" by {f.free_op}" if f.free_op else "")
        free_what += (f" in phase {f.phase}" if f.phase else "") + (
            f", step {f.step}" if f.step is not None else ""
        )
        free_site = frame_text(f.free_stack[-1]) if f.free_stack else NO_FREE_FRAMES
    if free_what:
        steps.append(
            {"kind": "free", "t": f.freed_at, "what": free_what, "detail": "", "site": free_site}
        )
    if f.kind == "unmapped" and f.freed_at is not None and f.found_at is not None:
        for ev in src["releases"]:
            if f.freed_at <= ev.get("t", 0) <= f.found_at:
                steps.append(
                    {
                        "kind": "release",
                        "t": ev["t"],
                        "what": "empty_cache() released cached memory to the driver",
                        "detail": when(ev.get("phase"), ev.get("step")).strip(" ()"),
                        "site": ev.get("site", ""),
                    }
                )
    if f.now:
        steps.append({"kind": "now", "t": f.found_at, "what": _now_title(f), "detail": f.now})
    replay = (
        f"replay of graph #{f.graph.id} stopped before launch"
        if stopped
        else f"replay of graph #{f.graph.id} judged: finding recorded, the replay went on "
        f"(policy {report.policy})"
    )
    steps.append({"kind": "stop" if stopped else "judged", "t": f.found_at, "what": replay})
    timed = [s for s in steps if s["t"] is not None]
    timed.sort(key=lambda s: s["t"])
    untimed = [s for s in steps if s["t"] is None]
    ordered = [s for s in untimed if s["kind"] == "alloc"] + timed
    ordered += [s for s in untimed if s["kind"] != "alloc"]
    for i, s in enumerate(ordered, 1):
        s["n"] = i
        s["rel"] = _rel(s["t"], t0)
        s["clock"] = _clock(s["t"]) if s["t"] is not None else ""
        s.setdefault("detail", "")
        s.setdefault("site", "")
    return {"steps": ordered, "svg": _life_svg(ordered, src["phases"], t0) if timed else None}


def _now_title(f: Finding) -> str:
    return {
        "reowned": "re-owned by another tensor",
        "pool-reuse": "re-carved by a later capture",
        "unmapped": "unmapped: given back to the driver",
        "moved": "the tensor's storage moved",
        "freed": "free in the allocator's cache",
        "replay-order": "overwritten by a graph captured later into the same pool",
        "live-output": "another graph's output the caller still holds",
    }.get(f.kind, "now")


MARK = {"capture": "#2f6fb0", "free": "#c0392b", "release": "#8e44ad", "now": "#d35400"}
MARK |= {"stop": "#b00020", "judged": "#b7791f", "alloc": "#555"}


def _life_svg(steps: list[dict[str, Any]], phases: list[dict[str, Any]], t0) -> dict[str, Any]:
    """Marker positions for the block's life strip: x by time, untimed steps at the left edge,
    markers of nearly equal time stacked so their numbers stay readable."""
    times = [s["t"] for s in steps if s["t"] is not None]
    lo, hi = min(times), max(times)
    span = max(hi - lo, 1e-3)
    left, right = 70.0, SVG_WIDTH - 20.0

    def x_of(t: float) -> float:
        return left + (t - lo) / span * (right - left)

    marks, lanes_at = [], {}
    for s in steps:
        x = 30.0 if s["t"] is None else x_of(s["t"])
        key = round(x / 18)
        lane = lanes_at.get(key, 0)
        lanes_at[key] = lane + 1
        marks.append(
            {
                "x": round(x, 1),
                "y": 24 + 16 * lane,
                "n": s["n"],
                "color": MARK.get(s["kind"], "#333"),
                "title": f"{s['n']}. {s['what']} {s['rel']}".strip(),
            }
        )
    height = max(m["y"] for m in marks) + 30
    bands = []
    for i, e in enumerate(phases):
        start = max(e["t"], lo)
        end = min(phases[i + 1]["t"], hi) if i + 1 < len(phases) else hi
        if end <= start or start > hi:
            continue
        bands.append(
            {
                "x": round(x_of(start), 1),
                "w": round(max(x_of(end) - x_of(start), 1.0), 1),
                "label": e.get("phase") or "",
                "cls": _phase_class(e.get("phase") or ""),
            }
        )
    ticks = [
        {"x": round(x_of(t), 1), "label": f"+{t - t0:.4g} s"} for t in nice_ticks(lo, lo + span)
    ]
    return {
        "width": SVG_WIDTH,
        "height": height,
        "axis_y": height - 18,
        "left": left,
        "right": right,
        "marks": marks,
        "bands": bands,
        "ticks": ticks,
    }


def _phase_class(phase: str) -> str:
    if phase.startswith("eval") or "valid" in phase:
        return "eval"
    if phase.startswith("train"):
        return "train"
    return "other"


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


def _overview(sources, findings, t0: float | None) -> dict[str, Any] | None:
    """The process timeline of every rank: one band of lanes per rank (phase, allocator, one
    lane per stream), markers for captures, judged replays, frees, releases and findings."""
    if t0 is None:
        return None
    times = [t0]
    for s in sources:
        r: Report = s["report"]
        times += [e["t"] for e in r.events if "t" in e]
        times += [e["t_last"] for e in r.events if "t_last" in e]
        times += [f.found_at for f in r.findings if f.found_at is not None]
        times += [g.get("captured_at") for g in r.graphs if g.get("captured_at") is not None]
    hi = max(times)
    span = max(hi - t0, 1e-3)
    left, right = 190.0, SVG_WIDTH - 20.0

    def x_of(t: float) -> float:
        return round(left + (t - t0) / span * (right - left), 1)

    views = {(rank, v["graph_id"], v["block"]): v for v in findings for rank in v["ranks"]}
    lanes, marks, bands, y = [], [], [], 10.0
    lane_h = 22.0
    for s in sources:
        r = s["report"]
        streams = sorted({e["stream"] for e in r.events if "stream" in e})
        names = ["phase", "allocator"] + [f"stream {st:#x}" for st in streams]
        if not [e for e in r.events if e.get("kind") != "phase"] and not r.findings:
            names = ["phase", "allocator"]
        lane_y = {}
        for ln in names:
            lanes.append({"y": y, "label": f"{s['name']}: {ln}", "h": lane_h})
            lane_y[ln] = y + lane_h / 2
            y += lane_h
        y += 8
        phases = s["phases"]
        for i, e in enumerate(phases):
            end = phases[i + 1]["t"] if i + 1 < len(phases) else hi
            bands.append(
                {
                    "x": x_of(e["t"]),
                    "y": lane_y["phase"] - lane_h / 2 + 2,
                    "w": max(x_of(end) - x_of(e["t"]), 1.0),
                    "h": lane_h - 4,
                    "label": e.get("phase") or "",
                    "cls": _phase_class(e.get("phase") or ""),
                }
            )
        for e in r.events:
            kind = e.get("kind")
            if kind == "phase":
                continue
            lane = f"stream {e['stream']:#x}" if "stream" in e else "allocator"
            if lane not in lane_y:
                lane = "allocator"
            marks.append(
                {
                    "x": x_of(e["t"]),
                    "y": lane_y[lane],
                    "shape": kind,
                    "cls": f"ev-{kind}" + (f" out-{e.get('outcome')}" if kind == "replay" else ""),
                    "title": _event_title(e, t0),
                    "href": None,
                }
            )
        for f in r.findings:
            if f.found_at is None:
                continue
            fv = views.get((s["name"], f.graph.id, f"{f.block_address:#x}"))
            replay = s["replays"].get((f.graph.id, f.found_at))
            lane = f"stream {replay['stream']:#x}" if replay and "stream" in replay else None
            if lane not in lane_y:  # no replay recorded for it: the first stream's lane
                lane = names[2] if len(names) > 2 else "allocator"
            marks.append(
                {
                    "x": x_of(f.found_at),
                    "y": lane_y[lane] - 9,
                    "shape": "finding",
                    "cls": "ev-finding",
                    "title": f"finding {fv['n'] if fv else ''}: {f.kind} graph #{f.graph.id} "
                    f"node {f.node} {short_kernel(f.kernel)} {_rel(f.found_at, t0)}",
                    "href": f"#{fv['anchor']}" if fv else None,
                }
            )
    ticks = [{"x": x_of(t), "label": f"+{t - t0:.4g} s"} for t in nice_ticks(t0, t0 + span, 6)]
    return {
        "width": SVG_WIDTH,
        "height": y + 24,
        "axis_y": y + 4,
        "left": left,
        "right": right,
        "lanes": lanes,
        "marks": marks,
        "bands": bands,
        "ticks": ticks,
    }


def _event_title(e: dict[str, Any], t0: float) -> str:
    kind, rel = e.get("kind"), _rel(e.get("t"), t0)
    if kind == "capture":
        return f"capture of graph #{e.get('graph')} '{e.get('label', '')}' {rel}"
    if kind == "replay":
        more = f" (x{e['count']})" if e.get("count") else ""
        return (
            f"judged replay of graph #{e.get('graph')} '{e.get('label', '')}': "
            f"{e.get('outcome')}{more} {rel}"
        )
    if kind == "free":
        op = f" by {e['op']}" if e.get("op") else ""
        return (
            f"free of watched block {e.get('block', 0):#x}{op}"
            f"{when(e.get('phase'), e.get('step'))} at {e.get('site') or '?'} {rel}"
        )
    if kind == "release":
        return f"empty_cache(){when(e.get('phase'), e.get('step'))} at {e.get('site') or '?'} {rel}"
    return f"{kind} {rel}"


# ----------------------------------------------------------------------------- small helpers
def _earliest(reports: list[Report]) -> float | None:
    times = []
    for r in reports:
        times += [e["t"] for e in r.events if isinstance(e.get("t"), (int, float))]
        times += [e["begin"] for e in r.events if isinstance(e.get("begin"), (int, float))]
        times += [g["captured_at"] for g in r.graphs if g.get("captured_at") is not None]
        for f in r.findings:
            times += [t for t in (f.freed_at, f.found_at) if t is not None]
    return min(times) if times else None


def _rel(t: float | None, t0: float | None) -> str:
    if t is None or t0 is None:
        return ""
    return f"+{t - t0:.3f} s"


def _clock(t: float) -> str:
    d = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    return d.strftime("%Y-%m-%d %H:%M:%S.") + f"{d.microsecond // 1000:03d} UTC"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit} ({n} B)"
        size /= 1024
    return f"{n} B"

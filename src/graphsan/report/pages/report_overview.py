"""The process timeline on the HTML report page: one band of lanes per rank (phase, allocator,
one lane per stream) with its captures, judged replays, frees, releases and findings."""

from __future__ import annotations

from typing import Any

from graphsan.report.json_report import Report
from graphsan.report.pages.report_common import SVG_WIDTH, phase_class, rel
from graphsan.report.pages.templating import nice_ticks
from graphsan.report.text import short_kernel, when


def overview(sources, findings, t0: float | None) -> dict[str, Any] | None:
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
                    "cls": phase_class(e.get("phase") or ""),
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
                    f"node {f.node} {short_kernel(f.kernel)} {rel(f.found_at, t0)}",
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
    kind, at = e.get("kind"), rel(e.get("t"), t0)
    if kind == "capture":
        return f"capture of graph #{e.get('graph')} '{e.get('label', '')}' {at}"
    if kind == "replay":
        more = f" (x{e['count']})" if e.get("count") else ""
        return (
            f"judged replay of graph #{e.get('graph')} '{e.get('label', '')}': "
            f"{e.get('outcome')}{more} {at}"
        )
    if kind == "free":
        op = f" by {e['op']}" if e.get("op") else ""
        return (
            f"free of watched block {e.get('block', 0):#x}{op}"
            f"{when(e.get('phase'), e.get('step'))} at {e.get('site') or '?'} {at}"
        )
    if kind == "release":
        return f"empty_cache(){when(e.get('phase'), e.get('step'))} at {e.get('site') or '?'} {at}"
    return f"{kind} {at}"

"""The process timeline on the HTML report page: one band of lanes per rank (phase, allocator,
one lane per stream) with its captures, judged replays, frees, releases and findings."""

from __future__ import annotations

import math
from typing import Any

from graphsan.report.json_report import Report
from graphsan.report.pages.report_common import RIGHT_MARGIN, SVG_WIDTH, phase_class, rel
from graphsan.report.pages.report_fold import fold_key
from graphsan.report.pages.templating import nice_ticks, tick_label
from graphsan.report.text import when

LANE_H = 22.0
HEAD_H = 20.0  # the row above a rank's lanes that names it
CHAR_W = 7.0  # an 11 px sans-serif digit is about this wide: lane labels are sized by it


def overview(sources, findings, t0: float | None) -> dict[str, Any] | None:
    """The process timeline of every rank: one band of lanes per rank (phase, allocator, one
    lane per stream) under the rank's name, markers for captures, judged replays, frees,
    releases and findings; marks that would overlap on one pixel are drawn once."""
    if t0 is None:
        return None
    span = max(_latest(sources, t0) - t0, 1e-3)
    plan = [(s, _lane_names(s)) for s in sources]
    longest = max(len(name) for _, names in plan for name in names)
    left = float(min(max(round(longest * CHAR_W) + 16, 100), 300))
    right = SVG_WIDTH - RIGHT_MARGIN

    def x_of(t: float) -> float:
        return round(left + (t - t0) / span * (right - left), 1)

    views = {v["fold_key"]: v for v in findings}
    heads, lanes, bands, marks, y = [], [], [], Marks(), 6.0
    for s, names in plan:
        heads.append({"y": y + 14, "label": s["name"]})
        y += HEAD_H
        lane_y = {}
        for name in names:
            lanes.append({"y": y, "label": name, "h": LANE_H})
            lane_y[name] = y + LANE_H / 2
            y += LANE_H
        y += 8
        bands += _bands(s["phases"], lane_y["phase"], t0 + span, x_of)
        _event_marks(marks, s["report"], lane_y, x_of, t0)
        _finding_marks(marks, s, views, names, lane_y, x_of, t0)
    ticks = [{"x": x_of(t0 + v), "label": f"+{tick_label(v)} s"} for v in nice_ticks(0.0, span)]
    return {
        "width": SVG_WIDTH,
        "height": y + 24,
        "axis_y": y + 4,
        "left": left,
        "right": right,
        "heads": heads,
        "lanes": lanes,
        "marks": marks.drawn(),
        "bands": bands,
        "ticks": ticks,
    }


class Marks:
    """The timeline's marks, one per (pixel, lane, kind of mark): a later mark on the same spot
    only counts, so a long run's thousands of replays and findings stay a bounded page."""

    def __init__(self) -> None:
        self._at: dict[tuple, dict[str, Any]] = {}

    def add(self, x: float, y: float, shape: str, cls: str, title, href=None) -> None:
        """Draw a mark at (x, y) unless one of `cls` is there; `title` is called only when it
        is drawn (titles of hidden marks are never built)."""
        if not math.isfinite(x):  # a time that is not a number has no place on the axis
            return
        key = (round(x), y, cls)
        mark = self._at.get(key)
        if mark is not None:
            mark["more"] += 1
            return
        self._at[key] = {"x": x, "y": y, "shape": shape, "cls": cls, "title": title()}
        self._at[key] |= {"href": href, "more": 0}

    def drawn(self) -> list[dict[str, Any]]:
        out = []
        for m in self._at.values():
            if m["more"]:
                m["title"] += f" (and {m['more']:,} more at this point)"
            out.append(m)
        return out


def _latest(sources, t0: float) -> float:
    times = [t0]
    for s in sources:
        r: Report = s["report"]
        times += [e["t"] for e in r.events if "t" in e]
        times += [e["t_last"] for e in r.events if "t_last" in e]
        times += [f.found_at for f in r.findings if f.found_at is not None]
        times += [g.get("captured_at") for g in r.graphs if g.get("captured_at") is not None]
    return max(t for t in times if math.isfinite(t))


def _lane_names(s) -> list[str]:
    r: Report = s["report"]
    if not [e for e in r.events if e.get("kind") != "phase"] and not r.findings:
        return ["phase", "allocator"]
    streams = sorted({e["stream"] for e in r.events if "stream" in e})
    return ["phase", "allocator"] + [f"stream {st:#x}" for st in streams]


def _bands(phases, mid: float, hi: float, x_of) -> list[dict[str, Any]]:
    out = []
    for i, e in enumerate(phases):
        end = phases[i + 1]["t"] if i + 1 < len(phases) else hi
        out.append(
            {
                "x": x_of(e["t"]),
                "y": mid - LANE_H / 2 + 2,
                "w": max(x_of(end) - x_of(e["t"]), 1.0),
                "h": LANE_H - 4,
                "label": e.get("phase") or "",
                "cls": phase_class(e.get("phase") or ""),
            }
        )
    return out


def _event_marks(marks: Marks, r: Report, lane_y, x_of, t0: float) -> None:
    for e in r.events:
        kind = e.get("kind")
        if kind == "phase":
            continue
        lane = f"stream {e['stream']:#x}" if "stream" in e else "allocator"
        if lane not in lane_y:
            lane = "allocator"
        cls = f"ev-{kind}" + (f" out-{e.get('outcome')}" if kind == "replay" else "")
        marks.add(x_of(e["t"]), lane_y[lane], kind, cls, lambda e=e: _event_title(e, t0))


def _finding_marks(marks: Marks, s, views, names, lane_y, x_of, t0: float) -> None:
    for f in s["report"].findings:
        if f.found_at is None:
            continue
        fv = views.get(fold_key(f))
        replay = s["replays"].get((f.graph.id, f.found_at))
        lane = f"stream {replay['stream']:#x}" if replay and "stream" in replay else None
        if lane not in lane_y:  # no replay recorded for it: the first stream's lane
            lane = names[2] if len(names) > 2 else "allocator"

        def title(f=f, fv=fv) -> str:
            if f.baked is not None:
                where = ", ".join(f.baked.modules) if f.baked.modules else f.baked.entry
            else:
                where = f"node {f.node} {fv['kernel_short'] if fv else f.kernel}"
            return (
                f"finding {fv['n'] if fv else ''}: {f.kind} graph #{f.graph.id} "
                f"{where} {rel(f.found_at, t0)}"
            )

        href = f"#{fv['anchor']}" if fv and fv["anchor"] else None
        marks.add(x_of(f.found_at), lane_y[lane] - 9, "finding", "ev-finding", title, href)


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

"""A finding's block history on the HTML report page: allocation, the captures that reference
it, the free, what became of the memory and the judged replay, in order, with an SVG strip when
the report has times."""

from __future__ import annotations

import math
from typing import Any

from graphsan.core.records import FREED_BEFORE_CAPTURE, Finding, frame_text
from graphsan.report.pages.report_common import (
    RIGHT_MARGIN,
    SVG_WIDTH,
    clock,
    human_bytes,
    phase_class,
    rel,
)
from graphsan.report.pages.templating import nice_ticks, tick_label
from graphsan.report.text import NO_FREE_FRAMES, short_kernel, when


def life(f: Finding, src: dict[str, Any], t0: float | None) -> dict[str, Any]:
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
    if f.order is not None:
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
    for s in steps:  # a time that is not a number counts as no time
        if s["t"] is not None and not math.isfinite(s["t"]):
            s["t"] = None
    timed = [s for s in steps if s["t"] is not None]
    timed.sort(key=lambda s: s["t"])
    untimed = [s for s in steps if s["t"] is None]
    ordered = [s for s in untimed if s["kind"] == "alloc"] + timed
    ordered += [s for s in untimed if s["kind"] != "alloc"]
    for i, s in enumerate(ordered, 1):
        s["n"] = i
        s["rel"] = rel(s["t"], t0)
        s["clock"] = clock(s["t"]) if s["t"] is not None else ""
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
        "replay-race": "touched by another graph's replay on another stream",
        "live-output": "another graph's output the caller still holds"
        if f.order is not None and f.order.written_by is not None
        else "a tensor eager code allocated into the graph's pool",
    }.get(f.kind, "now")


MARK = {"capture": "#2f6fb0", "free": "#c0392b", "release": "#8e44ad", "now": "#d35400"}
MARK |= {"stop": "#b00020", "judged": "#b7791f", "alloc": "#555"}


def _life_svg(steps: list[dict[str, Any]], phases: list[dict[str, Any]], t0) -> dict[str, Any]:
    """Marker positions for the block's life strip: x by time, untimed steps at the left edge,
    markers of nearly equal time stacked so their numbers stay readable."""
    times = [s["t"] for s in steps if s["t"] is not None]
    lo, hi = min(times), max(times)
    span = max(hi - lo, 1e-3)
    left, right = 70.0, SVG_WIDTH - RIGHT_MARGIN

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
                "cls": phase_class(e.get("phase") or ""),
            }
        )
    # round times on the page's clock (seconds after t0), the times the table below prints
    ticks = [
        {"x": round(x_of(t0 + v), 1), "label": f"+{tick_label(v)} s"}
        for v in nice_ticks(lo - t0, lo + span - t0)
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

"""Reports -> the Chrome trace event format (JSON), for Perfetto and chrome://tracing.

One process (pid) per rank, and in it one track (tid) for the phase, one for the allocator
(frees of watched memory, empty_cache) and one per CUDA stream (captures, judged replays and the
findings they raised). Timestamps are microseconds after the earliest event of all reports, so
the ranks of one host line up.
"""

from __future__ import annotations

import os
from typing import Any

from graphsan.core.records import Finding
from graphsan.report.json_report import Report
from graphsan.report.pages.templating import replay_index
from graphsan.report.text import short_kernel, where_stack

PHASE_TID, ALLOC_TID, UNKNOWN_STREAM_TID = 1, 2, 3
FIRST_STREAM_TID = 10


def chrome_trace(reports: list[Report], names: list[str]) -> dict[str, Any]:
    """{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}"""
    t0 = _earliest(reports)
    ranks = [r.rank for r in reports]
    by_rank = all(r is not None for r in ranks) and len(set(ranks)) == len(ranks)
    events: list[dict[str, Any]] = []
    skipped = 0
    for i, (report, path) in enumerate(zip(reports, names, strict=True)):
        pid = report.rank if by_rank else i
        pname = f"rank {report.rank}" if report.rank is not None else os.path.basename(path)
        events += _process(report, pid, pname, t0)
        skipped += sum(1 for f in report.findings if f.found_at is None)
    other = {"tool": "graphsan", "reports": list(names), "t0_epoch_s": t0}
    if skipped:
        other["findings_without_time"] = skipped
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _process(report: Report, pid: int, pname: str, t0: float | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        _meta(pid, 0, "process_name", {"name": f"graphsan {pname}"}),
        _meta(pid, 0, "process_sort_index", {"sort_index": pid}),
        _meta(pid, PHASE_TID, "thread_name", {"name": "phase"}),
        _meta(pid, ALLOC_TID, "thread_name", {"name": "allocator (watched frees, empty_cache)"}),
    ]
    streams = sorted({e["stream"] for e in report.events if "stream" in e})
    tid_of = {s: FIRST_STREAM_TID + k for k, s in enumerate(streams)}
    for s, tid in tid_of.items():
        out.append(_meta(pid, tid, "thread_name", {"name": f"stream {s:#x}"}))
    if t0 is None:
        return out
    if any(e.get("kind") in ("capture", "replay") and "stream" not in e for e in report.events):
        out.append(_meta(pid, UNKNOWN_STREAM_TID, "thread_name", {"name": "stream unknown"}))

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    def stream_tid(e: dict[str, Any]) -> int:
        return tid_of.get(e.get("stream"), UNKNOWN_STREAM_TID)

    last = max([e["t"] for e in report.events] + [t0])
    phases = [e for e in report.events if e.get("kind") == "phase"]
    for i, e in enumerate(phases):
        end = phases[i + 1]["t"] if i + 1 < len(phases) else last
        out.append(
            {
                "name": e.get("phase") or "?",
                "cat": "phase",
                "ph": "X",
                "ts": us(e["t"]),
                "dur": max(us(end) - us(e["t"]), 1.0),
                "pid": pid,
                "tid": PHASE_TID,
                "args": {"step": e.get("step")},
            }
        )
    for e in report.events:
        kind = e.get("kind")
        if kind == "capture":
            begin = e.get("begin", e["t"])
            out.append(
                {
                    "name": f"capture #{e.get('graph')} {e.get('label', '')}",
                    "cat": "capture",
                    "ph": "X",
                    "ts": us(begin),
                    "dur": max(us(e["t"]) - us(begin), 1.0),
                    "pid": pid,
                    "tid": stream_tid(e),
                    "args": _args(e, "graph", "label", "device"),
                }
            )
        elif kind == "replay":
            more = f" x{e['count']}" if e.get("count") else ""
            out.append(
                _instant(
                    f"replay #{e.get('graph')} {e.get('label', '')}: {e.get('outcome')}{more}",
                    "replay",
                    us(e["t"]),
                    pid,
                    stream_tid(e),
                    _args(e, "graph", "label", "device", "outcome", "findings", "count"),
                )
            )
        elif kind == "free":
            out.append(
                _instant(
                    f"free {e.get('block', 0):#x}" + (f" ({e['op']})" if e.get("op") else ""),
                    "free",
                    us(e["t"]),
                    pid,
                    ALLOC_TID,
                    _args(e, "phase", "step", "op", "site") | {"block": f"{e.get('block', 0):#x}"},
                )
            )
        elif kind == "release":
            out.append(
                _instant(
                    "empty_cache",
                    "release",
                    us(e["t"]),
                    pid,
                    ALLOC_TID,
                    _args(e, "phase", "step", "site"),
                )
            )
    replays = replay_index(report.events)
    for f in report.findings:
        if f.found_at is None:
            continue
        replay = replays.get((f.graph.id, f.found_at), {})
        out.append(
            _instant(
                f"{f.kind.upper()}: #{f.graph.id} {f.graph.label} node {f.node} "
                f"{short_kernel(f.kernel)}",
                "finding",
                us(f.found_at),
                pid,
                stream_tid(replay),
                _finding_args(f),
                scope="p",
            )
        )
    return out


def _finding_args(f: Finding) -> dict[str, Any]:
    stack = where_stack(f)
    site = f"{stack[-1][0]}:{stack[-1][1]} in {stack[-1][2]}" if stack else None
    return {
        "kind": f.kind,
        "graph": f.graph.id,
        "label": f.graph.label,
        "node": f.node,
        "kernel": f.kernel,
        "param": f.param,
        "offset": f.offset,
        "block": f"{f.block_address:#x}",
        "bytes": f.nbytes,
        "pool": f.pool,
        # baked state was not freed: where the program changed it
        ("changed at" if f.baked is not None else "freed at"): site,
        "phase": f.phase,
        "step": f.step,
        "now": f.now,
    }


def _args(e: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: e[k] for k in keys if e.get(k) is not None}


def _instant(name, cat, ts, pid, tid, args, scope="t") -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "i", "s": scope, "ts": ts, "pid": pid, "tid": tid} | {
        "args": args
    }


def _meta(pid: int, tid: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}


def _earliest(reports: list[Report]) -> float | None:
    times = []
    for r in reports:
        times += [e["t"] for e in r.events if isinstance(e.get("t"), (int, float))]
        times += [e["begin"] for e in r.events if isinstance(e.get("begin"), (int, float))]
        times += [f.found_at for f in r.findings if f.found_at is not None]
    return min(times) if times else None

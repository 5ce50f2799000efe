"""One finding's block on the HTML report page: what it names (graph, node, kernel and the
parameter marked in its signature, argument, tensor, stacks), the other graphs that use the
memory, the graph's nodes around the offending one, and the block's life (report_life)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from graphsan.core.kinds import Kind
from graphsan.core.records import BakedEvidence, Finding, OtherUse, frame_text
from graphsan.report.pages.report_common import human_bytes, rel
from graphsan.report.pages.report_life import life
from graphsan.report.text import BAKED_LABELS, no_free_stack, short_kernel, when, where_stack

NODE_WINDOW = 6  # nodes shown either side of the offending one (the rest fold away)
# a page names few kernels many times over: each name is shortened once
short_kernel = functools.lru_cache(maxsize=4096)(short_kernel)


def row_view(n: int, f: Finding, seen: dict[str, Finding]) -> dict[str, Any]:
    """What the findings table's row of `f` says (its block, `finding_view`, says more)."""
    return {
        "n": n,
        "anchor": f"finding-{n}",
        "kind": f.kind,
        "graph_id": f.graph.id,
        "label": f.graph.label,
        "node": f.node,
        "kernel": f.kernel,
        "kernel_short": short_kernel(f.kernel),
        "param": f.param,
        "offset": f.offset,
        "block": f"{f.block_address:#x}",
        "size": human_bytes(f.nbytes),
        # where the memory was freed, or the baked state changed (a group's rows list both)
        "free_site": frame_text(where[-1]) if (where := where_stack(f)) else no_free_stack(f),
        "ranks": list(seen),
        "baked": _baked_view(f, f.baked) if f.baked is not None else None,
    }


def finding_view(n: int, f: Finding, src, seen: dict[str, Finding], t0) -> dict[str, Any]:
    """Everything `f`'s block on the page shows: its row's fields and the rest."""
    head, params, tail = kernel_signature(f.kernel)
    return row_view(n, f, seen) | {
        "capture_site": frame_text(f.graph.capture_site[-1]) if f.graph.capture_site else "",
        "signature": {"head": head, "params": params, "tail": tail},
        "address": f"{f.address:#x}",
        "nbytes": f.nbytes,
        "pool": f.pool,
        "other_nodes": f.other_nodes,
        "now": f.now,
        "cause": f.likely_cause,
        "phase": f.phase,
        "step": f.step,
        "when": when(f.phase, f.step).strip(" ()"),
        "free_op": f.free_op,
        "alloc_site": frame_text(f.alloc_stack[-1]) if f.alloc_stack else "not recorded",
        "alloc_stack": [frame_text(x) for x in f.alloc_stack],
        "free_stack": [frame_text(x) for x in f.free_stack],
        "capture_stack": [frame_text(x) for x in f.graph.capture_site],
        "also": [_also_view(u, src, t0) for u in f.also_used_by],
        "nodes": _nodes_view(f, src),
        "life": life(f, src, t0) if f.baked is None else {"steps": [], "svg": None},
    }


def _baked_view(f: Finding, b: BakedEvidence) -> dict[str, Any]:
    """What a finding about state the graph baked at capture shows instead of a block's life:
    what it names, the value at capture and now, where the program changed it."""
    noun, verb = BAKED_LABELS[f.kind]
    named = ", ".join(b.modules) if f.kind is Kind.MODE else (b.entry or "")
    site = frame_text(b.changed_at[-1]) if b.changed_at else ""
    return {
        "noun": noun,
        "verb": verb,
        "named": named,
        "captured": b.captured or "",
        "current": b.current or "",
        "site": site,
        "changed_at": [frame_text(x) for x in b.changed_at],
        "where": f"{verb} at {site}"
        if site
        else f"{verb} before this replay, by a plain assignment no hook sees",
        "reads": f.kind is Kind.SUPERSEDED,
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
        "captured": rel(g.get("captured_at"), t0),
    }


def graph_nodes(src, gid: int) -> list[dict[str, Any]] | None:
    """The graph's listed nodes (index, short and full kernel name), from the report's node
    summary, made once per graph however many findings name it; None where the report has no
    summary for the graph (graphs captured before report schema v3)."""
    cache = src.setdefault("node_rows", {})
    if gid not in cache:
        summary = (src["graphs"].get(gid) or {}).get("node_summary")
        rows = None
        if summary and summary.get("nodes"):
            names = summary.get("names", [])
            shorts = [short_kernel(n) for n in names]
            rows = [
                {"index": i, "short": shorts[k], "full": names[k]}
                if 0 <= k < len(names)
                else {"index": i, "short": "?", "full": "?"}
                for i, k in enumerate(summary["nodes"])
            ]
        cache[gid] = rows
    return cache[gid]


def nodes_anchor(src, gid: int) -> str:
    """Where the page lists a graph's nodes (once per graph, under Graphs)."""
    return f"nodes-{src['index']}-{gid}"


def _nodes_view(f: Finding, src) -> dict[str, Any]:
    """The graph's nodes around the offending one (graphs captured before report schema v3
    have no node summary: only the referencing node is known); the graph's whole list is on
    the page once (`nodes_anchor`)."""
    own = {"index": f.node, "short": short_kernel(f.kernel), "full": f.kernel, "hit": True}
    rows = graph_nodes(src, f.graph.id)
    if rows is None:
        return {"known": False, "window": [own], "total": None, "shown": 0}
    total = (src["graphs"].get(f.graph.id) or {}).get("node_summary", {}).get("total", len(rows))
    if f.node < len(rows):
        lo, hi = max(f.node - NODE_WINDOW, 0), min(f.node + NODE_WINDOW + 1, len(rows))
        window = [r | {"hit": r["index"] == f.node} for r in rows[lo:hi]]
    else:  # beyond the summary's bound: show the node on its own after the first ones
        window = [*(r | {"hit": False} for r in rows[: NODE_WINDOW * 2]), own]
    return {
        "known": True,
        "window": window,
        # the link to the whole list, where the window leaves nodes out
        "all_anchor": nodes_anchor(src, f.graph.id) if len(window) < len(rows) else None,
        "total": total,
        "shown": len(rows),
        "before": window[0]["index"] if window else 0,
        "after": max(total - 1 - window[-1]["index"], 0) if window else 0,
    }


def kernel_signature(name: str) -> tuple[str, list[str], str]:
    """Split a demangled kernel name into (what comes before its parameter list, the
    parameters, what follows), so a page can mark one parameter; ("name", [], "") when the
    name has no parameter list (Triton kernels, memcpy)."""
    end, open_at = len(name.rstrip()) - 1, -1
    for i, ch in _outside_brackets(name):
        if ch == "(":
            open_at = i
        elif ch == ")" and open_at >= 0 and i == end:
            return name[: open_at + 1], _split_params(name[open_at + 1 : i]), name[i:]
    return name, [], ""


def _split_params(inner: str) -> list[str]:
    """`inner` cut at its top-level commas, each part stripped; no empty last part."""
    cuts = [i for i, ch in _outside_brackets(inner) if ch == ","]
    parts = [
        inner[a + 1 : b].strip() for a, b in zip([-1, *cuts], [*cuts, len(inner)], strict=True)
    ]
    return parts if parts[-1] else parts[:-1]


def _outside_brackets(text: str) -> Iterator[tuple[int, str]]:
    """(index, character) of each character outside every <>, () and [] pair, a bracket counting
    as outside the pair it opens or closes; a closer without its opener is passed over."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in ">)]":
            depth = max(depth - 1, 0)
        if depth == 0:
            yield i, ch
        if ch in "<([":
            depth += 1

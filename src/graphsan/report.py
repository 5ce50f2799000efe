"""Findings and reports: the records graphsan hands to people and to tools.

A `Finding` says that one captured graph will touch one block of device memory that is no longer
what it was at capture. `format_finding` renders it like a good bug report; `Report` holds every
finding of a run plus per-graph statistics and round-trips through JSON (`SCHEMA_VERSION`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA = "graphsan.report"
# 2 added Finding.also_used_by; 3 added times: Finding.freed_at and found_at, a graph's
# captured_at and node summary, and the process's events (see graphsan.timeline)
SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # older reports read with the newer fields empty

Frame = tuple[str, int, str]  # (filename, line, function)

KINDS = ("freed", "reowned", "moved", "unmapped", "pool-reuse")

LIKELY_CAUSE = {
    "freed": "eager code dropped the last reference to memory this graph still uses; the replay "
    "would read stale data or write into memory the allocator may hand out at any time",
    "reowned": "the memory was freed and now belongs to another live tensor; the replay would "
    "silently corrupt that tensor (and read its data as if it were the graph's)",
    "moved": "a tensor the graph uses changed its storage ({op}); the graph still points at the "
    "old memory",
    "unmapped": "the memory was freed and released to the driver (empty_cache, OOM retry or an "
    "expandable segment unmapping pages); the replay would fault with 'an illegal memory access'",
    "pool-reuse": "a later capture re-carved memory of a shared graph pool that this graph still "
    "uses; the graphs now overwrite each other's data",
}


@dataclass
class GraphInfo:
    """Identity of one captured graph as a person would look for it."""

    id: int
    label: str
    capture_site: list[Frame]
    pool: tuple[int, int] | None = None
    device: int = 0

    def describe(self) -> str:
        site = _frame_text(self.capture_site[-1]) if self.capture_site else "<unknown site>"
        return f"graph #{self.id} '{self.label}' captured at {site}"


@dataclass
class Finding:
    """One graph reference into memory that is no longer what it was at capture.

    `node`, `kernel`, `param` and `offset` name the first node of the graph whose arguments hold
    `address` (`param` is the parameter index, `offset` the byte offset inside it; for memcpy and
    memset nodes `param` is "src"/"dst"); `other_nodes` counts further references to the same block.
    """

    kind: str
    graph: GraphInfo
    node: int
    kernel: str
    param: int | str
    offset: int
    address: int
    nbytes: int
    block_address: int
    pool: str
    alloc_stack: list[Frame] = field(default_factory=list)
    free_stack: list[Frame] = field(default_factory=list)
    phase: str | None = None
    step: int | None = None
    free_op: str | None = None
    now: str = ""
    other_nodes: int = 0
    rank: int | None = None
    # other live graphs that reference the same block, each as {"graph", "label", "node",
    # "kernel", "param", "offset"} (their first reference): the replay that was stopped is only the
    # first to run; these would touch the memory next
    also_used_by: list[dict[str, Any]] = field(default_factory=list)
    # time.time() of the watched free, and of the replay that was judged and found this
    freed_at: float | None = None
    found_at: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.graph.id, self.block_address)

    @property
    def likely_cause(self) -> str:
        return LIKELY_CAUSE.get(self.kind, "").format(op=self.free_op or "resize_/set_/.data=")

    def one_line(self) -> str:
        """The finding in one line: kind, graph, kernel, buffer, free site."""
        free = _frame_text(self.free_stack[-1]) if self.free_stack else _no_stack(self)
        when = _when(self.phase, self.step)
        return (
            f"{self.kind}: {self.graph.label} node {self.node} {short_kernel(self.kernel)} "
            f"param {self.param}+{self.offset} -> {self.nbytes} B block at {self.block_address:#x}"
            f" ({self.pool}), freed at {free}{when}"
        )


def short_kernel(name: str, limit: int = 60) -> str:
    """A kernel name short enough for one line: drop template arguments and parameters, keep
    the names inside them that say what the kernel computes (functors, `*_kernel_impl`)."""
    base = _strip_templates(name)
    hints = [h for h in dict.fromkeys(_HINT.findall(name)) if h not in base][:2]
    text = f"{base} [{', '.join(hints)}]" if hints else base
    return text if len(text) <= limit else text[: limit - 3] + "..."


# identifiers in template arguments worth keeping: at::native's functors and *_kernel_impl
_HINT = re.compile(r"\b(\w+Functor|\w+_kernel_impl|\w+_kernel_cuda)\b")


def _strip_templates(name: str) -> str:
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            if depth == 0:
                out.append("<>" if ch == "<" else "")
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip() or name
    return text.removeprefix("void ")


def display_path(filename: str) -> str:
    """A frame's file as reports print it: relative to the working directory when absolute."""
    return os.path.relpath(filename) if os.path.isabs(filename) else filename


def _frame_text(frame: Frame) -> str:
    filename, line, name = frame
    return f"{display_path(filename)}:{line} in {name}"


def _when(phase: str | None, step: int | None) -> str:
    parts = []
    if phase:
        parts.append(f"phase {phase}")
    if step is not None:
        parts.append(f"step {step}")
    return f" ({', '.join(parts)})" if parts else ""


# A free with no user frames ran inside torch: on autograd's backward threads, which free saved
# tensors with no Python on their stack, or in torch code called from outside any user frame.
NO_FREE_FRAMES = "torch internals (no Python frames of yours: e.g. autograd's backward thread)"
# the free_op of memory that was already free when the capture ended (no free was seen)
FREED_BEFORE_CAPTURE = "freed before capture ended"


def _no_stack(f: Finding) -> str:
    if f.free_op == FREED_BEFORE_CAPTURE:
        return "no free seen: the memory was already free when the capture ended"
    return NO_FREE_FRAMES


def _stack_text(
    frames: list[Frame], indent: str = "      ", empty: str = "not recorded"
) -> list[str]:
    if not frames:
        return [f"{indent}<{empty}>"]
    return [f"{indent}{_frame_text(f)}" for f in frames]


def _node_kernel(name: str) -> str:
    """Long demangled names (at::native's lambdas run to a thousand characters) print short;
    the JSON report keeps them whole."""
    if len(name) <= LONG_KERNEL:
        return name
    return (
        f"{short_kernel(name, limit=LONG_KERNEL)} ({len(name)}-character name in the JSON report)"
    )


LONG_KERNEL = 160


def format_finding(f: Finding) -> str:
    """A multi-line bug report for one finding."""
    rank = f"[rank {f.rank}] " if f.rank is not None else ""
    lines = [
        f"{rank}{f.kind.upper()}: {f.graph.describe()}",
        f"  node {f.node}: {_node_kernel(f.kernel)}",
        f"  argument: param {f.param}, byte offset {f.offset} holds address {f.address:#x}",
        f"  memory: block {f.block_address:#x} of {f.nbytes} bytes in the {f.pool}"
        + (f" (+{f.other_nodes} more node(s) of this graph use it)" if f.other_nodes else ""),
    ]
    if f.now:
        lines.append(f"  now: {f.now}")
    lines.append("  allocated at (most recent call last):")
    lines += _stack_text(f.alloc_stack)
    if f.free_op == FREED_BEFORE_CAPTURE and not f.free_stack:
        lines.append("  freed: before the capture ended (the graph captured memory already free)")
    else:
        op = f" by {f.free_op}" if f.free_op else ""
        lines.append(f"  freed{op}{_when(f.phase, f.step)} at (most recent call last):")
        lines += _stack_text(f.free_stack, empty=NO_FREE_FRAMES)
    if f.also_used_by:
        lines.append("  also used by:")
        for u in f.also_used_by[:MAX_ALSO]:
            lines.append(
                f"      graph #{u['graph']} '{u['label']}' node {u['node']}: "
                f"{short_kernel(u['kernel'])} param {u['param']}+{u['offset']}"
            )
        if len(f.also_used_by) > MAX_ALSO:
            lines.append(f"      ... and {len(f.also_used_by) - MAX_ALSO} more graph(s)")
    lines.append(f"  likely cause: {f.likely_cause}")
    return "\n".join(lines)


MAX_ALSO = 6  # graphs listed under "also used by"; the JSON report keeps them all


def finding_to_dict(f: Finding) -> dict[str, Any]:
    d = asdict(f)
    d["likely_cause"] = f.likely_cause
    return d


def finding_from_dict(d: dict[str, Any]) -> Finding:
    d = dict(d)
    d.pop("likely_cause", None)
    g = d.pop("graph")
    g["capture_site"] = [tuple(x) for x in g.get("capture_site", [])]
    if g.get("pool") is not None:
        g["pool"] = tuple(g["pool"])
    for k in ("alloc_stack", "free_stack"):
        d[k] = [tuple(x) for x in d.get(k, [])]
    return Finding(graph=GraphInfo(**g), **d)


@dataclass
class Report:
    """Everything one process saw: findings plus per-graph statistics."""

    findings: list[Finding] = field(default_factory=list)
    graphs: list[dict[str, Any]] = field(default_factory=list)
    rank: int | None = None
    policy: str = "raise"
    pinned: dict[str, Any] = field(default_factory=dict)
    # the process's timeline (graphsan.timeline.Event dicts, the first MAX_EVENTS) and how many
    # later events were only counted
    events: list[dict[str, Any]] = field(default_factory=list)
    events_dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": SCHEMA_VERSION,
            "rank": self.rank,
            "policy": self.policy,
            "findings": [finding_to_dict(f) for f in self.findings],
            "graphs": self.graphs,
            "pinned": self.pinned,
            "events": self.events,
            "events_dropped": self.events_dropped,
        }

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Report:
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable graphsan report ({err})") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a graphsan report (expected schema '{SCHEMA}')")
        if data.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"{path}: report schema version {data.get('version')} is not supported "
                f"(expected one of {', '.join(map(str, READABLE_VERSIONS))})"
            )
        try:
            return _report_from_dict(data)
        except _BadReport as err:
            raise ValueError(f"{path}: not a valid graphsan report: {err}") from None

    def render(self) -> str:
        who = f" (rank {self.rank})" if self.rank is not None else ""
        nodes = sum(g.get("nodes", 0) for g in self.graphs)
        head = (
            f"graphsan report{who}: {len(self.graphs)} graph(s), {nodes} node(s) analysed, "
            f"{len(self.findings)} finding(s), policy {self.policy}"
        )
        body = [format_finding(f) for f in self.findings]
        if self.pinned:
            body.append(
                f"pinned: {self.pinned.get('blocks', 0)} block(s), "
                f"{self.pinned.get('bytes', 0)} bytes kept alive for live graphs"
            )
        return "\n\n".join([head, *body])


class _BadReport(Exception):
    """What is wrong in a report file, as `where: what; expected what`."""


# The fields a saved report must have, with the types `render` and `merge_reports` rely on.
_INT, _STR, _OPT_INT, _OPT_STR = (int,), (str,), (int, type(None)), (str, type(None))
_FINDING_FIELDS = {
    "kind": _STR,
    "graph": (dict,),
    "node": _INT,
    "kernel": _STR,
    "param": (int, str),
    "offset": _INT,
    "address": _INT,
    "nbytes": _INT,
    "block_address": _INT,
    "pool": _STR,
}
_FINDING_OPTIONAL = {
    "alloc_stack": (list,),
    "free_stack": (list,),
    "phase": _OPT_STR,
    "step": _OPT_INT,
    "free_op": _OPT_STR,
    "now": _STR,
    "other_nodes": _INT,
    "rank": _OPT_INT,
    "also_used_by": (list,),
    "likely_cause": _STR,
    "freed_at": (int, float, type(None)),
    "found_at": (int, float, type(None)),
}
_GRAPH_FIELDS = {"id": _INT, "label": _STR, "capture_site": (list,)}
_GRAPH_OPTIONAL = {"pool": (list, type(None)), "device": _INT}
_ALSO_FIELDS = {
    "graph": _INT,
    "label": _STR,
    "node": _INT,
    "kernel": _STR,
    "param": (int, str),
    "offset": _INT,
}
_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


def _expect(value: Any, types: tuple, where: str) -> None:
    # bool is an int to Python, never to a report
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(_TYPE_NAMES.get(t, "null") for t in types)
        raise _BadReport(f"{where} is {value!r:.60}; expected {names}")


def _check_fields(d: Any, required: dict, optional: dict, where: str) -> None:
    _expect(d, (dict,), where)
    for key, types in required.items():
        if key not in d:
            raise _BadReport(f"{where}: key '{key}' is missing")
        _expect(d[key], types, f"{where}.{key}")
    for key, value in d.items():
        if key in optional:
            _expect(value, optional[key], f"{where}.{key}")
        elif key not in required:
            known = ", ".join([*required, *optional])
            raise _BadReport(f"{where}: unknown key '{key}'; expected some of {known}")


def _check_frames(frames: list, where: str) -> None:
    for i, frame in enumerate(frames):
        ok = isinstance(frame, list) and len(frame) == 3
        if ok:
            file, line, name = frame
            ok = isinstance(file, str) and isinstance(line, int) and isinstance(name, str)
        if not ok:
            raise _BadReport(f"{where}[{i}] is {frame!r:.60}; expected [file, line, function]")


def _check_finding(d: Any, where: str) -> None:
    _check_fields(d, _FINDING_FIELDS, _FINDING_OPTIONAL, where)
    if d["kind"] not in KINDS:
        raise _BadReport(f"{where}.kind is {d['kind']!r}; expected one of {', '.join(KINDS)}")
    g = d["graph"]
    _check_fields(g, _GRAPH_FIELDS, _GRAPH_OPTIONAL, f"{where}.graph")
    _check_frames(g["capture_site"], f"{where}.graph.capture_site")
    pool = g.get("pool")
    if pool is not None and (len(pool) != 2 or not all(type(x) is int for x in pool)):
        raise _BadReport(f"{where}.graph.pool is {pool!r:.60}; expected [int, int] or null")
    for key in ("alloc_stack", "free_stack"):
        _check_frames(d.get(key, []), f"{where}.{key}")
    for i, u in enumerate(d.get("also_used_by", [])):
        _check_fields(u, _ALSO_FIELDS, {}, f"{where}.also_used_by[{i}]")


def _report_from_dict(data: dict[str, Any]) -> Report:
    """A Report from a file's JSON, every field checked (a file may be hand-edited or truncated
    by a tool): `_BadReport` names the first wrong field."""
    findings = data.get("findings")
    _expect(findings, (list,), "findings")
    for i, f in enumerate(findings):
        _check_finding(f, f"findings[{i}]")
    graphs = data.get("graphs", [])
    _expect(graphs, (list,), "graphs")
    for i, g in enumerate(graphs):
        _expect(g, (dict,), f"graphs[{i}]")
        _expect(g.get("nodes", 0), _INT, f"graphs[{i}].nodes")
    _expect(data.get("rank"), _OPT_INT, "rank")
    _expect(data.get("policy", "raise"), _STR, "policy")
    pinned = data.get("pinned", {})
    _expect(pinned, (dict,), "pinned")
    for key in ("blocks", "bytes"):
        _expect(pinned.get(key, 0), _INT, f"pinned.{key}")
    events = data.get("events", [])
    _expect(events, (list,), "events")
    for i, e in enumerate(events):
        _expect(e, (dict,), f"events[{i}]")
    _expect(data.get("events_dropped", 0), _INT, "events_dropped")
    return Report(
        findings=[finding_from_dict(f) for f in findings],
        graphs=graphs,
        rank=data.get("rank"),
        policy=data.get("policy", "raise"),
        pinned=pinned,
        events=events,
        events_dropped=data.get("events_dropped", 0),
    )


class StaleMemoryError(RuntimeError):
    """A graph replay would touch memory that was freed, re-owned, moved or unmapped.

    Raised by `CUDAGraph.replay()` *before* the graph is launched, so the CUDA context stays
    healthy. `findings` holds the evidence; `str(err)` is a readable report.
    """

    def __init__(self, findings: list[Finding]):
        self.findings = list(findings)
        super().__init__(self._text())

    def _text(self) -> str:
        n = len(self.findings)
        head = f"graphsan: replay stopped before launch: {n} stale reference(s)"
        return "\n\n".join([head, *(format_finding(f) for f in self.findings)])

"""The JSON report: every finding of a process plus per-graph statistics and its timeline.

`Report` round-trips through JSON (`SCHEMA_VERSION`); loading checks every field, so a
hand-edited or truncated file gets one line naming the wrong field.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from graphsan.core.records import Finding, GraphInfo
from graphsan.report.output import writing
from graphsan.report.schema import SchemaError, validate, validate_finding
from graphsan.report.text import attachment_line, format_finding, provenance_line, watch_line

SCHEMA = "graphsan.report"
# 2 added Finding.also_used_by; 3 added times: Finding.freed_at and found_at, a graph's
# captured_at and node summary, and the process's events (see graphsan.core.timeline);
# 4 added the replay-order kind and its written_by and carved_by (OrderEvidence), and indirect
# references' Finding.through and through_slot, and Finding.host (pinned host memory);
# 5 added Finding.caveat, the report's layouts (graphsan.core.argstructs, per device) and its
# suppressed findings (graphsan.report.suppressions); 6 added the live-output kind and its
# replays (OrderEvidence); 7 added whether graphsan watched (watched, disabled_reason) and what
# recorded the report (provenance: graphsan, torch, CUDA, driver, GPU, Python); 8 added the
# kinds of what a graph baked at capture (mode, baked-value, superseded) and their
# entry, captured, current and modules (BakedEvidence; where it changed is free_stack in
# the JSON); 9 added how graphsan attached to the
# provenance (attach, hooks, allocator, tracker: graphsan.runtime.attachment)
SCHEMA_VERSION = 10
READABLE_VERSIONS = (
    1,
    2,
    3,
    4,
    5,
    6,
    7,
    8,
    9,
    10,
)  # older reports read with the newer fields empty


def finding_to_dict(f: Finding) -> dict[str, Any]:
    """A finding as the report's JSON holds it: flat, every kind's evidence fields in every
    finding (`Finding.flat`), and its likely cause."""
    d = f.flat()
    d["kind"] = f.kind.value
    d["graph"] = asdict(f.graph)
    d["also_used_by"] = [asdict(u) for u in f.also_used_by]
    d["likely_cause"] = f.likely_cause
    return d


def finding_from_dict(d: dict[str, Any]) -> Finding:
    """A finding from the report's JSON (any readable version: the fields it predates take
    their defaults), its evidence typed by kind (`Finding.of`); ValueError where a kind holds
    another kind's evidence."""
    d = dict(d)
    d.pop("likely_cause", None)
    g = dict(d.pop("graph"))
    g["capture_site"] = tuple(tuple(x) for x in g.get("capture_site", []))
    if g.get("pool") is not None:
        g["pool"] = tuple(g["pool"])
    for k in ("alloc_stack", "free_stack"):
        d[k] = tuple(tuple(x) for x in d.get(k, []))
    if d.get("replays") is not None:
        d["replays"] = tuple(d["replays"])
    d["modules"] = tuple(d.get("modules", ()))
    return Finding.of(graph=GraphInfo(**g), **d)


@dataclass
class Report:
    """Everything one process saw: findings plus per-graph statistics."""

    findings: list[Finding] = field(default_factory=list)
    graphs: list[dict[str, Any]] = field(default_factory=list)
    rank: int | None = None
    policy: str = "raise"
    pinned: dict[str, Any] = field(default_factory=dict)
    # the process's timeline (graphsan.core.timeline.Event dicts, the first MAX_EVENTS) and how many
    # later events were only counted
    events: list[dict[str, Any]] = field(default_factory=list)
    events_dropped: int = 0
    # where the allocator's events came from: "tracker" or "snapshot (why)" (cuda.allocator)
    allocator_log: str | None = None
    # per device: which argument-struct layouts the startup probe confirmed (else why not)
    layouts: dict[str, Any] = field(default_factory=dict)
    # (suppression entry's name, finding) of each finding a suppression file matched
    suppressed: list[tuple[str, Finding]] = field(default_factory=list)
    # whether graphsan watched the process's graphs (None: not recorded, a report built by hand
    # or read from before schema v7), and why it stayed idle or disabled itself partway
    watched: bool | None = None
    disabled_reason: str | None = None
    # what recorded it: graphsan (and its commit), torch, CUDA runtime, driver, GPU, Python
    provenance: dict[str, Any] = field(default_factory=dict)
    # the schema version of the file it was read from (None: made in this process)
    loaded_version: int | None = None

    @property
    def idle(self) -> bool:
        """graphsan watched nothing: no finding in this report means nothing."""
        return self.watched is False

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
            "allocator_log": self.allocator_log,
            "layouts": self.layouts,
            "suppressed": [{"by": name, **finding_to_dict(f)} for name, f in self.suppressed],
            "watched": self.watched,
            "disabled_reason": self.disabled_reason,
            "provenance": dict(self.provenance),
        }

    def save(self, path: str) -> None:
        """Write the report whole (graphsan.report.output; `-`: stdout). Raises OSError."""
        with writing(path) as fh:
            json.dump(self.to_dict(), fh, indent=1)

    @classmethod
    def load(cls, path: str) -> Report:
        """A saved report (gzipped too: `*.json.gz`, or any file starting with gzip's magic)."""
        seen = _NonFinite()
        try:
            with open(path, "rb") as fh:
                gzipped = fh.read(2) == b"\x1f\x8b"
            opener = gzip.open if gzipped else open
            with opener(path, "rt") as fh:
                data = json.load(fh, parse_constant=seen.constant, parse_float=seen.number)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable graphsan report ({err})") from None
        except RecursionError:  # Python's JSON reader follows about 1000 levels
            raise ValueError(
                f"{path}: not a graphsan report (its JSON nests deeper than Python's JSON reader "
                f"follows; a report nests at most {MAX_DEPTH} levels)"
            ) from None
        where = too_deep(data)
        if where is not None:
            raise ValueError(
                f"{path}: not a valid graphsan report: {where} nests deeper than {MAX_DEPTH} "
                f"levels; expected at most {MAX_DEPTH}"
            )
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ValueError(f"{path}: not a graphsan report (expected schema '{SCHEMA}')")
        version = data.get("version")
        expected = ", ".join(map(str, READABLE_VERSIONS))
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(
                f"{path}: report schema version is {version!r:.40} ({type(version).__name__}); "
                f"expected an integer, one of {expected}"
            )
        if version not in READABLE_VERSIONS:
            raise ValueError(
                f"{path}: report schema version {version} is not supported (expected one of "
                f"{expected})"
            )
        try:
            where = non_finite(data) if seen.seen else None
            if where is not None:
                raise SchemaError(f"{where[0]} is {where[1]}; expected a finite number")
            return _report_from_dict(data)
        except SchemaError as err:
            raise ValueError(f"{path}: not a valid graphsan report: {err}") from None

    def header(self) -> list[str]:
        """The lines under the summary: whether graphsan watched, what recorded it, and how
        graphsan attached."""
        watch = watch_line(self.watched, self.disabled_reason)
        made = provenance_line(self.provenance, self.loaded_version, SCHEMA_VERSION)
        attached = attachment_line(
            self.provenance, self.allocator_log, self.loaded_version, SCHEMA_VERSION
        )
        return [line for line in (watch, made, attached) if line]

    def render(self) -> str:
        who = f" (rank {self.rank})" if self.rank is not None else ""
        nodes = sum(g.get("nodes", 0) for g in self.graphs)
        head = (
            f"graphsan report{who}: {len(self.graphs)} graph(s), {nodes} node(s) analysed, "
            f"{len(self.findings)} finding(s), policy {self.policy}"
        )
        head = "\n".join([head, *self.header()])
        from graphsan.report.suppressions import summary

        body = [format_finding(f) for f in self.findings]
        if self.suppressed:
            body.append(summary(self.suppressed))
        if self.pinned:
            body.append(
                f"pinned: {self.pinned.get('blocks', 0)} block(s), "
                f"{self.pinned.get('bytes', 0)} bytes kept alive for live graphs"
            )
        return "\n\n".join([head, *body])


SAMPLES = {  # name -> (file in graphsan/report/samples, what it is); scripts/make_samples.py
    "stale-input": (
        "stale-input.json",
        "examples/stale_input.py under `graphsan run`: an input freed and the cache emptied",
    ),
    "te3316-case4": (
        "te3316-case4.json.gz",
        "`graphsan repro --case 4`: Transformer Engine #3316's stale weight workspace",
    ),
}


def sample_path(name: str) -> str:
    """The shipped report `name`, recorded on a GPU (its header says which)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples", SAMPLES[name][0])


_SCHEMA_LINE = re.compile(rb'"schema"\s*:\s*"graphsan\.report"')


def is_report_file(path: str) -> bool:
    """Whether the file at `path` begins as a graphsan report does (gzipped too): the first
    bytes are read, not the whole file, which may be large."""
    try:
        with open(path, "rb") as fh:
            gzipped = fh.read(2) == b"\x1f\x8b"
        with (gzip.open if gzipped else open)(path, "rb") as fh:
            head = fh.read(4096)
    except (OSError, EOFError):
        return False
    return bool(_SCHEMA_LINE.search(head))


class _NonFinite:
    """JSON hooks that note a NaN, an infinity or a float literal too large to hold, so that
    only a file holding one is searched for the field (`non_finite`)."""

    def __init__(self) -> None:
        self.seen = False

    def constant(self, name: str) -> float:
        self.seen = True
        return float(name)

    def number(self, text: str) -> float:
        value = float(text)
        self.seen = self.seen or not math.isfinite(value)
        return value


MAX_DEPTH = 64  # a report's deepest field (a stack's frame in a finding) is 5 levels down


def too_deep(data: Any, limit: int = MAX_DEPTH) -> str | None:
    """The first field of `data` holding lists or objects nested more than `limit` levels deep
    (found without recursion, which such data would exhaust; its name cut short), or None."""
    # (container, depth, the entry of its parent, its key there); names are made only at the end
    if not isinstance(data, (dict, list)):
        return None
    todo: list[tuple[Any, int, Any, Any]] = [(data, 0, None, None)]
    while todo:
        entry = todo.pop()
        value, depth = entry[0], entry[1]
        if depth > limit:
            keys = []
            while entry[2] is not None:
                keys.append(entry[3])
                entry = entry[2]
            name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys))
            name = name.lstrip(".") or "the top level"
            return name if len(name) <= 60 else name[:57] + "..."
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        todo += [(v, depth + 1, entry, k) for k, v in pairs if isinstance(v, (dict, list))]
    return None


def non_finite(data: Any, where: str = "") -> tuple[str, str] | None:
    """The first number in `data` that is NaN or infinite (the JSON module reads `NaN`,
    `Infinity` and overflowing literals as such): (field, value), or None."""
    if isinstance(data, float) and not math.isfinite(data):
        return where or "the report", repr(data).replace("inf", "Infinity").replace("nan", "NaN")
    items = (
        data.items()
        if isinstance(data, dict)
        else enumerate(data)
        if isinstance(data, list)
        else ()
    )
    for key, value in items:
        sub = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}" if where else key
        found = non_finite(value, sub)
        if found is not None:
            return found
    return None


def _report_from_dict(data: dict[str, Any]) -> Report:
    """A Report from a file's JSON, checked against the report schema first (a file may be
    hand-edited or truncated by a tool): SchemaError names the first wrong field."""
    validate(data)
    suppressed = data.get("suppressed", [])
    for i, f in enumerate(suppressed):
        validate_finding({k: v for k, v in f.items() if k != "by"}, f"suppressed[{i}]")
    return Report(
        findings=[_finding(f, f"findings[{i}]") for i, f in enumerate(data["findings"])],
        graphs=data.get("graphs", []),
        rank=data.get("rank"),
        policy=data.get("policy", "raise"),
        pinned=data.get("pinned", {}),
        events=data.get("events", []),
        events_dropped=data.get("events_dropped", 0),
        allocator_log=data.get("allocator_log"),
        layouts=data.get("layouts", {}),
        suppressed=[
            (f["by"], _finding({k: v for k, v in f.items() if k != "by"}, f"suppressed[{i}]"))
            for i, f in enumerate(suppressed)
        ],
        watched=data.get("watched"),
        disabled_reason=data.get("disabled_reason"),
        provenance=data.get("provenance", {}),
        loaded_version=data["version"],
    )


def _finding(d: dict[str, Any], where: str) -> Finding:
    """`finding_from_dict`, with the field that does not fit its kind named as the schema's
    errors name theirs."""
    try:
        return finding_from_dict(d)
    except ValueError as err:
        raise SchemaError(f"{where}.{err}") from None

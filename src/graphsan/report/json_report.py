"""The JSON report: every finding of a process plus per-graph statistics and its timeline.

`Report` round-trips through JSON (`SCHEMA_VERSION`); loading checks every field, so a
hand-edited or truncated file gets one line naming the wrong field.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from graphsan.core.records import Finding, GraphInfo
from graphsan.report.schema import SchemaError, validate, validate_finding
from graphsan.report.text import format_finding

SCHEMA = "graphsan.report"
# 2 added Finding.also_used_by; 3 added times: Finding.freed_at and found_at, a graph's
# captured_at and node summary, and the process's events (see graphsan.report.timeline);
# 4 added the replay-order kind and its Finding.written_by and carved_by, and indirect
# references' Finding.through and through_slot, and Finding.host (pinned host memory);
# 5 added Finding.caveat, the report's layouts (graphsan.core.argstructs, per device) and its
# suppressed findings (graphsan.report.suppressions); 6 added the live-output kind and its
# Finding.replays
SCHEMA_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)  # older reports read with the newer fields empty


def finding_to_dict(f: Finding) -> dict[str, Any]:
    d = asdict(f)
    d["kind"] = f.kind.value
    d["likely_cause"] = f.likely_cause
    return d


def finding_from_dict(d: dict[str, Any]) -> Finding:
    d = dict(d)
    d.pop("likely_cause", None)
    g = d.pop("graph")
    g["capture_site"] = tuple(tuple(x) for x in g.get("capture_site", []))
    if g.get("pool") is not None:
        g["pool"] = tuple(g["pool"])
    for k in ("alloc_stack", "free_stack"):
        d[k] = tuple(tuple(x) for x in d.get(k, []))
    if d.get("replays") is not None:
        d["replays"] = tuple(d["replays"])
    return Finding(graph=GraphInfo(**g), **d)


@dataclass
class Report:
    """Everything one process saw: findings plus per-graph statistics."""

    findings: list[Finding] = field(default_factory=list)
    graphs: list[dict[str, Any]] = field(default_factory=list)
    rank: int | None = None
    policy: str = "raise"
    pinned: dict[str, Any] = field(default_factory=dict)
    # the process's timeline (graphsan.report.timeline.Event dicts, the first MAX_EVENTS) and how many
    # later events were only counted
    events: list[dict[str, Any]] = field(default_factory=list)
    events_dropped: int = 0
    # where the allocator's events came from: "tracker" or "snapshot (why)" (cuda.allocator)
    allocator_log: str | None = None
    # per device: which argument-struct layouts the startup probe confirmed (else why not)
    layouts: dict[str, Any] = field(default_factory=dict)
    # (suppression entry's name, finding) of each finding a suppression file matched
    suppressed: list[tuple[str, Finding]] = field(default_factory=list)

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
        }

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Report:
        """A saved report (gzipped too: `*.json.gz`, or any file starting with gzip's magic)."""
        try:
            with open(path, "rb") as fh:
                gzipped = fh.read(2) == b"\x1f\x8b"
            opener = gzip.open if gzipped else open
            with opener(path, "rt") as fh:
                data = json.load(fh)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as err:
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
        except SchemaError as err:
            raise ValueError(f"{path}: not a valid graphsan report: {err}") from None

    def render(self) -> str:
        who = f" (rank {self.rank})" if self.rank is not None else ""
        nodes = sum(g.get("nodes", 0) for g in self.graphs)
        head = (
            f"graphsan report{who}: {len(self.graphs)} graph(s), {nodes} node(s) analysed, "
            f"{len(self.findings)} finding(s), policy {self.policy}"
        )
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


SAMPLES = {  # name -> (file in graphsan/report/samples, what it is)
    "stale-input": (
        "stale-input.h200.json",
        "examples/stale_input.py under `graphsan run`: an input freed and the cache emptied",
    ),
    "te3316-case4": (
        "te3316-case4.h200.json.gz",
        "`graphsan repro --case 4`: Transformer Engine #3316's stale weight workspace",
    ),
}


def sample_path(name: str) -> str:
    """The shipped report recorded on an NVIDIA H200 (torch 2.11.0+cu130, 2026-12-02)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "samples", SAMPLES[name][0])


def _report_from_dict(data: dict[str, Any]) -> Report:
    """A Report from a file's JSON, checked against the report schema first (a file may be
    hand-edited or truncated by a tool): SchemaError names the first wrong field."""
    validate(data)
    suppressed = data.get("suppressed", [])
    for i, f in enumerate(suppressed):
        validate_finding({k: v for k, v in f.items() if k != "by"}, f"suppressed[{i}]")
    return Report(
        findings=[finding_from_dict(f) for f in data["findings"]],
        graphs=data.get("graphs", []),
        rank=data.get("rank"),
        policy=data.get("policy", "raise"),
        pinned=data.get("pinned", {}),
        events=data.get("events", []),
        events_dropped=data.get("events_dropped", 0),
        allocator_log=data.get("allocator_log"),
        layouts=data.get("layouts", {}),
        suppressed=[
            (f["by"], finding_from_dict({k: v for k, v in f.items() if k != "by"}))
            for f in suppressed
        ],
    )

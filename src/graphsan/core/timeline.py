"""What the report pages need recorded while the program runs: a bounded list of timestamped
process events and a bounded summary of each captured graph's nodes.

The sanitizer calls `Timeline` at moments that are already slow or rare (capture end, a judged
replay, the free of a *watched* block, `empty_cache`, a change of phase); nothing is recorded on
a clean replay or for the free of memory no graph uses. Times are `time.time()` (seconds since
the epoch), so the reports of several ranks on one host line up.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, TypedDict

MAX_EVENTS = 10_000  # the first ones are kept; later ones are only counted (`dropped`)
MAX_NODES = 512  # nodes listed per graph in its node summary
MAX_NODE_NAMES = 256  # distinct kernel names kept per graph (names are long: templates)

EVENT_KINDS = ("capture", "replay", "free", "release", "phase")


class Event(TypedDict, total=False):
    """One entry of `Report.events`; only `t`, `kind` and `rank` are always present.

    - capture: `graph`, `label`, `device`, `stream`, `begin` (time of capture_begin)
    - replay: a judged replay (a clean one is never recorded): `graph`, `label`, `device`,
      `stream`, `outcome` ("clean" | "findings" | "stopped"), `findings` (how many);
      `count` and `t_last` when several clean judgements of one graph in a row were folded
    - free: the free of a watched block: `block`, `phase`, `step`, `op`, `site`
    - release: `empty_cache()`: `phase`, `step`, `site`
    - phase: the phase (and step) changed to `phase`, `step`
    """

    t: float
    kind: str
    rank: int | None
    graph: int
    label: str
    device: int
    stream: int
    begin: float
    outcome: str
    findings: int
    count: int
    t_last: float
    block: int
    phase: str | None
    step: int | None
    op: str | None
    site: str


def site_of(stack: list) -> str:
    """`file:line in function` of a stack's innermost frame ("" for an empty stack)."""
    if not stack:
        return ""
    filename, line, name = stack[-1]
    return f"{os.path.basename(filename)}:{line} in {name}"


class Timeline:
    """The process's events, first `limit` kept. Safe to call from autograd's threads."""

    def __init__(self, rank: int | None = None, limit: int = MAX_EVENTS) -> None:
        self.rank = rank
        self.limit = limit
        self.events: list[Event] = []
        self.dropped = 0
        self._lock = threading.Lock()
        self._begun: dict[int, float] = {}  # graph id -> capture_begin time
        self._phase: str | None = None
        self._epoch = 0  # bumped by every event but a clean judged replay
        self._clean: dict[int, tuple[int, Event]] = {}  # graph id -> (epoch, its last clean replay)

    def _add(self, event: Event, fold: bool = False) -> None:
        with self._lock:
            if not fold:
                self._epoch += 1
            if len(self.events) < self.limit:
                self.events.append(event)
            else:
                self.dropped += 1

    # -- the calls the sanitizer makes -------------------------------------------------------
    def capture_begun(self, graph: int) -> None:
        self._begun[graph] = time.time()

    def captured(self, graph: int, label: str, device: int, stream: int | None) -> float:
        """A capture ended; returns its time (for the graph's `captured_at`)."""
        t = time.time()
        ev: Event = {"t": t, "kind": "capture", "rank": self.rank, "graph": graph}
        ev.update(label=label, device=device, begin=self._begun.pop(graph, t))
        if stream is not None:
            ev["stream"] = stream
        self._add(ev)
        return t

    def replay(
        self,
        graph: int,
        label: str,
        device: int,
        stream: int | None,
        findings: int,
        stopped: bool,
        t: float | None = None,
    ) -> float:
        """A dirty graph was judged before its replay at time `t` (default: now); returns it.
        Clean judgements of one graph with nothing else recorded in between fold into one."""
        t = time.time() if t is None else t
        outcome = "stopped" if stopped else ("findings" if findings else "clean")
        if outcome == "clean":
            with self._lock:
                last = self._clean.get(graph)
                if last is not None and last[0] == self._epoch:
                    last[1]["count"] = last[1].get("count", 1) + 1
                    last[1]["t_last"] = t
                    return t
        ev: Event = {"t": t, "kind": "replay", "rank": self.rank, "graph": graph, "label": label}
        ev.update(device=device, outcome=outcome, findings=findings)
        if stream is not None:
            ev["stream"] = stream
        self._add(ev, fold=outcome == "clean")
        if outcome == "clean":
            with self._lock:
                self._clean[graph] = (self._epoch, ev)
        return t

    def free(self, block: int, t: float, stack: list, phase, step, op) -> None:
        """A watched block was freed (the FreeEvent's time `t`)."""
        ev: Event = {"t": t, "kind": "free", "rank": self.rank, "block": block}
        ev.update(phase=phase, step=step, op=op, site=site_of(stack))
        self._add(ev)

    def release(self, stack: list, phase, step) -> None:
        """`empty_cache()` gave cached memory back to the driver."""
        ev: Event = {"t": time.time(), "kind": "release", "rank": self.rank}
        ev.update(phase=phase, step=step, site=site_of(stack))
        self._add(ev)

    def phase(self, phase: str, step: int) -> None:
        """The phase may have changed (every module's train()/eval() calls this): only a change
        of phase is recorded, with the step it changed in."""
        if self._phase == phase:
            return
        self._phase = phase
        self._add(
            {"t": time.time(), "kind": "phase", "rank": self.rank, "phase": phase, "step": step}
        )


def node_summary(nodes: Sequence[Any], limit: int = MAX_NODES) -> dict[str, Any]:
    """The first `limit` nodes of a walked graph as indexes into a table of distinct kernel
    names (whole, for hover text): {"names": [...], "nodes": [name index per node], "total": n}.
    A node is a KernelArgs (`name`) or a CopyArgs (`kind`: memcpy/memset). Costs `limit` steps
    however large the graph."""
    names: dict[str, int] = {}
    out: list[int] = []
    for node in itertools.islice(nodes, limit):
        name = getattr(node, "name", None) or getattr(node, "kind", "?")
        i = names.get(name)
        if i is None:
            if len(names) >= MAX_NODE_NAMES:
                i = -1  # more distinct kernels than kept: the page shows "?"
            else:
                i = names[name] = len(names)
        out.append(i)
    return {"names": list(names), "nodes": out, "total": len(nodes)}

"""The sanitizer: routes the graph hooks to the capture analysis and the replay judge, and
applies the policy.

At capture end the capture analysis (`graphsan.runtime.capture`) turns the graph being captured into
its watched blocks (`core.tracker`) and hands it to the replay judge (`core.judgement`), which
places it in its pool's replay order. At a replay the judge `needs` to see, `before_replay`
flushes the pins, takes the judge's verdict, leaves out what the suppressions match, records
the replay on the timeline, and lets the policy act (`graphsan.policies`):

- "raise": `StaleMemoryError` from `replay()`; the graph is not launched (and stays blocked);
- "warn": each finding is printed once, the replay goes on;
- "record": findings are only collected (`san.findings`, `san.report()`);
- "pin": referenced memory with a Python-visible owner is kept alive for the graph's lifetime;
  what cannot be pinned falls back to "raise" (see `graphsan.policies.pin`).

The sanitizer owns its policy's objects: setting `policy` to "pin" attaches a `Pinner`, setting
it to anything else detaches and drops it.

Any internal error disables the sanitizer with one message; the user's program runs on.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
import traceback

import torch

from graphsan.command_line import rank_from_env
from graphsan.core.pool_order import PoolOrder
from graphsan.core.records import Finding, GraphStats
from graphsan.core.timeline import Timeline
from graphsan.cuda import driverwatch, hooks
from graphsan.cuda.context import Context
from graphsan.policies import POLICIES, Policy, act
from graphsan.policies.pin import Pinner
from graphsan.report import Report, suppressions
from graphsan.report.suppressions import Suppression
from graphsan.runtime import attachment
from graphsan.runtime.capture import stream_handle
from graphsan.runtime.parts import MemoryFactory
from graphsan.runtime.parts import build as build_parts

__all__ = ["POLICIES", "Policy", "Sanitizer"]


class _PartSetting:
    """A setting of the sanitizer that one of its parts keeps: read and set as `part.name`, so
    the part reads it where it works without asking the sanitizer."""

    def __init__(self, part: str, name: str, doc: str) -> None:
        self.part, self.name, self.__doc__ = part, name, doc

    def __get__(self, obj: object, owner: type | None = None):
        return self if obj is None else getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj: object, value) -> None:
        setattr(getattr(obj, self.part), self.name, value)


class Sanitizer:
    """One per process (see `graphsan.enable`)."""

    def __init__(
        self,
        policy: str | Policy = Policy.RAISE,
        context: Context | None = None,
        alloc_stacks: bool = True,
        memory: MemoryFactory | None = None,
    ):
        """`memory` makes the memory watch (`runtime.parts.build`; tests give a fake)."""
        policy = Policy.parse(policy)
        self.context = context or Context()
        self.findings: list[Finding] = []
        self.graph_stats: dict[int, GraphStats] = {}  # by graph id, in capture order
        self.rank = rank_from_env()
        self.active = False
        self.watched = False  # start() got as far as watching (a report says whether it did)
        self.disabled_reason: str | None = None
        self._failed = False  # an internal error disabled it
        self.report_path: str | None = None
        self.timeline = Timeline(self.rank)
        parts = build_parts(
            self.context, self.timeline, self._internal_error, alloc_stacks, self.rank, memory
        )
        self.tracker, self.pool_orders = parts.tracker, parts.pool_orders
        self.memory, self.host, self.capture = parts.memory, parts.host, parts.capture
        self.judge, self.recorder = parts.judge, parts.recorder
        self.streams = parts.streams
        self.hooks = hooks.GraphHooks(self, needs=self.judge.needs, replayed=self.judge.replayed)
        self.pinner: Pinner | None = None  # while the policy is pin
        self._policy = Policy.RAISE
        self.policy = policy
        self._ids = itertools.count(1)
        self._labels = threading.local()  # .stack: `graphsan.label` blocks open on this thread
        self._reported: set[tuple[int, int, str]] = set()
        # findings matching one of these are counted in `suppressed`, never stop a replay
        self.suppressions: list[Suppression] = []
        self.suppressed: list[tuple[str, Finding]] = []

    # -- policy ------------------------------------------------------------------------------
    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, value: str | Policy) -> None:
        policy = Policy.parse(value)
        self._policy = policy
        if policy is Policy.PIN and self.pinner is None:
            self.pinner = Pinner(self.tracker, self.memory, self.context, self._internal_error)
        elif policy is not Policy.PIN and self.pinner is not None:
            self.pinner.detach()
            self.pinner.release_all()
            self.pinner = None

    # -- replay orders and pointer tables (a change applies to graphs captured from now on) ---
    replay_order = _PartSetting(
        "pool_orders", "enabled", "Follow the replay order of graphs sharing a pool."
    )
    table_block = _PartSetting(
        "capture",
        "table_block",
        "Pointer tables read at capture end are blocks up to this many bytes.",
    )
    table_budget = _PartSetting(
        "capture",
        "table_budget",
        "Bytes of pointer tables read per graph (0 turns the reading off).",
    )

    @property
    def orders(self) -> dict[tuple, PoolOrder]:
        """(device, pool) -> the pool's replay order."""
        return self.pool_orders.orders

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Sanitizer:
        if self.active:
            return self
        if not torch.cuda.is_available():
            self.disabled_reason = "CUDA is not available"
            self._say(
                "CUDA is not available: there are no CUDA graphs to watch; graphsan stays idle"
            )
            return self
        self.context.start()
        self.context.on_phase_change.append(self._phase_changed)
        try:
            self.memory.start()
        except Exception as err:  # the environment refuses what graphsan reads: it stays idle
            self.context.stop()
            self.disabled_reason = (
                f"the allocator cannot be read here ({type(err).__name__}: {err})"
            )
            self._say(f"{self.disabled_reason[:300]}; graphsan stays idle")
            return self
        if isinstance(self.memory, driverwatch.DriverWatch):
            self._say(
                f"{self.memory.why}: graphsan asks the driver about the memory graphs use before "
                "each replay (frees are found, not seen: no free stacks; no allocation stacks)"
            )
        self.host.start()
        self.recorder.start()
        self.streams.start()
        self.hooks.install()
        if self.pinner is not None:
            self.pinner.attach()
        self.active = self.watched = True
        return self

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.pinner is not None:
            self.pinner.detach()
        self.hooks.uninstall()
        self.streams.stop()
        self.recorder.stop()
        self.host.stop()
        self.memory.stop()
        with contextlib.suppress(ValueError):
            self.context.on_phase_change.remove(self._phase_changed)
        self.context.stop()

    def report(self) -> Report:
        """Everything seen so far, with whether graphsan watched (an idle run's report says
        why, so that it never reads as clean) and what recorded it."""
        from graphsan.runtime.provenance import collect

        pinned = self.pinner.summary() if self.pinner is not None else {}
        graphs = [g.to_dict() for g in self.graph_stats.values()]
        tl = self.timeline
        watched = self.watched or self.active or bool(self.graph_stats)
        if self._failed and not self.graph_stats:  # disabled before it analysed any graph
            watched = False
        reason = self.disabled_reason
        if not watched and reason is None:
            reason = "graphsan was not started (graphsan.enable() starts it)"
        return Report(
            list(self.findings),
            graphs,
            self.rank,
            self.policy,
            pinned,
            list(tl.events),
            tl.dropped,
            self.memory.event_source,
            dict(self.capture.calibration),
            list(self.suppressed),
            watched=watched,
            disabled_reason=reason,
            provenance=collect() | self.attachment(),
        )

    def attachment(self) -> dict:
        """How graphsan attached (`runtime.attachment`): torch's hooks or the wrapper, the
        seams of torch it used, the allocator backend, the tracker of the allocator's events."""
        return attachment.of(self.hooks.seams, self.memory, self.watched)

    # -- labels -----------------------------------------------------------------------------
    def push_label(self, label: str) -> None:
        """A `graphsan.label` block opened on this thread: captures begun on other threads keep
        their own labels."""
        stack = getattr(self._labels, "stack", None)
        if stack is None:
            stack = self._labels.stack = []
        stack.append(label)

    def pop_label(self) -> None:
        stack = getattr(self._labels, "stack", None)
        if stack:
            stack.pop()

    def _label(self) -> str | None:
        stack = getattr(self._labels, "stack", None)
        return stack[-1] if stack else None

    # -- capture (graph hooks; the capture's life is `runtime.capture`'s) ---------------------
    def before_capture_begin(self, graph) -> tuple:
        """The first capture on a device: confirm the argument-struct layouts there first.
        Returns the pin policy's young tensors of now, where the probe's objects could push
        them out of the young generations before the capture begins."""
        if not self.active:
            return ()
        try:
            device = torch.cuda.current_device()
            young = ()
            if self.pinner is not None and device not in self.capture.layouts:
                young = tuple(self.pinner.young_tensor_refs())
            self.capture.prepare(device)
            return young
        except Exception as err:
            self._internal_error(err)
            return ()

    def capture_begin(self, graph, pool, early: tuple = ()) -> int | None:
        """A capture began: its id, which the hooks report back to `graph_gone` (None: not
        watched). `early`: what `before_capture_begin` returned."""
        try:
            old = hooks.graph_state(graph)
            if old is not None:  # re-capture of the same object: the old graph is gone
                self._forget(old.info.id)
                hooks.set_graph_state(graph, None)
            young = tuple(early or ())
            if self.pinner is not None:
                young += tuple(self.pinner.young_tensor_refs())
            # the pool is known here only when shared (graph.pool() is not callable mid-capture);
            # a fresh pool cannot hold blocks of earlier graphs, so None loses nothing
            label = self._label()
            pending = self.capture.begin(next(self._ids), label, pool, young)
            hooks.side(graph, make=True).pending = pending
            return pending.gid
        except Exception as err:
            self._internal_error(err)
            return None

    def before_capture_end(self, graph, handle: int | None = None):
        """The capture is ending: walk its graph (`handle`, from torch's capture-end hook, or
        the graph still being captured on the current stream)."""
        found = hooks.side(graph)
        if found is None or found.pending is None or not self.active:
            return None
        try:
            # the pinner's young tensors: those of now, listed before the walk and the log drain
            # allocate, and the tensors that were young when the capture began
            young = None
            if self.pinner is not None:
                young = self.pinner.young_tensors()
                earlier = [t for t in (r() for r in found.pending.young) if t is not None]
                young = earlier + young if young is not None else earlier or None
            return self.capture.walk(handle), young
        except Exception as err:
            self._internal_error(err)
            return None

    def after_capture_end(self, graph, walked) -> None:
        pending = self._take_pending(graph)
        if pending is None:
            return
        try:
            if not self.active:  # stopped meanwhile: the capture's hooks go, nothing is watched
                self.capture.failed(pending)
                return
            walk, young = walked if walked is not None else (None, None)
            pool = tuple(int(x) for x in graph.pool())
            captured = self.capture.ended(pending, pool, walk)
            if captured is None:
                return
            state, stats = captured
            self.graph_stats[pending.gid] = stats
            hooks.set_graph_state(graph, state)
            if self.pinner is not None:
                self.pinner.pin(state, young, hooks.retainer(graph, self.hooks.seams))
        except Exception as err:
            self._internal_error(err)

    def capture_failed(self, graph) -> None:
        """capture_end raised (an invalidated capture): no graph to watch."""
        pending = self._take_pending(graph)
        if pending is not None:
            try:
                self.capture.failed(pending)
            except Exception as err:
                self._internal_error(err)

    @staticmethod
    def _take_pending(graph):
        found = hooks.side(graph)
        if found is None:
            return None
        pending, found.pending = found.pending, None
        return pending

    def reset(self, graph) -> None:
        state = hooks.graph_state(graph)
        if state is not None:
            self._forget(state.info.id)
            hooks.set_graph_state(graph, None)

    def graph_gone(self, gid: int) -> None:
        """The graph captured as `gid` was reset or collected."""
        self._forget(gid)

    def _forget(self, gid: int) -> None:
        try:
            self.pool_orders.forget(gid)
            self.judge.forget(gid)
            self.tracker.forget(gid)
            self.recorder.forget(gid)
            if self.pinner is not None:
                self.pinner.release(gid)
        except Exception as err:
            self._internal_error(err)

    # -- replay ------------------------------------------------------------------------------
    def before_replay(self, graph, state) -> None:
        """A watched graph's replay that the judge `needs` to see, before its launch."""
        if not self.active:
            return
        try:
            if self.pinner is not None:
                self.pinner.flush()
            verdict = self.judge.verdict(state)
            findings = self._suppress(verdict.findings)
            stop = bool(findings) and self.policy.stops_replay
            self._say_kept(state.info, self.judge.decided(state, stop))
            self._note_replay(state.info, verdict.judged, findings, stop)
        except Exception as err:
            self._internal_error(err)
            return
        act(self.policy, findings, self._new(findings), self._say)

    def _note_replay(self, info, judged: bool, findings: list[Finding], stop: bool) -> None:
        """The graph's stats and the timeline of a judged replay."""
        if judged:
            self.graph_stats[info.id].replays_judged += 1
        if findings or judged:
            found_at = findings[0].found_at if findings else time.time()
            self.timeline.replay(
                info.id, info.label, info.device, stream_handle(), len(findings), stop, found_at
            )

    def _say_kept(self, info, kept: int) -> None:
        if kept:
            self._say(
                f"graph #{info.id} '{info.label}' was stopped before its first launch under "
                f"{driverwatch.backend()}, which allocates a graph's memory when it launches: "
                f"freeing its outputs would abort the process, so the {kept} output "
                "storage(s) Python holds are kept alive until the process exits"
            )

    def _suppress(self, findings: list[Finding]) -> list[Finding]:
        """The findings no suppression matches; the others are counted (once each)."""
        if not findings or not self.suppressions:
            return findings
        kept, suppressed = suppressions.split(self.suppressions, findings)
        for name, f in suppressed:
            key = (*f.key, f.kind)
            if key not in self._reported:
                self._reported.add(key)
                self.suppressed.append((name, f))
        return kept

    def _new(self, findings: list[Finding]) -> list[Finding]:
        """The findings not reported before, now kept in `findings` (once each)."""
        new = []
        for f in findings:
            key = (*f.key, f.kind)
            if key not in self._reported:
                self._reported.add(key)
                self.findings.append(f)
                new.append(f)
        return new

    def _phase_changed(self) -> None:
        try:
            self.timeline.phase(*self.context.current())
        except Exception as err:
            self._internal_error(err)

    # -- errors and messages -----------------------------------------------------------------
    def _say(self, text: str) -> None:
        prefix = f"[rank {self.rank}] " if self.rank is not None else ""
        sys.stderr.write(f"{prefix}graphsan: {text}\n")

    def _internal_error(self, err: BaseException) -> None:
        if self._failed:
            return  # one warning: later errors (other threads, callbacks in flight) stay quiet
        self._failed = True
        where = "".join(traceback.format_exception_only(type(err), err)).strip()
        tb = traceback.extract_tb(err.__traceback__)
        site = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
        self.disabled_reason = f"internal error: {where}{site}"
        self._say(
            f"{self.disabled_reason}; the sanitizer disables itself and the program continues"
        )
        try:
            self.stop()
        except Exception:
            self.active = False

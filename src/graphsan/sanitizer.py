"""The sanitizer: wires graph hooks and allocator events to the tracker and applies the policy.

At capture end it reads the graph being captured (`_driver`), finds the device addresses in its
arguments and confirms them against the allocator's incrementally kept view (`memory`,
`allocview`; no per-capture snapshot), and registers the graph's watched blocks. At replay, a
graph whose watched memory changed is judged *before* launch; the policy decides what happens to
findings:

- "raise": `StaleMemoryError` from `replay()`; the graph is not launched (and stays blocked);
- "warn": each finding is printed once, the replay goes on;
- "record": findings are only collected (`san.findings`, `san.report()`);
- "pin": referenced memory with a Python-visible owner is kept alive for the graph's lifetime;
  what cannot be pinned falls back to "raise" (see `graphsan.pin`).

Any internal error disables the sanitizer with one message; the user's program runs on.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import time
import traceback
import weakref
from typing import Any

import torch

from graphsan import capture
from graphsan.analysis import Tracker, references
from graphsan.context import Context, python_stack
from graphsan.memory import AllocatorWatch
from graphsan.report import (
    Finding,
    GraphInfo,
    Report,
    StaleMemoryError,
    display_path,
    format_finding,
)
from graphsan.timeline import Timeline, node_summary

POLICIES = ("raise", "warn", "record", "pin")
_PENDING = "_graphsan_pending"


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(
            f"graphsan: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}"
        )
    return policy


def _stream() -> int | None:
    """The current CUDA stream's handle (the timeline's track), None where it cannot be read."""
    try:
        return int(torch.cuda.current_stream().cuda_stream)
    except Exception:
        return None


def rank_from_env() -> int | None:
    """The distributed rank under torchrun (None for a single process)."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return int(os.environ.get("RANK", "0"))
    except ValueError:
        pass
    return None


class Sanitizer:
    """One per process (see `graphsan.enable`)."""

    def __init__(
        self, policy: str = "raise", context: Context | None = None, alloc_stacks: bool = True
    ):
        self.policy = check_policy(policy)
        self.context = context or Context()
        self.tracker = Tracker()
        self.findings: list[Finding] = []
        self.graph_stats: dict[int, dict[str, Any]] = {}  # by graph id, in capture order
        self.rank = rank_from_env()
        self.active = False
        self.disabled_reason: str | None = None
        self.report_path: str | None = None
        self.memory = AllocatorWatch(self.tracker, self.context, self._internal_error, alloc_stacks)
        self.timeline = Timeline(self.rank)
        self.memory.timeline = self.timeline
        self.hooks = capture.GraphHooks(self)
        self.pinner = None  # set by the pin policy
        self._ids = itertools.count(1)
        self._labels: list[str] = []
        self._reported: set[tuple[int, int, str]] = set()

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
        self.memory.start()
        self.hooks.install()
        self.active = True
        return self

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.pinner is not None:
            self.pinner.detach()
        self.hooks.uninstall()
        self.memory.stop()
        with contextlib.suppress(ValueError):
            self.context.on_phase_change.remove(self._phase_changed)
        self.context.stop()

    def report(self) -> Report:
        pinned = self.pinner.summary() if self.pinner is not None else {}
        graphs = list(self.graph_stats.values())
        tl = self.timeline
        return Report(
            list(self.findings), graphs, self.rank, self.policy, pinned, list(tl.events), tl.dropped
        )

    # -- labels -----------------------------------------------------------------------------
    def push_label(self, label: str) -> None:
        self._labels.append(label)

    def pop_label(self) -> None:
        self._labels.pop()

    # -- capture (graph hooks) ----------------------------------------------------------------
    def capture_begin(self, graph, pool) -> None:
        try:
            old = capture.graph_state(graph)
            if old is not None:  # re-capture of the same object: the old graph is gone
                self._forget(old.info.id)
                capture.set_graph_state(graph, None)
            gid = next(self._ids)
            site = python_stack(limit=6)
            if self._labels:
                label = self._labels[-1]
            elif site:
                label = f"{os.path.basename(site[-1][0])}:{site[-1][1]}"
            else:
                label = f"graph#{gid}"
            tag = self.memory.capture_started(gid, torch.cuda.current_stream().cuda_stream)
            graph.__dict__[_PENDING] = (gid, label, site, torch.cuda.current_device(), tag)
            self.timeline.capture_begun(gid)
            # the pool is known here only when shared (graph.pool() is not callable mid-capture);
            # a fresh pool cannot hold blocks of earlier graphs, so None loses nothing
            self.memory.capture_pool = tuple(int(x) for x in pool) if pool is not None else None
            weakref.finalize(graph, self._forget, gid)
        except Exception as err:
            self._internal_error(err)

    def before_capture_end(self, graph):
        pending = graph.__dict__.get(_PENDING)
        if pending is None or not self.active:
            return None
        try:
            from graphsan import _driver

            t0 = time.perf_counter()
            handle = _driver.capturing_graph(torch.cuda.current_stream().cuda_stream)
            nodes, stats = _driver.walk(handle)
            return nodes, stats, time.perf_counter() - t0
        except Exception as err:
            self._internal_error(err)
            return None

    def after_capture_end(self, graph, walked) -> None:
        self.memory.capture_pool = None
        pending = graph.__dict__.pop(_PENDING, None)
        if pending is None or not self.active:
            return
        gid, label, site, device, tag = pending
        try:
            pool = tuple(int(x) for x in graph.pool())
            t0 = time.perf_counter()
            self.memory.capture_ended(tag, pool)
        except Exception as err:
            self._internal_error(err)
            return
        if walked is None:
            return
        try:
            from graphsan import _driver

            young = self.pinner.young_objects() if self.pinner is not None else None
            nodes, stats, walk_s = walked
            view = self.memory.view(device, sync=False)
            t1 = time.perf_counter()
            refs = references(nodes, view, foreign=lambda v: _driver.address_range(v) is not None)
            t2 = time.perf_counter()
            info = GraphInfo(gid, label, site, pool, device)
            state = self.tracker.add_graph(info, refs, view)
            capture.set_graph_state(graph, state)
            t3 = time.perf_counter()
            captured_at = self.timeline.captured(gid, label, device, _stream())
            analyse_s = walk_s + t3 - t0
            self.graph_stats[gid] = {
                "id": gid,
                "label": label,
                "capture_site": [list(f) for f in site],
                "pool": list(pool),
                "nodes": stats.nodes,
                "kernels": stats.kernels,
                "copies": stats.copies,
                "unreadable_nodes": stats.unreadable,
                "child_graphs": stats.child_graphs,
                **state.stats,
                "analysis_ms": round(analyse_s * 1e3, 3),
                # where the analysis time goes: reading the graph through the driver, bringing
                # the allocator view up to date, confirming addresses, registering the blocks
                "analysis_ms_by_stage": {
                    "walk": round(walk_s * 1e3, 3),
                    "allocator_view": round((t1 - t0) * 1e3, 3),
                    "references": round((t2 - t1) * 1e3, 3),
                    "tracker": round((t3 - t2) * 1e3, 3),
                },
                "replays_judged": 0,
                "captured_at": captured_at,
                "node_summary": node_summary(nodes),
            }
            if self.pinner is not None:
                self.pinner.pin(state, young)
        except Exception as err:
            self._internal_error(err)

    def capture_failed(self, graph) -> None:
        """capture_end raised (an invalidated capture): no graph to watch."""
        self.memory.capture_pool = None
        pending = graph.__dict__.pop(_PENDING, None)
        if pending is not None:
            try:
                self.memory.capture_failed(pending[4])
            except Exception as err:
                self._internal_error(err)

    def reset(self, graph) -> None:
        state = capture.graph_state(graph)
        if state is not None:
            self._forget(state.info.id)
            capture.set_graph_state(graph, None)

    def _forget(self, gid: int) -> None:
        try:
            self.tracker.forget(gid)
            if self.pinner is not None:
                self.pinner.release(gid)
        except Exception as err:
            self._internal_error(err)

    # -- replay ------------------------------------------------------------------------------
    def before_replay(self, graph, state) -> None:
        if not self.active:
            return
        try:
            from graphsan import _driver

            if self.pinner is not None:
                self.pinner.flush()
            if not any(wb.freed is not None for wb in state.blocks.values()):
                state.dirty = False  # nothing the graph uses was freed: nothing to judge
                return
            as_of = self.tracker.free_seq  # frees after this are not in the view yet
            view = self.memory.view(state.info.device)
            findings = self.tracker.judge(state.info.id, view, _driver.is_mapped, as_of)
            self.graph_stats[state.info.id]["replays_judged"] += 1
            self._annotate(findings)
            info, stop = state.info, bool(findings) and self.policy in ("raise", "pin")
            t = self.timeline.replay(
                info.id, info.label, info.device, _stream(), len(findings), stop
            )
            for f in findings:
                wb = state.blocks.get(f.block_address)
                f.freed_at = wb.freed.time if wb is not None and wb.freed is not None else None
                f.found_at = t
        except Exception as err:
            self._internal_error(err)
            return
        if findings:
            self._apply_policy(state, findings)

    def _annotate(self, findings: list[Finding]) -> None:
        release = self.memory.last_release
        for f in findings:
            f.rank = self.rank
            if f.kind == "unmapped" and release is not None:
                stack, phase, step = release
                where = f"{display_path(stack[-1][0])}:{stack[-1][1]}" if stack else "?"
                f.now += f"; cached memory was released by empty_cache() at {where} (phase {phase}, step {step})"

    def _apply_policy(self, state, findings: list[Finding]) -> None:
        new = []
        for f in findings:
            key = (*f.key, f.kind)
            if key not in self._reported:
                self._reported.add(key)
                self.findings.append(f)
                new.append(f)
        if self.policy in ("raise", "pin"):
            state.dirty = True  # stays blocked: every later replay raises again
            raise StaleMemoryError(findings)
        if self.policy == "warn":
            for f in new:
                self._say(format_finding(f))

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

"""The sanitizer: wires graph hooks and allocator events to the tracker and applies the policy.

At capture end it reads the graph being captured (`cuda.driver`), finds the device addresses in
its arguments (`core.scan`) and confirms them against the allocator view (`cuda.allocator`,
`core.memory_map`; no per-capture snapshot), and registers the graph's watched blocks
(`core.tracker`). At replay, a
graph whose watched memory changed is judged *before* launch; the policy decides what happens to
findings:

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
import os
import sys
import time
import traceback
import weakref

import torch

from graphsan.context import Context, python_stack
from graphsan.core.order import PoolOrder
from graphsan.core.records import Finding, GraphInfo, GraphStats, Judged
from graphsan.core.replay import ReplayOrders
from graphsan.core.scan import (
    TABLE_BLOCK,
    TABLE_BUDGET,
    references,
    table_candidates,
    table_references,
)
from graphsan.core.tracker import Tracker
from graphsan.cuda import hooks
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.host import HostWatch
from graphsan.policies import POLICIES, Policy
from graphsan.policies.pin import Pinner
from graphsan.report import Report, StaleMemoryError, format_finding
from graphsan.report.timeline import Timeline, node_summary

__all__ = ["POLICIES", "Policy", "Sanitizer", "check_policy", "rank_from_env"]

_PENDING = "_graphsan_pending"
_YOUNG = "_graphsan_young"  # weak references to the young tensors at capture begin


def check_policy(policy: str | Policy) -> Policy:
    return Policy.parse(policy)


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
        self,
        policy: str | Policy = Policy.RAISE,
        context: Context | None = None,
        alloc_stacks: bool = True,
    ):
        policy = Policy.parse(policy)
        self.context = context or Context()
        self.tracker = Tracker()
        self.findings: list[Finding] = []
        self.graph_stats: dict[int, GraphStats] = {}  # by graph id, in capture order
        self.rank = rank_from_env()
        self.active = False
        self.disabled_reason: str | None = None
        self._failed = False  # an internal error disabled it
        # pointer tables read at capture end: blocks up to table_block bytes, table_budget
        # bytes per graph (0 turns the reading off)
        self.table_block = TABLE_BLOCK
        self.table_budget = TABLE_BUDGET
        self.report_path: str | None = None
        self.memory = AllocatorWatch(self.tracker, self.context, self._internal_error, alloc_stacks)
        self.host = HostWatch(self.tracker, self.memory._free_event, self._internal_error)
        self.pool_orders = ReplayOrders(self.tracker, self.memory.site_frames)
        self.tracker.host_owner = self.host.owner
        self.tracker.order_reads = self.pool_orders.judges
        self.timeline = Timeline(self.rank)
        self.memory.timeline = self.timeline
        self.hooks = hooks.GraphHooks(self)
        self.pinner: Pinner | None = None  # while the policy is pin
        self._policy = Policy.RAISE
        self.policy = policy
        self._ids = itertools.count(1)
        self._labels: list[str] = []
        self._reported: set[tuple[int, int, str]] = set()

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

    # -- replay orders (a change applies to graphs captured from now on) ---------------------
    @property
    def replay_order(self) -> bool:
        """Follow the replay order of graphs sharing a pool."""
        return self.pool_orders.enabled

    @replay_order.setter
    def replay_order(self, value: bool) -> None:
        self.pool_orders.enabled = value

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
        self.memory.start()
        self.host.start()
        self.hooks.install()
        if self.pinner is not None:
            self.pinner.attach()
        self.active = True
        return self

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.pinner is not None:
            self.pinner.detach()
        self.hooks.uninstall()
        self.host.stop()
        self.memory.stop()
        with contextlib.suppress(ValueError):
            self.context.on_phase_change.remove(self._phase_changed)
        self.context.stop()

    def report(self) -> Report:
        pinned = self.pinner.summary() if self.pinner is not None else {}
        graphs = [g.to_dict() for g in self.graph_stats.values()]
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
            old = hooks.graph_state(graph)
            if old is not None:  # re-capture of the same object: the old graph is gone
                self._forget(old.info.id)
                hooks.set_graph_state(graph, None)
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
            if self.pinner is not None:
                graph.__dict__[_YOUNG] = self.pinner.young_tensors()
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
            from graphsan.cuda import driver

            # the pinner's young objects: those of now, listed before the walk and the log drain
            # allocate, and the tensors that were young when the capture began
            young = None
            begun = graph.__dict__.pop(_YOUNG, ())
            if self.pinner is not None:
                young = self.pinner.young_objects()
                earlier = [t for t in (r() for r in begun) if t is not None]
                young = earlier + young if young is not None else earlier or None
            t0 = time.perf_counter()
            handle = driver.capturing_graph(torch.cuda.current_stream().cuda_stream)
            nodes, stats = driver.walk(handle)
            return nodes, stats, time.perf_counter() - t0, young
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
            carved = self.memory.capture_ended(tag, pool)
        except Exception as err:
            self._internal_error(err)
            return
        if walked is None:
            return
        try:
            from graphsan.cuda import driver

            nodes, stats, walk_s, young = walked
            view = self.memory.view(device, sync=False)
            t1 = time.perf_counter()
            refs = references(nodes, view, foreign=lambda v: driver.address_range(v) is not None)
            indirect, tables_read = self._indirect(refs, view, pool)
            refs += indirect
            t2 = time.perf_counter()
            info = GraphInfo(gid, label, tuple(site), pool, device)
            copies = [r.address for r in refs if isinstance(r.param, str)]
            outside = [a for a in copies if view.locate(a) is None and driver.is_host(a)]
            if outside:  # pinned host memory: blocks not recorded at pin_memory() are looked up
                self.host.find(outside)
            state = self.tracker.add_graph(info, refs, view, host=self.host.locate)
            hooks.set_graph_state(graph, state)
            self.pool_orders.add_capture(info, carved, refs, view)
            t3 = time.perf_counter()
            self.graph_stats[gid] = GraphStats(
                gid,
                label,
                info.capture_site,
                pool,
                stats,
                state.counts,
                len(state.blocks),
                self.timeline.captured(gid, label, device, _stream()),
                node_summary(nodes),
                walk_s=walk_s,
                allocator_view_s=t1 - t0,
                references_s=t2 - t1,
                tracker_s=t3 - t2,
                tables_read=tables_read,
                indirect=len(indirect),
            )
            if self.pinner is not None:
                self.pinner.pin(state, young)
        except Exception as err:
            self._internal_error(err)

    def _indirect(self, refs: list, view, pool) -> tuple[list, int]:
        """References read from the small buffers the kernel arguments point at (pointer
        tables), after the capture ended (see `core.scan.table_candidates`), and how many
        blocks were read."""
        if self.table_budget <= 0:
            return [], 0
        tables = table_candidates(refs, view, pool, self.table_block, self.table_budget)
        requested = view.requested
        contents = self._read_tables(
            [(addr, min(size, requested.get(addr, size))) for addr, size, _ in tables]
        )
        out = []
        for (addr, _, via), data in zip(tables, contents, strict=True):
            out += table_references(addr, data, via, view)
        return out, sum(1 for data in contents if data)

    def _read_tables(self, spans: list[tuple[int, int]]) -> list[bytes]:
        """The tables' bytes, or empty ones where they cannot be read now (a capture running on
        this stream, a driver error): an unread table hides what it names, nothing more."""
        if not spans or torch.cuda.is_current_stream_capturing():
            return [b""] * len(spans)
        from graphsan.cuda import driver

        try:
            return driver.read_device(spans, torch.cuda.current_stream().cuda_stream)
        except driver.DriverError:
            return [b""] * len(spans)

    def _reread_tables(self, state) -> None:
        """Before judging: the tables that named a freed block are read again, and a reference
        the table no longer holds (it was rewritten) is dropped."""
        stale = {}  # freed block -> its indirect references
        for addr, wb in state.blocks.items():
            if wb.freed is not None:
                refs = state.refs.get(addr, ())
                if any(r.through is not None for r in refs):
                    stale[addr] = refs
        if not stale:
            return
        tables = sorted(
            {
                r.through
                for refs in stale.values()
                for r in refs
                if r.through is not None
                and r.through in state.blocks
                and state.blocks[r.through].freed is None  # a freed table is a finding itself
            }
        )
        spans = [(t, state.blocks[t].size) for t in tables]
        words = {}
        for t, data in zip(tables, self._read_tables(spans), strict=True):
            if data:
                words[t] = {
                    int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data) - 7, 8)
                }
        for addr, refs in stale.items():
            keep = [r for r in refs if r.through not in words or r.address in words[r.through]]
            if len(keep) != len(refs):
                self.tracker.retain(state.info.id, addr, keep)

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
        state = hooks.graph_state(graph)
        if state is not None:
            self._forget(state.info.id)
            hooks.set_graph_state(graph, None)

    def _forget(self, gid: int) -> None:
        try:
            self.pool_orders.forget(gid)
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
            from graphsan.cuda import driver

            if self.pinner is not None:
                self.pinner.flush()
            info = state.info
            findings = []
            hazards = self.pool_orders.hazards(state)
            if hazards:
                phase, step = self.context.current()
                judged = Judged(self.rank, time.time())
                findings = self.pool_orders.findings(info, hazards, phase, step, judged)
            if state.dirty and not any(wb.freed is not None for wb in state.blocks.values()):
                state.dirty = False  # nothing the graph uses was freed: nothing to judge
            judging = state.dirty
            if judging:
                self._reread_tables(state)
                as_of = self.tracker.free_seq  # frees after this are not in the view yet
                view = self.memory.view(info.device)
                judged = Judged(self.rank, time.time(), self.memory.last_release)
                findings += self.tracker.judge(info.id, view, driver.is_mapped, as_of, judged)
                self.graph_stats[info.id].replays_judged += 1
            if findings or judging:
                stop = bool(findings) and self.policy.stops_replay
                found_at = findings[0].found_at if findings else time.time()
                self.timeline.replay(
                    info.id, info.label, info.device, _stream(), len(findings), stop, found_at
                )
        except Exception as err:
            self._internal_error(err)
            return
        if findings:
            self._apply_policy(state, findings)

    def _apply_policy(self, state, findings: list[Finding]) -> None:
        new = []
        for f in findings:
            key = (*f.key, f.kind)
            if key not in self._reported:
                self._reported.add(key)
                self.findings.append(f)
                new.append(f)
        if self.policy.stops_replay:
            state.dirty = True  # stays blocked: every later replay raises again
            raise StaleMemoryError(findings)
        if self.policy is Policy.WARN:
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

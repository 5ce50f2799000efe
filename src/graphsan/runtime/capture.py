"""A capture's life in graphsan, from its begin to the graph's watched memory (`GraphState`) and
what capturing it cost and found (`GraphStats`).

`begin` names the capture (a `PendingCapture`), tells the memory watch which pool it allocates
from and starts recording what it runs (`cuda.baked`). Just before the original `capture_end`,
`walk` reads the graph still being captured (`cuda.driver`). A capture that fails is
`failed`: nothing of it is watched. Otherwise, after it, `ended` ends the recording and takes
the steps in order:

1. the allocator view is brought up to date and gives the capture's carves (`cuda.allocator`);
2. the device addresses in the nodes' arguments are confirmed against it (`core.scan.references`;
   addresses outside it that the driver knows are foreign memory);
3. the small blocks they point at are read as pointer tables, after the capture ended
   (`core.scan.table_candidates`, `table_references`): what a table names is watched too;
4. copies from host memory the allocator does not own are looked up among the live pinned host
   storages (`cuda.host`);
5. the tracker registers the blocks to watch (`core.tracker`);
6. the replay judge takes the graph with what its capture baked beside addresses (modes,
   hyperparameters, entries: `cuda.baked`), and the capture joins its pool's replay order
   (`core.judgement`, `core.pool_orders`).

At replay, the judge (`core.judgement`) reads again the tables that named a freed block.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from graphsan.core.argstructs import FAMILIES, NOT_CALIBRATED, Layouts
from graphsan.core.graph_state import GraphState
from graphsan.core.judgement import ReplayJudge
from graphsan.core.memory_source import CaptureMemory, ProbeMemory
from graphsan.core.records import (
    DEFAULT_POOL,
    AllocArgs,
    CopyArgs,
    Frame,
    GraphId,
    GraphInfo,
    GraphStats,
    KernelArgs,
    PoolId,
    WalkStats,
)
from graphsan.core.scan import (
    TABLE_BLOCK,
    TABLE_BUDGET,
    references,
    table_candidates,
    table_references,
)
from graphsan.core.timeline import Timeline, node_summary
from graphsan.core.tracker import Tracker
from graphsan.cuda.baked import BakedRecorder
from graphsan.cuda.context import python_stack
from graphsan.cuda.host import HostWatch

__all__ = ["CaptureAnalysis", "PendingCapture", "Walk", "stream_handle"]


def stream_handle() -> int | None:
    """The current CUDA stream's handle (the timeline's track), None where it cannot be read."""
    try:
        return int(torch.cuda.current_stream().cuda_stream)
    except Exception:
        return None


@dataclass(frozen=True)
class PendingCapture:
    """A capture between its begin and its end: its graph's id and label, where it began (user
    frames), the device, its entries' tag in the allocator's log, the pool it shares (None: a
    pool of its own), and the pin policy's young tensors at its begin (weak references)."""

    gid: GraphId
    label: str
    site: tuple[Frame, ...]
    device: int
    tag: str
    pool: PoolId | None
    young: tuple = ()


@dataclass
class Walk:
    """The graph still being captured, as `cuda.driver.walk` read it, and how long that took."""

    nodes: list[KernelArgs | CopyArgs]
    stats: WalkStats
    seconds: float


@dataclass(eq=False)
class CaptureAnalysis:
    """Turns each capture's end into a watched graph. Reading pointer tables is bounded: blocks
    up to `table_block` bytes, `table_budget` bytes per graph (0 turns the reading off)."""

    memory: CaptureMemory
    tracker: Tracker
    host: HostWatch
    judge: ReplayJudge
    timeline: Timeline
    recorder: BakedRecorder  # what captures bake beside addresses
    table_block: int = TABLE_BLOCK
    table_budget: int = TABLE_BUDGET
    # per device: the argument-struct layouts the startup probe confirmed, and its report
    layouts: dict[int, Layouts] = field(default_factory=dict, init=False)
    calibration: dict[str, dict] = field(default_factory=dict, init=False)

    def prepare(self, device: int) -> None:
        """Before the first capture on `device` begins: confirm PyTorch's argument-struct
        layouts there (`graphsan.cuda.calibrate`), once. Never raises: what fails stays
        unconfirmed, and the scan keeps reading those structs word by word."""
        if device in self.layouts:
            return
        why = self.memory.probe_refused()
        if why is not None:
            self.layouts[device] = Layouts(why=tuple((f, why) for f in FAMILIES))
            self.calibration[str(device)] = {"families": self.layouts[device].summary()}
            return
        memory: ProbeMemory = self.memory  # a watch that lets the probe run answers it
        try:
            if torch.cuda.is_current_stream_capturing() or memory.probe_waits():
                # a capture in progress, or eager allocations routed to a graph pool (CUDA-graph
                # trees' warm-up): the probe's memory must not land there, nor its allocations
                # and synchronisation invalidate a capture; the next one tries
                return
            from graphsan.cuda import driver
            from graphsan.cuda.calibrate import calibrate

            try:
                layouts, seconds, kept = calibrate(
                    lambda stream: self._walk_handle(driver.capturing_graph(stream))[0],
                    memory.release_pool,
                )
            finally:
                memory.captured_unseen()
        except Exception as err:
            why = f"the probe failed: {type(err).__name__}: {err}"[:200]
            layouts, seconds = Layouts(why=tuple((f, why) for f in FAMILIES)), 0.0
            kept = why
        self.layouts[device] = layouts
        self.calibration[str(device)] = {
            "torch": layouts.torch,
            "probe_ms": round(seconds * 1e3, 1),
            "families": layouts.summary(),
            # the probe's pool given back to the driver, or why its memory stayed cached
            "probe_memory": "released" if kept is None else kept,
        }

    def begin(
        self, gid: GraphId, label: str | None, pool: PoolId | None, young: tuple = ()
    ) -> PendingCapture:
        """A capture began on the current stream (into `pool`, where shared): its record,
        labelled `label` or by where it began. Recording what it runs starts here."""
        site = tuple(python_stack(limit=6))
        if label is None:
            label = f"{os.path.basename(site[-1][0])}:{site[-1][1]}" if site else f"graph#{gid}"
        stream = torch.cuda.current_stream().cuda_stream
        pool = tuple(int(x) for x in pool) if pool is not None else None
        tag = self.memory.capture_started(gid, stream, pool)
        pending = PendingCapture(gid, label, site, torch.cuda.current_device(), tag, pool, young)
        self.timeline.capture_begun(gid)
        self.recorder.begin(gid)
        return pending

    def failed(self, pending: PendingCapture) -> None:
        """The capture failed (or graphsan stopped meanwhile): nothing of it is watched."""
        self.recorder.end(pending.gid)
        self.memory.capture_failed(pending.tag)

    def walk(self, handle: int | None = None) -> Walk:
        """Read the captured graph `handle` (live in torch's capture-end hook), or without one
        the graph being captured on the current stream (call before `capture_end`): through
        graphsan's library where it is loaded, else (or where it fails on this graph) through
        cuda-bindings."""
        from graphsan.cuda import driver

        t0 = time.perf_counter()
        if handle is None:
            handle = driver.capturing_graph(torch.cuda.current_stream().cuda_stream)
        nodes, stats = self._walk_handle(handle)
        return Walk(nodes, stats, time.perf_counter() - t0)

    def _walk_handle(self, handle) -> tuple[list, WalkStats]:
        from graphsan.cuda import driver
        from graphsan.cuda.graphwalk import WalkError

        compiled = self.memory.graph_walk()
        if compiled is not None:
            try:
                nodes, stats = compiled.walk(int(handle), _describe)
                stats.source = "compiled"
                return nodes, stats
            except WalkError as err:
                why = f"cuda-bindings (the compiled walk failed: {err})"
        else:
            why = "cuda-bindings"
        nodes, stats = driver.walk(handle)
        stats.source = why
        return nodes, stats

    def ended(
        self, pending: PendingCapture, pool: PoolId, walk: Walk | None
    ) -> tuple[GraphState, GraphStats] | None:
        """The capture ended into `pool`: its graph's state and stats, or None without a walk
        (the recording and the allocator's bookkeeping of the capture end either way)."""
        recording = self.recorder.end(pending.gid)
        t0 = time.perf_counter()
        info = GraphInfo(pending.gid, pending.label, pending.site, pool, pending.device)
        carved = self.memory.capture_ended(pending.tag, pool)
        if walk is None:
            return None
        from graphsan.cuda import driver

        own = [(n.address, n.nbytes) for n in walk.nodes if isinstance(n, AllocArgs)]
        own_pool = info.pool if info.pool not in (None, DEFAULT_POOL) else (-2, info.id)
        view = self.memory.view(info.device, sync=False, own=own, own_pool=own_pool)
        t1 = time.perf_counter()
        refs = references(
            walk.nodes,
            view,
            foreign=lambda v: driver.address_range(v) is not None,
            layouts=self.layouts.get(info.device, NOT_CALIBRATED),
        )
        indirect, tables_read = self._indirect(refs, view, info.pool)
        refs += indirect
        t2 = time.perf_counter()
        copies = [r.address for r in refs if isinstance(r.param, str)]
        outside = [a for a in copies if view.locate(a) is None and driver.is_host(a)]
        if outside:  # pinned host memory: blocks not recorded at pin_memory() are looked up
            self.host.find(outside)
        state = self.tracker.add_graph(info, refs, view, host=self.host.pinned.locate, own=own)
        self.judge.watch(state, self.recorder.baked(recording, state))
        self.judge.join_order(info, carved, refs, view)
        self.judge.footprint(info, carved)
        t3 = time.perf_counter()
        stats = GraphStats(
            info.id,
            info.label,
            info.capture_site,
            info.pool,
            walk.stats,
            state.counts,
            len(state.blocks),
            self.timeline.captured(info.id, info.label, info.device, stream_handle()),
            node_summary(walk.nodes),
            walk_s=walk.seconds,
            allocator_view_s=t1 - t0,
            references_s=t2 - t1,
            tracker_s=t3 - t2,
            tables_read=tables_read,
            indirect=len(indirect),
        )
        return state, stats

    # -- pointer tables -----------------------------------------------------------------------
    def _indirect(self, refs: list, view, pool) -> tuple[list, int]:
        """References read from the small buffers the kernel arguments point at (pointer
        tables), after the capture ended (see `core.scan.table_candidates`), and how many
        blocks were read."""
        if self.table_budget <= 0:
            return [], 0
        tables = table_candidates(refs, view, pool, self.table_block, self.table_budget)
        requested = view.requested
        contents = self.memory.read_device(
            [(addr, min(size, requested.get(addr, size))) for addr, size, _ in tables]
        )
        out = []
        for (addr, _, via), data in zip(tables, contents, strict=True):
            out += table_references(addr, data, via, view)
        return out, sum(1 for data in contents if data)


def _describe(handle: int, is_kernel: bool) -> tuple[str, tuple[int, ...]]:
    """A kernel's demangled name and parameter offsets, looked up once per function."""
    from graphsan.cuda import driver

    info = driver.function_info(handle, is_kernel)
    return info.name, info.offsets

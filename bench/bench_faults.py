"""Fault injection: does graphsan stop every replay that would touch memory made stale, and only those?

    python bench/bench_faults.py [--trials 1000] [--workers 16] [--time-limit 450] [--seed 0]
                                 [--kinds free,set,...] [--json out.json]

Each trial trains the lab model (tiny preset, per-module CUDA graphs for attn, mamba, moe_router
and moe_preprocess, validation every 3 steps) under `graphsan.enable(policy="raise")`, beside
what a training job also has: a data-loader copy from a pinned host batch into a static device
input, a gather through a device table of buffer addresses, three graphs that share one memory
pool and must replay in capture order, and a second model graphed with
`torch.cuda.make_graphed_callables` (2 MLP blocks, hidden 512, 1,024 tokens, forward and
backward graphs in one pool, its captured backward allocating on the autograd worker thread),
trained one step with its own AdamW per lab step and run eagerly in eval mode on validation
steps. After a random step one fault is injected into memory some live graph uses, or, in
control trials, nothing:

    free          a graphed stage's static input is replaced by a new tensor; the old one dies
    free-reuse    the same, then new tensors of the same size take the freed block
    resize        a parameter the graphs read is resized (`resize_`), which moves its storage
    data-rebind   `p.data = p.data.clone()` on such a parameter: same values, new address
    set           `p.set_(clone)` under no_grad
    empty-cache   a freed static input, then `torch.cuda.empty_cache()`
    host-free     the pinned host batch the loader graph copies from is freed and re-pinned
    table-free    a buffer named in the address table is freed and its block reused
    replay-order  the pool-sharing graphs replay out of order (the third re-carved memory the
                  second has still to read)
    live-output   four graphs of one pool captured in a 1F1B order (forward mb0, forward mb1,
                  backward mb1, backward mb0) replay forward mb0, backward mb0, forward mb1:
                  forward mb1 writes over backward mb0's gradient, which the caller holds
    released-output
                  four graphs of one pool captured in sequence with Transformer Engine's buffer
                  reuse (forward mb0's output goes back to the pool once backward mb0 is
                  captured, and forward mb1 carves it) replay forward mb0, forward mb1: forward
                  mb1 writes over the output the caller still holds a view of
    eager-in-pool a tensor allocated eagerly into a graph's MemPool (`use_mem_pool`) is handed
                  the scratch the graph's capture freed: the next replay writes over it
    mgc-data-rebind
                  `p.data = p.data.clone()` on a weight of the make_graphed_callables model: its
                  graphed callables keep the Parameter and replay against its old storage
    mgc-input-rebind
                  a graphed block's sample input re-pointed at a new batch with `.data =`
                  instead of filled with `copy_`: the callable keeps that very tensor and
                  copies each new input into it, but its forward graph reads the old storage
    internal-driver / internal-node
                  graphsan's own graph walk fails, or returns a malformed node, during the
                  capture: graphsan must disable itself with one warning and training go on

A fault counts as caught when the next replay that would use the stale memory raises
`graphsan.StaleMemoryError` (which happens before the graph is launched); missed when training
goes on or dies otherwise. A control trial raising anything is a false alarm. After every trial
the CUDA context is checked with a small kernel. Trials run in worker processes (batched, so
the imports and the Triton compile are paid once per worker); a worker whose CUDA context dies
is replaced and its trial counted as unhealthy.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import io
import json
import os
import random
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_FAULTS = ("free", "free-reuse", "resize", "data-rebind", "set", "empty-cache")
OTHER_FAULTS = (
    "host-free",
    "table-free",
    "replay-order",
    "live-output",
    "released-output",
    "eager-in-pool",
)
MGC_FAULTS = ("mgc-data-rebind", "mgc-input-rebind")
INTERNAL = ("internal-driver", "internal-node")
KINDS = ("control", *DEVICE_FAULTS, *OTHER_FAULTS, *MGC_FAULTS, *INTERNAL)
TRAIN_ITERS, WARMUP, EVAL_INTERVAL = 5, 1, 3
# the make_graphed_callables model: big enough that its captured backward needs new segments
MGC_BLOCKS, MGC_HIDDEN, MGC_TOKENS = 2, 512, 1024
SCOPES = ("attn", "mamba", "moe_router", "moe_preprocess")


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------
def _gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_through_table(table_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        src = tl.load(table_ptr + row).to(tl.pointer_type(tl.float32))
        offs = tl.arange(0, BLOCK)
        vals = tl.load(src + offs, mask=offs < n, other=0.0)
        tl.store(out_ptr + row * n + offs, vals, mask=offs < n)

    return gather_through_table


class GraphedBlocks:
    """MLP blocks (LayerNorm, Linear, GELU, Linear) graphed by `make_graphed_callables` in one
    pool, with eager residual adds and their own AdamW, trained one step at a time.

    `make_graphed` is torch's (CPU tests pass a stand-in that keeps the samples the same way)."""

    def __init__(
        self,
        torch,
        device="cuda",
        make_graphed=None,
        blocks=MGC_BLOCKS,
        hidden=MGC_HIDDEN,
        tokens=MGC_TOKENS,
    ):
        self.torch, self.device, self.shape = torch, device, (tokens, hidden)
        nn = torch.nn
        mods = [
            nn.Sequential(
                nn.LayerNorm(hidden),
                nn.Linear(hidden, 4 * hidden),
                nn.GELU(),
                nn.Linear(4 * hidden, hidden),
            ).to(device)
            for _ in range(blocks)
        ]
        # the first block's input is data; later ones get a residual sum that requires grad
        samples = tuple(
            (torch.randn(*self.shape, device=device, requires_grad=i > 0),) for i in range(blocks)
        )
        make_graphed = make_graphed or torch.cuda.make_graphed_callables
        self.blocks = list(make_graphed(tuple(mods), samples))
        self.opt = torch.optim.AdamW([p for b in self.blocks for p in b.parameters()], lr=1e-4)
        # a training script drops its samples here; the callables keep them as static inputs
        self.samples = [weakref.ref(args[0]) for args in samples]

    def step(self) -> None:
        torch = self.torch
        x = torch.randn(*self.shape, device=self.device)
        for block in self.blocks:
            x = x + block(x)
        x.pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def evaluate(self) -> None:
        """A validation forward: modules in eval mode run their eager forward, not the graphs."""
        torch = self.torch
        for block in self.blocks:
            block.eval()
        with torch.no_grad():
            y = torch.randn(*self.shape, device=self.device)
            for block in self.blocks:
                y = y + block(y)
        for block in self.blocks:
            block.train()

    # ---- the faults; each returns what it did, or "no-hazard" if no storage died ----
    def rebind_weight(self, rng) -> str:
        named = [
            (f"block{i}.{n}", p) for i, b in enumerate(self.blocks) for n, p in b.named_parameters()
        ]
        name, p = rng.choice(named)
        old, alive = p.data_ptr(), weakref.ref(p.untyped_storage())
        p.data = p.data.clone()
        if alive() is not None:
            return "no-hazard"
        return f"mgc-data-rebind {name} ({p.numel()} elements) at {old:#x}"

    def rebind_input(self, rng) -> str:
        i = rng.randrange(len(self.samples))
        sample = self.samples[i]()
        if sample is None:  # torch's callables keep their samples: a harness problem
            raise RuntimeError(f"block {i}'s sample input is no longer alive")
        old, alive = sample.data_ptr(), weakref.ref(sample.untyped_storage())
        sample.data = self.torch.randn_like(sample)  # the next batch, bound instead of copied in
        del sample
        if alive() is not None:
            return "no-hazard"
        return f"mgc-input-rebind: block {i}'s sample input at {old:#x}"


class SideGraphs:
    """The small graphs and the make_graphed_callables model beside the lab model, stepped after
    every training step."""

    def __init__(self, torch, gather):
        dev = "cuda"
        self.torch = torch
        n = 4096
        # data loader: pinned batch -> static device input, inside the graph
        self.pinned = torch.randn(n).pin_memory()
        self.static_batch = torch.empty(n, device=dev)
        self.loader = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.loader):
            self.static_batch.copy_(self.pinned, non_blocking=True)
        # gather through a device table of buffer addresses (grouped-GEMM style pointer array)
        self.bufs = [torch.randn(1024, device=dev) for _ in range(4)]
        self.table = torch.tensor([b.data_ptr() for b in self.bufs], device=dev, dtype=torch.int64)
        self.gathered = torch.empty(4, 1024, device=dev)
        gather[(4,)](self.table, self.gathered, 1024, BLOCK=1024)  # compile outside the capture
        self.gather = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.gather):
            gather[(4,)](self.table, self.gathered, 1024, BLOCK=1024)
        # three graphs in one pool: g1 reads g0's output, which is then dropped, so g2's capture
        # re-carves it; only the order g0, g1, g2 is safe
        pool = torch.cuda.graph_pool_handle()
        self.x = torch.randn(1 << 16, device=dev)
        self.g = [torch.cuda.CUDAGraph() for _ in range(3)]
        with torch.cuda.graph(self.g[0], pool=pool):
            a = self.x * 2
        with torch.cuda.graph(self.g[1], pool=pool):
            self.b = a + 1
        a_ptr = a.data_ptr()
        del a
        with torch.cuda.graph(self.g[2], pool=pool):
            self.c = self.x * 3
        self.recarved = self.c.data_ptr() == a_ptr
        self.pipeline = Pipeline(torch)
        self.reused = ReusedPipeline(torch)
        self.eager = EagerInPool(torch)
        self.keep = []
        self.mgc = GraphedBlocks(torch)

    def replay(self, order=(0, 1, 2)) -> None:
        self.loader.replay()
        self.gather.replay()
        for i in order:
            self.g[i].replay()
        self.pipeline.replay()
        self.reused.replay()
        self.eager.graph.replay()

    def step(self, iteration: int) -> None:
        self.replay()
        self.mgc.step()
        if iteration % EVAL_INTERVAL == 0:  # when the lab validates
            self.mgc.evaluate()


class Pipeline:
    """Four graphs of one pool captured in a 1F1B order: forward mb0, forward mb1, backward mb1
    (which drops mb1's activation), backward mb0, whose gradient is carved from that memory."""

    ORDER = ("f0", "f1", "b1", "b0")

    def __init__(self, torch):
        pool = self._begin(torch)
        with torch.cuda.graph(self.g["f0"], pool=pool):
            act0 = (self.x[0] * 3).sin()
        with torch.cuda.graph(self.g["f1"], pool=pool):
            act1 = (self.x[1] * 3).sin()
        with torch.cuda.graph(self.g["b1"], pool=pool):
            self.grad1 = act1 * 2
        act1_ptr = act1.data_ptr()
        del act1
        with torch.cuda.graph(self.g["b0"], pool=pool):
            self.grad0 = act0 * 2
        self.recarved = self.grad0.data_ptr() == act1_ptr

    def _begin(self, torch):
        """Two microbatch inputs, the graphs of ORDER and their shared pool."""
        self.x = [torch.randn(1 << 16, device="cuda") for _ in range(2)]
        self.g = {name: torch.cuda.CUDAGraph() for name in self.ORDER}
        return torch.cuda.graph_pool_handle()

    def replay(self, order=ORDER) -> None:
        for name in order:
            self.g[name].replay()


class EagerInPool:
    """A graph in its own MemPool whose scratch, a large block, is freed inside the capture and
    goes back to the pool; `allocate` puts a tensor there eagerly, where the scratch was."""

    def __init__(self, torch):
        self.torch = torch
        self.pool = torch.cuda.MemPool()
        self.stream = torch.cuda.Stream()  # the allocator hands a block only to its own stream
        self.x = torch.randn(1 << 20, device="cuda")
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool.id, stream=self.stream):
            scratch = self.x * 3
            self.scratch_ptr = scratch.data_ptr()
            self.y = scratch.sin()[:16].clone()
            del scratch
        self.kept = None

    def allocate(self) -> bool:
        """A tensor allocated into the pool; whether it took the scratch (the hazard)."""
        torch = self.torch
        with torch.cuda.stream(self.stream), torch.cuda.use_mem_pool(self.pool):
            self.kept = torch.full((1 << 20,), 7.0, device="cuda")
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.kept.data_ptr() == self.scratch_ptr


class ReusedPipeline(Pipeline):
    """Four graphs of one pool captured in sequence with TE's buffer reuse: forward mb0's output
    goes back to the pool once backward mb0 is captured (the caller keeps a view that owns
    nothing), and forward mb1's capture carves that memory."""

    ORDER = ("f0", "b0", "f1", "b1")

    def __init__(self, torch):
        from graphsan.lab.train.graphs import unowned

        pool = self._begin(torch)
        with torch.cuda.graph(self.g["f0"], pool=pool):
            act0 = (self.x[0] * 3).sin()
            out0 = act0 + 1
        with torch.cuda.graph(self.g["b0"], pool=pool):
            self.grad0 = act0 * 2
        out0_ptr = out0.data_ptr()
        self.out0 = unowned(out0)
        del out0
        with torch.cuda.graph(self.g["f1"], pool=pool):
            act1 = (self.x[1] * 3).sin()
            self.out1 = act1 + 1
        with torch.cuda.graph(self.g["b1"], pool=pool):
            self.grad1 = act1 * 2
        self.recarved = out0_ptr in (act1.data_ptr(), self.out1.data_ptr())

    def replay(self, order=ORDER) -> None:
        super().replay(order)


class Injector:
    """The lab trainer's callback: builds the side graphs after capture, injects at `step`."""

    def __init__(self, spec: dict, torch, gather):
        self.spec, self.torch, self.gather = spec, torch, gather
        self.rng = random.Random(spec["seed"])
        self.model = self.side = None
        self.injected = None  # what was done, for the log
        self.keep = []  # tensors that must outlive the trial (reusers of freed blocks)

    def on_model_built(self, model) -> None:
        self.model = model

    def on_step_end(self, iteration: int) -> None:
        if iteration <= WARMUP:
            return
        if self.side is None:
            self.side = SideGraphs(self.torch, self.gather)
        self.side.step(iteration)
        if iteration == self.spec["step"] and self.spec["kind"] != "control":
            self.inject(self.spec["kind"])

    # ---- the faults ----
    def _referenced_param(self):
        import graphsan

        live = graphsan.current().tracker.live
        starts = sorted(live)

        def watched(ptr):
            i = bisect.bisect_right(starts, ptr) - 1
            return i >= 0 and ptr < starts[i] + live[starts[i]].size

        cands = [(n, p) for n, p in self.model.named_parameters() if watched(p.data_ptr())]
        if not cands:
            raise RuntimeError("no parameter is referenced by a live graph")
        return self.rng.choice(cands)

    def _static_input(self):
        """A graphed stage's static input (one microbatch's), which its graphs read."""
        found = []
        for m in self.model.modules():
            for v in vars(m).values():
                stage = getattr(v, "stage", None)
                for i, g in enumerate(getattr(stage, "graphs", None) or ()):
                    if isinstance(getattr(g, "static_in", None), self.torch.Tensor):
                        found.append((f"{stage.name} mb{i} static input", g))
        if not found:
            raise RuntimeError("no graphed stage with a static input in the model")
        return self.rng.choice(found)

    def inject(self, kind: str) -> None:
        torch = self.torch
        if kind in ("free", "free-reuse", "empty-cache"):
            name, g = self._static_input()
            old = g.static_in
            alive = weakref.ref(old.untyped_storage())
            addr = old.data_ptr()
            g.static_in = torch.empty_like(old)
            del old
            if alive() is not None:  # something else holds it: nothing was freed
                self.injected = "no-hazard"
                return
            if kind == "free-reuse":
                self.keep += [torch.empty_like(g.static_in) for _ in range(4)]
            if kind == "empty-cache":
                torch.cuda.empty_cache()
            self.injected = f"{kind}: {name} at {addr:#x}"
        elif kind in DEVICE_FAULTS:
            name, p = self._referenced_param()
            old = p.data_ptr()
            if kind == "resize":
                p.data.resize_(p.numel() + 4096)
            elif kind == "data-rebind":
                p.data = p.data.clone()
            elif kind == "set":
                with torch.no_grad():
                    p.set_(p.detach().clone())
            self.injected = f"{kind} {name} ({p.numel()} elements) at {old:#x}"
        elif kind == "host-free":
            side = self.side
            old = side.pinned.data_ptr()
            side.pinned = None
            self.keep += [torch.empty(4096).pin_memory() for _ in range(2)]
            self.injected = f"freed the pinned loader batch at {old:#x}"
        elif kind == "table-free":
            side = self.side
            j = self.rng.randrange(len(side.bufs))
            old = side.bufs[j].data_ptr()
            side.bufs[j] = torch.randn(1024, device="cuda")
            self.keep += [torch.empty(1024, device="cuda") for _ in range(2)]
            self.injected = f"freed table entry {j} at {old:#x}"
        elif kind == "replay-order":
            if not self.side.recarved:
                self.injected = "no-hazard"  # the third capture did not re-carve; not a fault
                return
            self.injected = "replayed g0, g2, g1"
            self.side.replay(order=(0, 2, 1))
        elif kind == "live-output":
            if not self.side.pipeline.recarved:
                self.injected = "no-hazard"  # backward mb0's gradient got memory of its own
                return
            self.injected = "replayed forward mb0, backward mb0, forward mb1"
            self.side.pipeline.replay(order=("f0", "b0", "f1"))
        elif kind == "released-output":
            if not self.side.reused.recarved:
                self.injected = "no-hazard"  # forward mb1 carved memory of its own
                return
            self.injected = "replayed forward mb0, forward mb1 (buffers reused)"
            self.side.reused.replay(order=("f0", "f1"))
        elif kind == "eager-in-pool":
            if not self.side.eager.allocate():
                self.injected = "no-hazard"  # the pool handed the tensor other memory
                return
            self.injected = "allocated a tensor into the graph's pool over its scratch"
        elif kind == "mgc-data-rebind":
            self.injected = self.side.mgc.rebind_weight(self.rng)
        elif kind == "mgc-input-rebind":
            self.injected = self.side.mgc.rebind_input(self.rng)
        elif kind not in INTERNAL:  # the internal faults are patched in for the whole trial
            raise ValueError(f"unknown fault kind {kind!r}")


def _patch_internal(kind: str):
    """Make graphsan's own graph walk fail (or return a malformed node), the compiled walk and
    the one through cuda-bindings alike; returns an undo."""
    from graphsan.core.records import KernelArgs
    from graphsan.cuda import driver, graphwalk

    if kind == "internal-driver":
        patches = [(driver, "walk"), (graphwalk.GraphWalk, "walk")]

        def broken(*args):
            raise RuntimeError("injected: cuGraphGetNodes failed (CUDA_ERROR_INVALID_VALUE)")

        replacements = [broken, broken]
    else:
        patches = [(driver, "_read_kernel"), (graphwalk, "parse")]
        parse = graphwalk.parse

        def broken_read(node, index):
            return KernelArgs(index, None, None, None)  # neither a name nor parameter bytes

        def broken_parse(raw, describe):
            return [
                KernelArgs(r.index, None, None, None) if isinstance(r, KernelArgs) else r
                for r in parse(raw, describe)
            ]

        replacements = [broken_read, broken_parse]
    saved = [getattr(owner, name) for owner, name in patches]
    for (owner, name), new in zip(patches, replacements, strict=True):
        setattr(owner, name, new)

    def undo():
        for (owner, name), old in zip(patches, saved, strict=True):
            setattr(owner, name, old)

    return undo


def _healthy(torch) -> bool:
    try:
        torch.cuda.synchronize()
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        return float((x * 2).sum().item()) == 1024 * 1023.0
    except Exception:
        return False


def _view_vs_allocator(torch, addr: int) -> dict:
    """What graphsan's allocator view and a fresh snapshot say of the segment holding `addr`
    (a false alarm's block): which of the two is wrong, and how."""
    import graphsan

    memory = graphsan.current().memory
    out: dict = {"drains": memory.drains}
    view = memory.views.get(torch.cuda.current_device())
    seg = view.segment_at(addr) if view is not None else None
    if seg is not None:
        out["view"] = {
            "segment": hex(seg.address),
            "size": seg.size,
            "pool": list(seg.pool),
            "allocated_here": bool(seg.allocated_in(addr, addr + 1)),
        }
    for s in torch.cuda.memory._snapshot()["segments"]:
        if s["address"] <= addr < s["address"] + s["total_size"]:
            blocks = [
                (hex(b["address"]), b["size"], b["state"])
                for b in s["blocks"]
                if abs(b["address"] - addr) < 4 << 20
            ]
            out["allocator"] = {
                "segment": hex(s["address"]),
                "size": s["total_size"],
                "pool": list(s["segment_pool_id"]),
                "type": s.get("segment_type"),
                "blocks": blocks[:8],
            }
    return out


def run_trial(spec: dict, torch, gather) -> dict:
    from rich.console import Console

    import graphsan
    from graphsan.lab.train import TrainConfig
    from graphsan.lab.train.trainer import train
    from graphsan.report import format_finding

    san = graphsan.current()
    if san is None or not san.active:
        graphsan.disable()
        san = graphsan.enable(policy="raise")
    kind = spec["kind"]
    cfg = TrainConfig(
        preset="tiny",
        train_iters=TRAIN_ITERS,
        cuda_graph_modules=SCOPES,
        cuda_graph_warmup_steps=WARMUP,
        eval_interval=EVAL_INTERVAL,
        eval_iters=1,
        seed=spec["seed"] % 100000,
        device="cuda",
        quiet=True,
        log_interval=1000,
    )
    inj = Injector(spec, torch, gather)
    undo = _patch_internal(kind) if kind in INTERNAL else None
    err_buf, real_err = io.StringIO(), sys.stderr
    sys.stderr = err_buf
    out = {"id": spec["id"], "kind": kind, "step": spec["step"]}
    t0 = time.perf_counter()
    try:
        train(cfg, console=Console(file=io.StringIO()), callbacks=[inj])
        out["outcome"] = "completed"
    except graphsan.StaleMemoryError as e:
        out["outcome"] = "stopped"
        out["finding_kinds"] = sorted({str(f.kind) for f in e.findings})
        out["finding"] = format_finding(e.findings[0])[:3000]  # what a false alarm says
        if inj.injected is None:
            out["view_vs_allocator"] = _view_vs_allocator(torch, e.findings[0].block_address)
    except Exception as e:  # a missed fault that crashed, or a harness problem: keep the text
        out["outcome"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        sys.stderr = real_err
        if undo is not None:
            undo()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    out["injected"] = inj.injected
    warnings = [ln for ln in err_buf.getvalue().splitlines() if "graphsan:" in ln]
    out["graphsan_lines"] = warnings[:3]
    out["graphsan_active"] = bool(graphsan.current() is not None and graphsan.current().active)
    out["allocator_log"] = graphsan.current().report().allocator_log if graphsan.current() else None
    del inj
    gc.collect()
    out["healthy"] = _healthy(torch)
    return out


def worker() -> None:
    import torch

    specs = json.loads(sys.stdin.read())
    gather = _gather_kernel()
    for spec in specs:
        print("START " + json.dumps(spec["id"]), flush=True)
        res = run_trial(spec, torch, gather)
        print("TRIAL " + json.dumps(res), flush=True)
        if not res["healthy"]:
            sys.exit(3)  # a dead CUDA context: the parent starts a fresh worker


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def verdict(res: dict) -> str:
    """caught | missed | false-alarm | went-on | no-hazard (a trial that injected nothing)."""
    kind, outcome = res["kind"], res["outcome"]
    if kind == "control":
        return "false-alarm" if outcome != "completed" else "clean"
    if kind in INTERNAL:  # training goes on; graphsan, if it gave up, said so once and stopped
        lines, active = len(res.get("graphsan_lines", [])), res.get("graphsan_active")
        ok = outcome == "completed" and ((lines == 1 and not active) or (lines == 0 and active))
        return "went-on" if ok else "missed"
    if res.get("injected") == "no-hazard":
        return "no-hazard"
    if res.get("injected") is None:  # stopped before the fault: a false alarm
        return "false-alarm" if outcome == "stopped" else "missed"
    return "caught" if outcome == "stopped" else "missed"


def run_workers(specs: list[dict], workers: int, deadline: float, log) -> list[dict]:
    queue = list(specs)
    lock = threading.Lock()
    results: list[dict] = []

    def take(n):
        with lock:
            batch, queue[:] = queue[:n], queue[n:]
            return batch

    def one_worker():
        while time.monotonic() < deadline:
            batch = take(max(1, len(specs) // (workers * 4)))
            if not batch:
                return
            pending = {s["id"]: s for s in batch}
            env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=ROOT,
            )
            proc.stdin.write(json.dumps(batch))
            proc.stdin.close()
            current, tail = None, []
            for line in proc.stdout:
                if line.startswith("START "):
                    current = json.loads(line[6:])
                elif line.startswith("TRIAL "):
                    res = json.loads(line[6:])
                    pending.pop(res["id"], None)
                    with lock:
                        results.append(res)
                    current = None
                else:
                    tail = (tail + [line.rstrip()])[-20:]
                if time.monotonic() > deadline + 60:
                    proc.kill()
                    break
            proc.wait()
            if current is not None and current in pending:  # the worker died inside a trial
                spec = pending.pop(current)
                res = dict(spec, outcome="died", healthy=False, injected="?", error="\n".join(tail))
                with lock:
                    results.append(res)
                log.write(f"worker died in trial {current}:\n" + "\n".join(tail) + "\n")
            with lock:  # trials the worker never started go back to the queue
                queue[:0] = list(pending.values())

    threads = [threading.Thread(target=one_worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def table(results: list[dict], kinds) -> str:
    by = defaultdict(list)
    for r in results:
        by[r["kind"]].append(r)
    head = (
        "| fault | trials | caught before launch | missed | false alarms | no hazard built "
        "| CUDA healthy after | finding kinds |\n|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for kind in kinds:
        rs = by.get(kind, [])
        if not rs:
            continue
        v = Counter(verdict(r) for r in rs)
        fk = Counter(k for r in rs for k in r.get("finding_kinds", []))
        caught = v["caught"] + v["went-on"]
        caught_s = "-" if kind == "control" else f"{caught}"
        if kind in INTERNAL:
            caught_s += " (went on)"
        rows.append(
            f"| {kind} | {len(rs)} | {caught_s} | {v['missed']} | {v['false-alarm']} "
            f"| {v['no-hazard']} | {sum(r['healthy'] for r in rs)}/{len(rs)} "
            f"| {', '.join(f'{k} {n}' for k, n in fk.most_common()) or '-'} |"
        )
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=450, help="seconds for all trials")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help="comma-separated, of: " + ", ".join(KINDS)
    )
    ap.add_argument("--json", help="write every trial's result here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker()
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds: unknown {', '.join(bad)}; expected some of {', '.join(KINDS)}")
    if args.trials < 1 or args.workers < 1:
        ap.error("--trials and --workers: expected >= 1")
    import torch

    if not torch.cuda.is_available():
        print(
            "bench_faults.py needs a CUDA GPU (CUDA graphs); none is visible here", file=sys.stderr
        )
        return 2
    rng = random.Random(args.seed)
    specs = [
        {
            "id": i,
            "kind": kinds[i % len(kinds)],
            "seed": rng.randrange(1 << 30),
            "step": rng.randrange(WARMUP + 1, TRAIN_ITERS),
        }
        for i in range(args.trials)
    ]
    t0 = time.monotonic()
    results = run_workers(specs, args.workers, t0 + args.time_limit, sys.stderr)
    wall = time.monotonic() - t0
    results.sort(key=lambda r: r["id"])
    print(
        f"{len(results)} of {args.trials} trials in {wall:.0f} s with {args.workers} workers "
        f"(lab tiny preset, graphed {'+'.join(SCOPES)}, {TRAIN_ITERS} steps, policy raise)"
    )
    print(table(results, kinds))
    odd = [r for r in results if verdict(r) in ("missed", "false-alarm")]
    for r in odd[:8]:
        print(
            f"  trial {r['id']} {r['kind']} step {r['step']}: {verdict(r)}, outcome "
            f"{r['outcome']}, injected {r.get('injected')}, {r.get('error', '')[:200]}"
            f"{' ' + ' / '.join(r.get('graphsan_lines', [])) if r.get('graphsan_lines') else ''}"
        )
        if verdict(r) == "false-alarm" and r.get("finding"):
            print("    " + r["finding"][:1500].replace("\n", "\n    "))
            print("    view vs allocator: " + json.dumps(r.get("view_vs_allocator")))
    logs = Counter(r.get("allocator_log") for r in results)
    print("allocator events from: " + ", ".join(f"{k} ({n} trials)" for k, n in logs.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if not odd and len(results) == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a fault trial runs beside the lab model, and the faults it injects (bench/bench_faults.py
says what each fault is and how a trial is judged): the side programs a real job also has (a
pinned loader batch, a gather through a table of addresses, graphs sharing pools in capture and
pipeline orders, a model graphed with `torch.cuda.make_graphed_callables`) and `Injector`, the
lab trainer's callback that builds them after capture and injects the trial's fault at its step.
"""

from __future__ import annotations

import bisect
import random
import weakref

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
BAKED_FAULTS = ("mode", "baked-value", "superseded")
INTERNAL = ("internal-driver", "internal-node")
KINDS = ("control", *DEVICE_FAULTS, *OTHER_FAULTS, *MGC_FAULTS, *BAKED_FAULTS, *INTERNAL)
TRAIN_ITERS, WARMUP, EVAL_INTERVAL = 5, 1, 3
# the make_graphed_callables model: big enough that its captured backward needs new segments
MGC_BLOCKS, MGC_HIDDEN, MGC_TOKENS = 2, 512, 1024
SCOPES = ("attn", "mamba", "moe_router", "moe_preprocess")


def gather_kernel():
    """A Triton kernel that reads each row's source through a device table of addresses."""
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


class WholeStep:
    """A small network (Linear, dropout, Linear) whose whole training step (forward, backward
    and a capturable Adam step with a float lr) is one graph, replayed every lab step; on the
    lab's validation steps it runs eagerly in eval mode and goes back to train mode, as it should.
    """

    def __init__(self, torch, width=256):
        self.torch = torch
        nn = torch.nn
        self.model = nn.Sequential(
            nn.Linear(width, width), nn.Dropout(0.1), nn.Linear(width, width)
        )
        self.model.cuda()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, capturable=True, foreach=True)
        self.x = torch.randn(64, width, device="cuda")
        self.y = torch.randn(64, width, device="cuda")

        def step():
            loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
            loss.backward()
            self.opt.step()
            return loss.detach()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.opt.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.opt.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.loss = step()

    def evaluate(self) -> None:
        self.model.eval()
        with self.torch.no_grad():
            self.model(self.x)
        self.model.train()

    def inject(self, kind: str) -> str:
        """Change what the step graph baked the way it never sees."""
        if kind == "mode":
            self.model.eval()  # validation that forgets model.train()
            return "left the whole-step model in eval mode"
        if kind == "baked-value":
            self.opt.param_groups[0]["lr"] *= 0.5  # a scheduler over a float lr
            return "halved the whole-step optimizer's float lr"
        old = self.model[0].weight  # the optimizer keeps it alive
        self.model[0].weight = self.torch.nn.Parameter(old.detach().clone())
        return f"re-pointed the whole-step model's weight ({old.data_ptr():#x} lives on)"


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
        self.whole = WholeStep(torch)

    def replay(self, order=(0, 1, 2)) -> None:
        self.loader.replay()
        self.gather.replay()
        for i in order:
            self.g[i].replay()
        self.pipeline.replay()
        self.reused.replay()
        self.eager.graph.replay()
        self.whole.graph.replay()

    def step(self, iteration: int) -> None:
        self.replay()
        self.mgc.step()
        if iteration % EVAL_INTERVAL == 0:  # when the lab validates
            self.mgc.evaluate()
            self.whole.evaluate()


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
        elif kind in BAKED_FAULTS:
            self.injected = self.side.whole.inject(kind)
        elif kind not in INTERNAL:  # the internal faults are patched in for the whole trial
            raise ValueError(f"unknown fault kind {kind!r}")


def patch_internal(kind: str):
    """Make graphsan's own graph walk fail (or return a malformed node), the compiled walk and
    the one through cuda-bindings alike; returns the `Patches` whose `restore` undoes it."""
    from graphsan.core.patches import Patches
    from graphsan.core.records import KernelArgs
    from graphsan.cuda import driver, graphwalk

    patches = Patches()
    if kind == "internal-driver":

        def broken(*args):
            raise RuntimeError("injected: cuGraphGetNodes failed (CUDA_ERROR_INVALID_VALUE)")

        patches.set(driver, "walk", broken)
        patches.set(graphwalk.GraphWalk, "walk", broken)
        return patches
    parse = graphwalk.parse

    def broken_read(node, index):
        return KernelArgs(index, None, None, None)  # neither a name nor parameter bytes

    def broken_parse(raw, describe):
        return [
            KernelArgs(r.index, None, None, None) if isinstance(r, KernelArgs) else r
            for r in parse(raw, describe)
        ]

    patches.set(driver, "_read_kernel", broken_read)
    patches.set(graphwalk, "parse", broken_parse)
    return patches

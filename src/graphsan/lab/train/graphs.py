"""Per-module CUDA graphs for training (our own capture code, TE `make_graphed_callables` in spirit).

Scopes (Megatron's `--cuda-graph-scope` names):
    attn            each attention layer (norm -> attention -> residual)
    mamba           each Mamba-2 layer (norm -> mixer -> residual)
    moe_router      each MoE layer's pre-norm + router
    moe_preprocess  additionally fc1_latent, routing-map padding and permutation (needs moe_router)
    mlp             each dense MLP layer and each MoE layer's shared expert
Routed experts (grouped GEMMs over device-side per-expert offsets, no host sync), combine and
fc2_latent run eagerly, as in Megatron, as do the embedding, the output layer and MTP.

Capture, for every graphed stage:
1. warm-up: the real modules run eagerly on a side stream (forward + autograd.grad), so buffers a
   module creates lazily (QuantLinear weight workspaces) are created in the default memory pool
   before capture, as with TE;
2. per microbatch, a forward graph and a backward graph (autograd.grad of the captured outputs on
   static grad-output buffers), all in ONE shared private pool, captured in execution order
   (every stage's forward in layer order, then every backward in reverse) so replays follow the
   capture order that the pool sharing relies on;
3. main_grads and router counters touched by the warm-up are zeroed afterwards.
With `reuse_buffers` (TE's `_reuse_graph_input_output_buffers`, which Megatron passes with its
pipeline `_order`), once a microbatch's backward graphs are captured the stages keep only views
that own nothing of its forwards' static outputs, of the parameter gradients they clone and of
every input gradient but the first stage's: the pool may carve that memory for later captures,
which is safe while the step replays the graphs in capture order. (TE also shares static inputs
between microbatches; the lab's static inputs stay one per graph.)

Replay (`GraphedStage.__call__`, an autograd.Function): inputs are copied into the static input,
the forward graph replays; in backward, incoming grads are copied into the static grad-outputs and
the backward graph replays. QuantLinear weight grads go to main_grad inside the graph; other
parameter grads come out of the graph's static buffers and are CLONED before autograd sees them,
so a parameter's grad never aliases a buffer the next replay overwrites. Graphs are used only in
training mode with grad enabled; eval runs the modules eagerly (`install` shadows the layer's
stage method with a callable that picks the graph or the eager method on each call).

`state_policy` (the same policy the quantized modules follow, see lab/quant/linear.py):
    "te218"  on every training replay the wrapper writes the ambient recipe (the precision config's
             base recipe) into `stored_recipe` of every quantized module in that graphed scope, even
             those with their own override. TE 2.18's `transformer_engine/pytorch/graph.py` does
             this in the graphed forward wrapper (around line 1245): for each TE module of the
             callable it sets `fp8_meta["recipe"]` to `FP8GlobalStateManager.get_fp8_recipe()`
             before replaying. With the QuantLinear "te218" policy the next eager forward of an
             overridden module sees a recipe-class change and frees its weight workspace, which
             the captured graphs still read (TE #3316).
    "fixed"  the wrapper writes nothing; modules keep their own recipe. The stage also holds a
             reference to every workspace it captured, for the graph's lifetime.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch
from torch import nn

import graphsan
from graphsan.lab.choices import (
    Pass,
    Schedule,
    StatePolicy,
    check_order,
    check_scopes,
    schedule_order,
)
from graphsan.lab.quant import QuantModule
from graphsan.lab.train.config import TrainConfig


class MicrobatchCounter:
    """Which microbatch's graphs the next replay uses (set by the trainer)."""

    def __init__(self):
        self.index = 0


@dataclass
class _Graphs:
    fwd: torch.cuda.CUDAGraph
    static_in: torch.Tensor
    static_out: tuple
    diff: tuple  # per output: differentiable?
    bwd: torch.cuda.CUDAGraph | None = None
    static_grad_out: tuple = ()
    static_grad_in: tuple = ()


class _GraphedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stage, x, *params):
        g = stage.graphs[stage.counter.index]
        if x.data_ptr() != g.static_in.data_ptr():
            g.static_in.copy_(x)
        g.fwd.replay()
        ctx.g = g
        outs = tuple(o.detach() for o in g.static_out)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, g.diff, strict=True) if not d])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        g = ctx.g
        diff_grads = [gr for gr, d in zip(grads, g.diff, strict=True) if d]
        for buf, gr in zip(g.static_grad_out, diff_grads, strict=True):
            if gr is None:
                buf.zero_()
            elif gr.data_ptr() != buf.data_ptr():
                buf.copy_(gr)
        g.bwd.replay()
        gx, *gparams = g.static_grad_in
        gparams = [None if t is None else t.clone() for t in gparams]
        return (None, None if gx is None else gx.detach(), *gparams)


@dataclass
class GraphedStage:
    """One graphed callable of one layer, with its graphs per microbatch."""

    name: str  # e.g. "layers.3:front"
    layer: nn.Module
    stage: str  # the layer's stage method it replaces: "layer", "router", "front", "shared"
    fn: object
    modules: list
    counter: MicrobatchCounter
    state_policy: StatePolicy = StatePolicy.FIXED
    ambient_recipe: object = None
    graphs: list = field(default_factory=list)
    keepalive: list = field(default_factory=list)

    def __post_init__(self):
        seen, self.params, self.quant = set(), [], []
        for m in self.modules:
            for sub in m.modules():
                if isinstance(sub, QuantModule) and id(sub) not in seen:
                    seen.add(id(sub))
                    self.quant.append(sub)
        qweights = {id(q.weight) for q in self.quant}
        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad and id(p) not in qweights and id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)

    def __call__(self, x):
        if self.state_policy == StatePolicy.TE218:
            # TE 2.18 graph.py (~1245): the ambient recipe overwrites every module's stored recipe
            for q in self.quant:
                q.stored_recipe = self.ambient_recipe
        outs = _GraphedFn.apply(self, x, *self.params)
        return outs[0] if len(outs) == 1 else outs


def plan_stages(model, scopes, counter, state_policy, ambient_recipe) -> list[GraphedStage]:
    """The graphed stages of `model` for `scopes`, in forward execution order (main layers only)."""
    scopes = check_scopes(scopes)
    stages = []

    def add(i, layer, stage, fn, modules):
        stages.append(
            GraphedStage(
                f"layers.{i}:{stage}",
                layer,
                stage,
                fn,
                modules,
                counter,
                state_policy,
                ambient_recipe,
            )
        )

    for i, layer in enumerate(model.layers):
        k = layer.kind
        if (
            (k == "M" and "mamba" in scopes)
            or (k == "*" and "attn" in scopes)
            or (k == "-" and "mlp" in scopes)
        ):
            add(i, layer, "layer", layer.layer_stage, [layer])
        elif k == "E":
            moe = layer.mixer
            if "moe_preprocess" in scopes:
                add(i, layer, "front", layer.front_stage, [layer.norm, moe.router, moe.fc1_latent])
            elif "moe_router" in scopes:
                add(i, layer, "router", layer.router_stage, [layer.norm, moe.router])
            if "mlp" in scopes:
                add(i, layer, "shared", layer.shared_stage, [moe.shared_expert])
    return stages


def capture_scopes(model, cfg: TrainConfig, counter, ambient_recipe) -> list[GraphedStage]:
    """The run's graphed stages (`cfg.cuda_graph_modules`), captured per microbatch in the
    order of its capture schedule (the step's own unless `--capture-schedule` says otherwise)
    and installed on their layers."""
    stages = plan_stages(model, cfg.cuda_graph_modules, counter, cfg.state_policy, ambient_recipe)
    capture(
        stages,
        model,
        num_microbatches=cfg.num_microbatches,
        sample_shape=(cfg.micro_batch_size, cfg.seq_length, model.args.hidden_size),
        order=schedule_order(
            cfg.capture_schedule or cfg.microbatch_schedule,
            cfg.num_microbatches,
            cfg.microbatches_in_flight,
        ),
        reuse_buffers=cfg.reuse_graph_buffers,
    )
    return stages


def _flat(outs):
    return outs if isinstance(outs, tuple) else (outs,)


def unowned(t: torch.Tensor | None) -> torch.Tensor | None:
    """A view of `t`'s memory that keeps none of it allocated (what TE's `make_weak_ref`
    returns): the pool may carve it again while the graph still writes it at each replay."""
    if t is None:
        return None
    s = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(s.data_ptr(), t.device, s.nbytes())
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    return view.set_(storage, t.storage_offset(), t.size(), t.stride())


def _release_buffers(graphs: list[_Graphs]) -> None:
    """A microbatch's captured stages (in backward order) let go of the memory TE's buffer
    reuse gives back: forward outputs, cloned parameter gradients, and each input gradient the
    next backward has consumed (all but the last one's, which the embedding's backward reads)."""
    for i, g in enumerate(graphs):
        g.static_out = tuple(unowned(o) for o in g.static_out)
        gx, *gparams = g.static_grad_in
        keep_gx = gx if i == len(graphs) - 1 else unowned(gx)
        g.static_grad_in = (keep_gx, *(unowned(p) for p in gparams))


def capture(
    stages,
    model,
    *,
    num_microbatches: int,
    sample_shape,
    dtype=torch.bfloat16,
    warmup_iters: int = 2,
    order: list[Pass] | None = None,
    reuse_buffers: bool = False,
) -> None:
    """Warm up, capture every stage's forward and backward graphs per microbatch in `order`
    (`graphsan.lab.choices.schedule_order`; default: sequential), install them; `reuse_buffers`:
    give the pool back what TE's buffer reuse does (the module docstring)."""
    device = next(model.parameters()).device
    pool = torch.cuda.graph_pool_handle()
    gen = torch.Generator(device=device).manual_seed(0)

    def sample():
        x = torch.randn(sample_shape, device=device, dtype=dtype, generator=gen)
        return x.requires_grad_(True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for st in stages:
            for _ in range(warmup_iters):
                x = sample()
                outs = [o for o in _flat(st.fn(x)) if o.requires_grad]
                torch.autograd.grad(
                    outs,
                    [x, *st.params],
                    [torch.randn_like(o) * 1e-2 for o in outs],
                    allow_unused=True,
                )
                del outs, x
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    # No automatic garbage collection while capturing: a collection inside a capture can destroy
    # an unreachable CUDA graph of an earlier run, which a capturing stream forbids (it
    # invalidates the capture; docs/te-3316.md, "What the lab does on the GPU, and why").
    gc.collect()
    # under torch.distributed, NCCL's watchdog thread polls events while we capture; a global
    # capture mode would count its calls as illegal inside our capture
    mode = "thread_local" if torch.distributed.is_initialized() else "global"
    gc_was_enabled = gc.isenabled()
    gc.disable()
    order = check_order(
        order or schedule_order(Schedule.SEQUENTIAL, num_microbatches), num_microbatches
    )
    captured: dict[int, list] = {mb: [] for mb in range(num_microbatches)}
    live: dict[int, list] = {}  # microbatch -> its forwards, until its backwards are captured
    try:
        for kind, mb in order:
            if kind == "F":
                live[mb] = []
                for st in stages:  # forward graphs, in execution order
                    x = sample()
                    g = torch.cuda.CUDAGraph()
                    with (
                        graphsan.label(f"{st.name} fwd mb{mb}"),
                        torch.cuda.graph(g, pool=pool, capture_error_mode=mode),
                    ):
                        outs = _flat(st.fn(x))
                    live[mb].append((st, x, g, outs))
                continue
            for st, x, g, outs in reversed(live.pop(mb)):  # backward graphs, in reverse
                diff = tuple(o.requires_grad for o in outs)
                douts = [o for o in outs if o.requires_grad]
                grad_bufs = tuple(torch.empty_like(o) for o in douts)
                bg = torch.cuda.CUDAGraph()
                with (
                    graphsan.label(f"{st.name} bwd mb{mb}"),
                    torch.cuda.graph(bg, pool=pool, capture_error_mode=mode),
                ):
                    grads = torch.autograd.grad(
                        douts, [x, *st.params], grad_bufs, allow_unused=True
                    )
                captured[mb].append(
                    _Graphs(
                        g,
                        x.detach().requires_grad_(False),
                        tuple(o.detach() for o in outs),
                        diff,
                        bg,
                        grad_bufs,
                        tuple(grads),
                    )
                )
            if reuse_buffers:
                _release_buffers(captured[mb])
            # the forward's saved activations go with its autograd graph, as in training
            del x, g, outs, douts, grads
    finally:
        if gc_was_enabled:
            gc.enable()
    for mb in range(num_microbatches):  # captured backwards run in reverse stage order
        for st, graphs in zip(reversed(stages), captured[mb], strict=True):
            st.graphs.append(graphs)
    for st in stages:
        if st.state_policy == StatePolicy.FIXED:
            st.keepalive = [q.workspace for q in st.quant if q.workspace is not None]
        install(st)
    with torch.no_grad():  # undo the warm-up's side effects
        for p in model.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        for name, buf in model.named_buffers():
            if name.endswith("local_tokens_per_expert"):
                buf.zero_()
    torch.cuda.synchronize()


class _TrainingOnly:
    """A graphed stage in training mode with grad enabled, the eager stage otherwise."""

    def __init__(self, stage: GraphedStage, eager):
        self.stage, self.eager = stage, eager

    def __call__(self, x):
        if self.stage.layer.training and torch.is_grad_enabled():
            return self.stage(x)
        return self.eager(x)


def install(stage: GraphedStage) -> None:
    """Shadow the layer's stage method (e.g. `router_stage`) with the graphed callable."""
    name = f"{stage.stage}_stage"
    setattr(
        stage.layer,
        name,
        _TrainingOnly(stage, getattr(type(stage.layer), name).__get__(stage.layer)),
    )

"""Library kernels whose arguments carry more than plain pointers: batched concatenation
metadata, index tensors, cuBLAS (split-K and cuBLASLt's packed arguments), sorting and scans,
cuFFT, cuDNN convolutions, normalisation, losses, graph-safe random numbers, the foreach
kernels, scaled-dot-product attention, a Transformer layer and grouped GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphsan.selftest import program
from graphsan.selftest.case import Case, Skip

TESTS = "pytorch test/test_cuda.py (graph tests)"


def _graph_and_check(case: Case, inputs: dict, fn, victim: str, tol: float = 1e-4) -> None:
    """Capture `fn(**inputs)` (a list of tensors) after a warm-up, replay it on new values and
    compare it with eager; the twin then drops `inputs[victim]` and replays."""
    # the outputs die with _checked_graph's frame: the twin's drop finds only the inputs alive
    case.drop_and_replay(_checked_graph(case, inputs, fn, tol), inputs, victim)


def _checked_graph(case: Case, inputs: dict, fn, tol: float) -> torch.cuda.CUDAGraph:
    with torch.no_grad():
        g, outs = case.warmup_and_capture(lambda: fn(**inputs))
        for t in inputs.values():
            if t.is_floating_point():
                t.mul_(0.5)
    case.replay(g)
    torch.cuda.synchronize()
    with torch.no_grad():
        wants = fn(**inputs)
    for i, (got, want) in enumerate(zip(outs, wants, strict=True)):
        if got.is_floating_point():
            case.close(got, want, f"output {i} equals eager", tol)
        else:
            case.check(torch.equal(got, want), f"output {i} equals eager")
    return g


@program(
    "kernels/cat-stack-many",
    pattern="torch.cat of 300 tensors of odd sizes (batched copies with per-launch metadata), "
    "torch.stack of 80, concatenation of transposed inputs",
    source=f"aten/src/ATen/native/cuda/Shape.cu (CatArrInputTensorMetadata); {TESTS}",
    bug="one of the concatenated tensors is dropped after the capture",
)
def cat_stack_many(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {f"p{i}": torch.randn((i * 37) % 200 + 1, 16, device="cuda") for i in range(300)}
    inputs.update({f"s{i}": torch.randn(24, 40, device="cuda") for i in range(80)})

    def fn(**kw):
        parts = [kw[f"p{i}"] for i in range(300)]
        same = [kw[f"s{i}"] for i in range(80)]
        return [
            torch.cat(parts, dim=0),
            torch.stack(same, dim=0),
            torch.cat([t.t() for t in same[:40]], dim=1),
        ]

    _graph_and_check(case, inputs, fn, "p137")


@program(
    "kernels/index-gather-scatter",
    pattern="index_select, gather, scatter_add_, index_add_, index_put_ with accumulate, "
    "advanced indexing, masked_fill, embedding, take_along_dim",
    source=f"aten/src/ATen/native/cuda/IndexKernel.cu, ScatterGatherKernel.cu; {TESTS}",
    bug="the index tensor is replaced by a new one after the capture",
)
def index_gather_scatter(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(512, 96, device="cuda"),
        "idx": torch.randint(0, 512, (700,), device="cuda"),
        "cols": torch.randint(0, 96, (512, 33), device="cuda"),
        "table": torch.randn(1000, 64, device="cuda"),
        "mask": torch.rand(512, 96, device="cuda") > 0.5,
    }

    def fn(x, idx, cols, table, mask):
        acc = torch.zeros(512, 96, device="cuda")
        acc.index_add_(0, idx, x.index_select(0, idx))
        put = torch.zeros(512, 96, device="cuda")
        put.index_put_((idx,), x[idx], accumulate=True)
        return [
            x.index_select(0, idx),
            torch.gather(x, 1, cols),
            torch.zeros(512, 96, device="cuda").scatter_add_(1, cols, x[:, :33]),
            acc,
            put,
            x[idx, 5:40:3],
            x.masked_fill(mask, 0.0),
            F.embedding(idx % 1000, table),
            torch.take_along_dim(x, cols, dim=1),
        ]

    _graph_and_check(case, inputs, fn, "idx")


@program(
    "kernels/cublas-split-k",
    pattern="GEMMs that pick split-K and cuBLASLt kernels: tall-skinny fp32 and bf16 products, "
    "addmm with a bias, bmm, baddbmm, a bf16 linear with its bias in the epilogue",
    source=f"aten/src/ATen/cuda/CUDABlas.cpp; {TESTS} test_graph_cublas*",
    bug="torch._C._cuda_clearCublasWorkspaces() and empty_cache() while the graph lives (the "
    "cleanup vLLM-style servers run between models): the graph's cuBLAS workspace is freed",
)
def cublas_split_k(case: Case) -> None:
    torch.manual_seed(0)
    s = torch.cuda.Stream()  # capture where the warm-up ran: the workspace is the eager one
    inputs = {
        "a": torch.randn(64, 16384, device="cuda"),
        "b": torch.randn(16384, 64, device="cuda"),
        "ab": torch.randn(96, 8192, device="cuda", dtype=torch.bfloat16),
        "bb": torch.randn(8192, 80, device="cuda", dtype=torch.bfloat16),
        "bias": torch.randn(80, device="cuda", dtype=torch.bfloat16),
        "x3": torch.randn(8, 128, 2048, device="cuda"),
        "y3": torch.randn(8, 2048, 96, device="cuda"),
    }

    def fn(a, b, ab, bb, bias, x3, y3):
        return [
            a @ b,
            ab @ bb,
            torch.addmm(bias.float(), ab.float(), bb.float()),
            torch.bmm(x3, y3),
            torch.baddbmm(torch.ones(8, 128, 96, device="cuda"), x3, y3, alpha=0.5),
            F.linear(ab, bb.t().contiguous(), bias),
        ]

    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fn(**inputs)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            outs = fn(**inputs)
    torch.cuda.current_stream().wait_stream(s)
    case.replay(g)
    torch.cuda.synchronize()
    with torch.no_grad():
        for i, (got, want) in enumerate(zip(outs, fn(**inputs), strict=True)):
            case.close(got, want, f"output {i} equals eager", 2e-2)
    if case.broken:
        for kind in ("freed", "reowned", "unmapped"):
            case.expect(kind)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        case.churn()
    case.replay(g)


@program(
    "kernels/sort-topk-scan",
    pattern="sort, argsort, topk, cumsum and cumprod along both dimensions, unique-free "
    "searchsorted and bucketize (CUB and PyTorch's own scan kernels)",
    source=f"aten/src/ATen/native/cuda/Sort.cu, TensorTopK.cu, ScanKernels.cu; {TESTS}",
    bug="the sorted tensor is dropped after the capture",
)
def sort_topk_scan(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(128, 3000, device="cuda"),
        "edges": torch.linspace(-3, 3, 64, device="cuda"),
    }

    def fn(x, edges):
        values, indices = torch.sort(x, dim=1)
        top, where = torch.topk(x, 17, dim=0)
        return [
            values,
            indices,
            top,
            where,
            torch.argsort(x[:, ::7], dim=1, descending=True),
            torch.cumsum(x, dim=0),
            torch.cumprod(x[:, :50] * 0.1 + 1.0, dim=1),
            torch.searchsorted(edges, x[:4].contiguous()),
            torch.bucketize(x[:4], edges),
        ]

    _graph_and_check(case, inputs, fn, "x")


@program(
    "kernels/fft",
    pattern="rfft, irfft and fft2 through cuFFT plans cached across the capture",
    source=f"aten/src/ATen/native/cuda/SpectralOps.cpp; {TESTS}",
    bug="the transformed signal is dropped after the capture",
)
def fft(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(64, 1000, device="cuda"),
        "img": torch.randn(8, 96, 80, device="cuda"),
    }

    def fn(x, img):
        spec = torch.fft.rfft(x, dim=1)
        return [
            torch.view_as_real(spec),
            torch.fft.irfft(spec, n=1000, dim=1),
            torch.view_as_real(torch.fft.fft2(img)),
        ]

    _graph_and_check(case, inputs, fn, "x")


@program(
    "kernels/conv-pool-norm",
    pattern="cuDNN convolutions (NCHW and channels-last), pooling, interpolation, BatchNorm "
    "updating its running statistics, GroupNorm, LayerNorm, RMSNorm: forward and backward",
    source=f"{TESTS}; https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture",
    bug="BatchNorm's running_mean buffer is replaced by a new tensor after the capture",
)
def conv_pool_norm(case: Case) -> None:
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False
    conv = torch.nn.Conv2d(8, 16, 3, padding=1).cuda()
    conv_cl = torch.nn.Conv2d(16, 16, 3, padding=1).cuda().to(memory_format=torch.channels_last)
    bn = torch.nn.BatchNorm2d(16).cuda()
    gn = torch.nn.GroupNorm(4, 16).cuda()
    ln = torch.nn.LayerNorm(32).cuda()
    rms = torch.nn.RMSNorm(32).cuda() if hasattr(torch.nn, "RMSNorm") else torch.nn.Identity()
    x = torch.randn(4, 8, 32, 32, device="cuda")
    params = [p for m in (conv, conv_cl, bn, gn, ln, rms) for p in m.parameters()]

    def step():
        h = F.relu(bn(conv(x)))
        h = conv_cl(h.contiguous(memory_format=torch.channels_last))
        h = gn(F.max_pool2d(h, 2))
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        loss = rms(ln(h)).square().mean()
        loss.backward()
        return loss.detach()

    def eager():
        for p in params:
            p.grad = None
        return step()

    case.warmup(eager)
    for p in params:
        p.grad = None
    g, loss = case.capture(step)
    case.replay(g, 2)
    torch.cuda.synchronize()
    case.check(bool(torch.isfinite(loss)), "the captured loss is finite")
    case.check(int(bn.num_batches_tracked) >= 3, "BatchNorm counts its batches")
    if case.broken:
        case.victim(bn.running_mean)
        bn.running_mean = torch.zeros(16, device="cuda")
        case.churn()
    case.replay(g)


@program(
    "kernels/loss-dropout-rng",
    pattern="cross-entropy with ignore_index and label smoothing, NLL, BCE-with-logits, "
    "dropout and randn inside the graph (graph-safe Philox offsets)",
    source=f"https://pytorch.org/docs/stable/notes/cuda.html#graph-safe-rng; {TESTS}",
    bug="the targets tensor is replaced by a new batch instead of copied into",
)
def loss_dropout_rng(case: Case) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 1000).cuda()
    inputs = {
        "x": torch.randn(256, 64, device="cuda"),
        "target": torch.randint(0, 1000, (256,), device="cuda"),
        "bits": torch.rand(256, 1000, device="cuda"),
    }
    inputs["target"][::17] = -100

    def step(x, target, bits):
        logits = head(F.dropout(x, 0.2, training=True))
        noise = torch.randn_like(logits) * 1e-3
        loss = (
            F.cross_entropy(logits + noise, target, ignore_index=-100, label_smoothing=0.1)
            + F.nll_loss(F.log_softmax(logits, dim=1), target.clamp_min(0))
            + F.binary_cross_entropy_with_logits(logits, bits)
        )
        loss.backward()
        return loss.detach()

    case.warmup(lambda: step(**inputs))
    head.zero_grad(set_to_none=True)
    g, loss = case.capture(lambda: step(**inputs))
    case.replay(g, 2)
    torch.cuda.synchronize()
    first = float(loss)
    case.replay(g)
    case.check(first != float(loss), "each replay draws new random numbers")
    case.drop_and_replay(g, inputs, "target")


@program(
    "kernels/foreach-scalar-lists",
    pattern="foreach kernels outside optimizers: scalar lists, lerp, addcdiv, norms over 400 "
    "tensors, clip_grad_norm_ (foreach), AMP's non-finite check and unscale",
    source="aten/src/ATen/native/cuda/ForeachBinaryOpScalarList.cu, ForeachReduceOp.cu, "
    "AmpKernels.cu; torch/nn/utils/clip_grad.py",
    bug="one tensor of the lists is dropped after the capture",
)
def foreach_scalar_lists(case: Case) -> None:
    torch.manual_seed(0)
    shapes = [((i * 13) % 97 + 1, (i * 7) % 31 + 1) for i in range(400)]
    inputs = {f"t{i}": torch.randn(s, device="cuda") for i, s in enumerate(shapes)}
    inputs["found_inf"] = torch.zeros(1, device="cuda")
    inputs["inv_scale"] = torch.full((1,), 0.5, device="cuda")
    scalars = [0.5 + (i % 5) * 0.1 for i in range(400)]
    params = [torch.zeros(s, device="cuda", requires_grad=True) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)

    def fn(found_inf, inv_scale, **tensors):
        ts = [tensors[f"t{i}"] for i in range(400)]
        out = torch._foreach_mul(ts, scalars)
        torch._foreach_add_(out, ts, alpha=0.25)
        lerped = torch._foreach_lerp(out, ts, 0.3)
        torch._foreach_addcdiv_(lerped, ts, [t.abs() + 1 for t in out], value=0.1)
        norms = torch._foreach_norm(lerped)
        grads = [p.grad for p in params]
        torch._foreach_copy_(grads, lerped)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        total = torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        return [torch.stack(norms), grads[0].clone(), grads[-1].clone(), total, found_inf.clone()]

    _graph_and_check(case, inputs, fn, "t211")


@program(
    "kernels/sdpa-attention",
    pattern="scaled_dot_product_attention forward and backward with each backend this GPU "
    "offers (flash, memory-efficient, cuDNN, math), causal and with a mask",
    source="https://pytorch.org/docs/stable/generated/torch.nn.functional."
    "scaled_dot_product_attention.html; pytorch test/test_transformers.py",
    bug="the query tensor is replaced by a new one after the capture",
)
def sdpa_attention(case: Case) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (2, 8, 256, 64)
    inputs = {
        n: torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for n in ("q", "k", "v")
    }
    mask = torch.rand(256, 256, device="cuda") > 0.1
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        backends.append(SDPBackend.CUDNN_ATTENTION)
    usable = []
    for backend in backends:
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(*inputs.values(), is_causal=True).sum().backward()
            usable.append(backend)
        except RuntimeError:
            continue
    if not usable:
        raise Skip("no attention backend runs here")

    def step(q, k, v):
        total = 0.0
        for backend in usable:
            with sdpa_kernel(backend):
                total = (
                    total + F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()
                )
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            total = total + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float().sum()
        total.backward()
        return total.detach()  # its autograd graph would keep the inputs alive

    case.warmup(lambda: step(**inputs))
    for t in inputs.values():
        t.grad = None
    g, total = case.capture(lambda: step(**inputs))
    case.replay(g, 2)
    torch.cuda.synchronize()
    case.check(bool(torch.isfinite(total)), "attention's sum is finite")
    case.drop_and_replay(g, inputs, "q")


@program(
    "kernels/transformer-layer",
    pattern="nn.TransformerEncoderLayer: a captured training step, then eval-mode inference "
    "(the fused fast path) captured too",
    source="https://pytorch.org/docs/stable/generated/torch.nn.TransformerEncoderLayer.html; "
    "pytorch test/test_transformers.py",
    bug="`.data =` on the layer's in-projection weight after the capture",
)
def transformer_layer(case: Case) -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True).cuda()
    x = torch.randn(8, 64, 256, device="cuda")

    def train_step():
        layer(x).square().mean().backward()

    case.warmup(train_step)
    layer.zero_grad(set_to_none=True)
    g_train, _ = case.capture(train_step)
    layer.eval()
    with torch.no_grad():
        g_eval, out = case.warmup_and_capture(lambda: layer(x))
        case.replay(g_eval)
        torch.cuda.synchronize()
        case.close(out, layer(x), "eval output equals eager", 1e-3)
    layer.train()
    case.replay(g_train, 2)
    if case.broken:
        w = layer.self_attn.in_proj_weight
        case.victim(w)
        w.data = w.data.clone()
        case.churn()
    case.replay(g_train)
    case.replay(g_eval)


@program(
    "kernels/grouped-mm",
    pattern="torch._grouped_mm over bf16 experts with device offsets (CUTLASS grouped GEMM, "
    "its argument tables built on the device)",
    source="aten/src/ATen/native/cuda/GroupMM.cu; Megatron/TE grouped experts",
    bug="the expert weights are replaced by a new tensor after the capture",
)
def grouped_mm(case: Case) -> None:
    if not hasattr(torch, "_grouped_mm"):
        raise Skip("this torch has no torch._grouped_mm")
    if torch.cuda.get_device_capability() < (9, 0):
        raise Skip("torch._grouped_mm needs sm_90 or newer")
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(512, 256, device="cuda", dtype=torch.bfloat16),
        "w": torch.randn(4, 256, 384, device="cuda", dtype=torch.bfloat16),
        "offs": torch.tensor([128, 192, 384, 512], device="cuda", dtype=torch.int32),
    }

    def fn(x, w, offs):
        return [torch._grouped_mm(x, w, offs=offs)]

    _graph_and_check(case, inputs, fn, "w", 2e-2)

"""How real programs use graphs: a static-KV-cache decode loop, per-microbatch graphs sharing a
pool in a pipeline schedule, graphs sharing a pool in sequence, pinned-host logging copies and
input prefetch, work forked onto side streams inside a capture, and memset nodes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphsan.selftest import program
from graphsan.selftest.case import Case

NOTES = "https://pytorch.org/docs/stable/notes/cuda.html"


@program(
    "patterns/static-kv-cache-decode",
    pattern="a decode step captured once and replayed per token: index_copy_ into a static KV "
    "cache at a device-side position, attention over the cache, the position bumped inside "
    "the graph",
    source="https://pytorch.org/blog/accelerating-generative-ai-2/ (gpt-fast); transformers' "
    "StaticCache",
    bug="the cache is grown after the capture (torch.cat into a new, longer cache) and the old "
    "one dropped",
)
def static_kv_cache_decode(case: Case) -> None:
    torch.manual_seed(0)
    heads, dim, max_len = 8, 64, 512
    qkv = torch.nn.Linear(heads * dim, 3 * heads * dim).cuda().half()
    cache = {
        "k": torch.zeros(1, heads, max_len, dim, device="cuda", dtype=torch.half),
        "v": torch.zeros(1, heads, max_len, dim, device="cuda", dtype=torch.half),
    }
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    token = torch.randn(1, 1, heads * dim, device="cuda", dtype=torch.half)
    steps = torch.arange(max_len, device="cuda")

    def decode():
        q, k, v = qkv(token).view(1, 1, 3, heads, dim).unbind(2)
        cache["k"].index_copy_(2, pos, k.transpose(1, 2))
        cache["v"].index_copy_(2, pos, v.transpose(1, 2))
        mask = (steps <= pos).view(1, 1, 1, max_len)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), cache["k"], cache["v"], mask)
        pos.add_(1)
        return out

    with torch.no_grad():
        case.warmup(decode)
        pos.zero_()
        cache["k"].zero_()
        cache["v"].zero_()
        g, out = case.capture(decode)
        pos.zero_()
        for _ in range(16):
            token.copy_(torch.randn_like(token))
            case.replay(g)
        torch.cuda.synchronize()
        case.check(int(pos) == 16, "the position advanced once per replay")
        case.check(bool(cache["k"][0, :, :16].abs().sum(-1).gt(0).all()), "16 keys cached")
        if case.broken:
            case.victim(cache["k"], cache["v"])
            for name in ("k", "v"):
                grown = torch.zeros(1, heads, max_len, dim, device="cuda", dtype=torch.half)
                cache[name] = torch.cat([cache[name], grown], dim=2)
            case.churn()
        case.replay(g)


@program(
    "patterns/pipeline-microbatch-pool",
    pattern="forward and backward graphs per microbatch sharing one pool, captured in a 1F1B "
    "order (F0 F1 B1 B0) and replayed in that order every step",
    source="https://github.com/NVIDIA/TransformerEngine make_graphed_callables(_order=...); "
    "Megatron-LM pipeline schedules",
    bug="a step replays B0 before B1, whose saved activation B0's capture re-carved",
)
def pipeline_microbatch_pool(case: Case) -> None:
    torch.manual_seed(0)
    w = torch.randn(512, 512, device="cuda") * 0.05
    xs = [torch.randn(256, 512, device="cuda") for _ in range(2)]
    grad_out = torch.randn(256, 512, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    with torch.no_grad():
        case.warmup(lambda: torch.tanh(xs[0] @ w) @ w)
    acts, graphs = {}, {}

    def fwd(i):
        def run():
            h = torch.tanh(xs[i] @ w)
            acts[i] = h
            return h @ w

        return run

    def bwd(i):
        def run():
            h = acts.pop(i)  # the activation is consumed here and freed in the pool
            dh = (grad_out @ w.t()) * (1 - h * h)
            return dh.sum(0) + (h.t() @ grad_out).sum(0)

        return run

    with torch.no_grad():
        for name, fn in (("F0", fwd(0)), ("F1", fwd(1)), ("B1", bwd(1)), ("B0", bwd(0))):
            graphs[name] = case.capture(fn, pool=pool)
        order = ["F0", "F1", "B1", "B0"]
        for _ in range(3):
            for name in order:
                case.replay(graphs[name][0])
        torch.cuda.synchronize()
        h0 = torch.tanh(xs[0] @ w)
        want = ((grad_out @ w.t()) * (1 - h0 * h0)).sum(0) + (h0.t() @ grad_out).sum(0)
        case.close(graphs["B0"][1], want, "B0's gradient equals eager", 1e-3)
        if case.broken:
            case.expect("replay-order")
            order = ["F0", "F1", "B0", "B1"]
        for name in order:
            case.replay(graphs[name][0])


@program(
    "patterns/shared-pool-sequence",
    pattern="three graphs in one pool, each consuming the last one's output and dropping it, "
    "so the third re-carves the first's output; replayed in capture order",
    source=f"{NOTES}#graph-memory-management; pytorch test/test_cuda.py "
    "test_graph_three_successive",
    bug="the graphs replay out of capture order (g0, g2, g1): g2 overwrites what g1 reads",
)
def shared_pool_sequence(case: Case) -> None:
    torch.manual_seed(0)
    a = torch.randn(1 << 20, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    out = {}

    def g0():
        out["b"] = a * 3
        out["c"] = out["b"] + 2
        return out["c"]

    def g1():
        c = out.pop("c")
        out.pop("b")
        out["d"] = c * 2
        return out["d"]

    def g2():
        out["f"] = out["d"] + 5
        return out["f"]

    with torch.no_grad():
        graphs = [case.capture(fn, pool=pool)[0] for fn in (g0, g1, g2)]
        for g in graphs:
            case.replay(g)
        torch.cuda.synchronize()
        case.close(out["f"], (a * 3 + 2) * 2 + 5, "the third graph's output equals eager")
        order = [0, 1, 2]
        if case.broken:
            case.expect("replay-order")
            order = [0, 2, 1]
        for i in order:
            case.replay(graphs[i])


@program(
    "patterns/pinned-host-logging",
    pattern="non_blocking device-to-host copies of the loss and a gradient norm into pinned "
    "buffers inside a training graph, read by the host after each replay",
    source=f"{NOTES}#whole-network-capture; Megatron-LM / TE loss logging",
    bug="the pinned logging buffer is replaced by a new pinned tensor after the capture",
)
def pinned_host_logging(case: Case) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    model = model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 128, device="cuda")
    y = torch.randn(64, 1, device="cuda")
    host = {"log": torch.zeros(2, pin_memory=True)}

    def step():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
        opt.step()
        host["log"].copy_(torch.stack([loss.detach(), norm]), non_blocking=True)

    def eager():
        opt.zero_grad(set_to_none=True)
        step()

    case.warmup(eager)
    opt.zero_grad(set_to_none=True)
    g, _ = case.capture(step)
    for _ in range(3):
        case.replay(g)
        torch.cuda.synchronize()
        case.check(float(host["log"][0]) > 0, "the host sees the logged loss")
    if case.broken:
        case.victim(host["log"])
        host["log"] = torch.zeros(2, pin_memory=True)
        churn = [torch.zeros(2, pin_memory=True) for _ in range(4)]
        del churn
    case.replay(g)
    torch.cuda.synchronize()


@program(
    "patterns/pinned-prefetch",
    pattern="host-to-device copies of the next batch from a pinned staging buffer inside the "
    "graph (a data loader's prefetch), and a device-to-host copy of the result",
    source=f"{NOTES}#use-pinned-memory-buffers; torch.utils.data pin_memory",
    bug="the pinned staging buffer is dropped after the capture and new batches are pinned",
)
def pinned_prefetch(case: Case) -> None:
    torch.manual_seed(0)
    stage = {"batch": torch.randn(64, 256).pin_memory()}
    result = torch.zeros(64, pin_memory=True)
    w = torch.randn(256, device="cuda")
    dev = torch.empty(64, 256, device="cuda")

    def step():
        dev.copy_(stage["batch"], non_blocking=True)
        result.copy_(dev @ w, non_blocking=True)

    g, _ = case.warmup_and_capture(step)
    for _ in range(3):
        stage["batch"].copy_(torch.randn(64, 256))
        case.replay(g)
        torch.cuda.synchronize()
        case.close(result, stage["batch"] @ w.cpu(), "the batch arrived", 1e-4)
    if case.broken:
        case.victim(stage["batch"])
        stage["batch"] = torch.randn(64, 256).pin_memory()
        churn = [torch.randn(64, 256).pin_memory() for _ in range(4)]
        del churn
    case.replay(g)
    torch.cuda.synchronize()


@program(
    "patterns/side-streams",
    pattern="work forked onto two side streams inside the capture and joined back with "
    "wait_stream (parallel branches in one graph)",
    source=f"{NOTES}#cuda-graphs (capture with side streams); pytorch test/test_cuda.py "
    "graph tests that fork and join streams",
    bug="a tensor only a side-stream branch reads is dropped after the capture",
)
def side_streams(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(1024, 1024, device="cuda"),
        "y": torch.randn(1024, 1024, device="cuda"),
    }
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def step():
        main = torch.cuda.current_stream()
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            a = inputs["x"] @ inputs["x"]
        with torch.cuda.stream(s2):
            b = torch.relu(inputs["y"]).sum(0)
        main.wait_stream(s1)
        main.wait_stream(s2)
        return a + b

    with torch.no_grad():
        g, out = case.warmup_and_capture(step)
        case.replay(g)
        torch.cuda.synchronize()
        case.close(out, inputs["x"] @ inputs["x"] + torch.relu(inputs["y"]).sum(0), "joined result")
        case.drop_and_replay(g, inputs, "y")


@program(
    "patterns/memset-fill",
    pattern="zero_, fill_ and small copies that become memset and memcpy nodes, beside kernels",
    source="pytorch test/test_cuda.py graph tests (memset nodes)",
    bug="the buffer the memset nodes clear is replaced after the capture",
)
def memset_fill(case: Case) -> None:
    bufs = {
        "acc": torch.empty(1 << 20, device="cuda"),
        "flags": torch.empty(4096, dtype=torch.int32, device="cuda"),
    }
    src = torch.randn(1 << 20, device="cuda")

    def step():
        bufs["acc"].zero_()
        bufs["flags"].fill_(0)
        bufs["acc"].add_(src)
        bufs["flags"][::2] = 1
        return bufs["acc"].sum()

    with torch.no_grad():
        g, total = case.warmup_and_capture(step)
        case.replay(g, 2)
        torch.cuda.synchronize()
        case.close(total, src.sum(), "sum after the memset", 1e-4)
        if case.broken:
            case.victim(bufs["acc"])
            bufs["acc"] = torch.empty(1 << 20, device="cuda")
            case.churn()
        case.replay(g)


@program(
    "patterns/replays-on-two-streams",
    pattern="two graphs of one pool, the second's output carved from the first's freed scratch, "
    "replayed on two streams with the second waiting for the first (wait_stream), as a side "
    "stream overlaps token dispatch with compute",
    source=f"{NOTES}#cuda-streams (stream semantics of backward passes, wait_stream); Megatron-LM "
    "and Transformer Engine overlap of MoE dispatch",
    bug="the second stream does not wait for the first: the two replays may run at the same "
    "time, the second writing into the scratch the first still computes in",
)
def replays_on_two_streams(case: Case) -> None:
    torch.manual_seed(0)
    x = torch.randn(1 << 24, device="cuda")
    pool = torch.cuda.graph_pool_handle()

    def long_chain():  # its intermediates are scratch, freed inside the capture
        t = x
        for _ in range(40):
            t = t * 0.999 + 0.001
        return t.sum()

    def doubled():  # carved from the chain's freed scratch
        return x * 2.0

    with torch.no_grad():
        want = long_chain()
        case.warmup(long_chain)
        case.warmup(doubled)
        g_chain, total = case.capture(long_chain, pool=pool)
        g_double, twice = case.capture(doubled, pool=pool)
        first, second = torch.cuda.Stream(), torch.cuda.Stream()
        main = torch.cuda.current_stream()
        for _ in range(3):
            first.wait_stream(main)
            with torch.cuda.stream(first):
                case.replay(g_chain)
            if case.broken:
                case.expect("replay-race")
            else:
                second.wait_stream(first)
            with torch.cuda.stream(second):
                case.replay(g_double)
            main.wait_stream(first)
            main.wait_stream(second)
            torch.cuda.synchronize()
            case.close(total, want, "the chain's sum equals eager", 1e-3)
            case.close(twice, x * 2.0, "the doubled output", 1e-6)

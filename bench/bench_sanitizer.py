"""What graphsan costs a graphed training step, and what the usual alternative (compute-sanitizer
memcheck) costs and finds, in one run on one GPU.

    python bench/bench_sanitizer.py [--layers 48] [--steps 200] [--optimizer fused] [--memcheck]

A stack of MLP blocks graphed per block with `torch.cuda.make_graphed_callables` (two graphs a
block, all in one pool, as Transformer Engine does), trained with AdamW (`--optimizer`: foreach,
whose temporaries make hundreds of eager allocations a step; fused, one kernel and few
allocations, as Megatron's and Transformer Engine's fused Adam; none). Each variant runs in its
own process (GPU-trace callbacks cannot be unregistered), interleaved over rounds; the table gives
the median step time and the ratio to "off". The variants (`--variants`):

- off: no graphsan;
- trace: no graphsan, PyTorch's GPU trace switched on with no callbacks: what PyTorch's own
  dispatch of every allocator and event call to Python costs, which graphsan cannot avoid while it
  listens to frees;
- record, raise: graphsan on its fallback path (`GRAPHSAN_TRACELOG=0`: allocator snapshots, and
  frees and allocation sites through PyTorch's GPU trace into Python), as where the compiled
  tracker cannot be built;
- record-nostacks: the same with `alloc_stacks=False` (no allocation-site walk per allocation);
- record-notrace: the same, then the GPU trace switched off again (it sees no frees, so it finds
  nothing): the cost of everything except the per-event callbacks;
- record-compiled: graphsan's default where the compiled tracker builds (`GRAPHSAN_TRACELOG=1`
  here, so that the run waits for the build): the tracker, and graphsan's own GPU-trace
  interpreter in place of PyTorch's dispatch (frees reach Python only where graphsan judges them,
  allocation sites are read in C++); the RESULT line's `allocator_log` says whether it was used.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time

from graphsan.command_line import read_result, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = (
    "off",
    "trace",
    "record",
    "record-nostacks",
    "record-notrace",
    "record-compiled",
    "raise",
)


def child(args: argparse.Namespace) -> None:
    import torch

    import graphsan
    from graphsan.report import format_finding

    torch.manual_seed(0)
    h, tokens = args.hidden, args.tokens
    variant = args.child
    san = None
    if variant == "trace":
        torch._C._activate_gpu_trace()
    elif variant != "off":
        policy = "raise" if variant == "raise" else "record"
        stacks = variant != "record-nostacks" and not args.no_alloc_stacks
        san = graphsan.enable(policy=policy, alloc_stacks=stacks)
        if variant == "record-notrace":
            set_gpu_trace(False)

    def block():
        return torch.nn.Sequential(
            torch.nn.LayerNorm(h),
            torch.nn.Linear(h, 4 * h),
            torch.nn.GELU(),
            torch.nn.Linear(4 * h, h),
        ).cuda()

    layers = [block() for _ in range(args.layers)]
    samples = tuple((torch.randn(tokens, h, device="cuda", requires_grad=True),) for _ in layers)
    t0 = time.perf_counter()
    graphed = torch.cuda.make_graphed_callables(tuple(layers), samples)
    capture_s = time.perf_counter() - t0
    params = [p for layer in layers for p in layer.parameters()]
    opt = None
    if args.optimizer != "none":
        fused = args.optimizer == "fused"
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=not fused, fused=fused)
    if args.bug:
        # eager code re-points a weight the graphs use: the old storage is freed (a stale read,
        # silent: the memory stays in the allocator's cache)
        layers[0][1].weight.data = layers[0][1].weight.data.clone()
    data = torch.randn(tokens, h, device="cuda")

    def step():
        x = data
        for g in graphed:
            x = x + g(x)
        loss = x.float().pow(2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None

    outcome = "ran"
    try:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        allocs_before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / args.steps * 1e3)
        # the eager allocations a step makes: what graphsan's per-allocation callbacks cost
        allocs = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - allocs_before
        allocs_per_step = allocs / (args.rounds * args.steps)
    except graphsan.StaleMemoryError as err:
        outcome = f"StaleMemoryError ({err.findings[0].kind})"
        if not args.bug:  # a finding on the clean run is a false alarm: say what it was
            outcome += ": " + format_finding(err.findings[0])
        times = [float("nan")]
        allocs_per_step = float("nan")
    events = count_trace_events(step) if variant == "trace" else {}
    if san is not None and not args.bug:
        for f in san.report().findings[:3]:  # record reports without stopping
            print("FINDING " + format_finding(f), flush=True)
    stats = san.report().graphs if san else []
    nodes = sum(g["nodes"] for g in stats)
    analysis_ms = sum(g["analysis_ms"] for g in stats)
    stages = {}
    for g in stats:
        for k, v in g.get("analysis_ms_by_stage", {}).items():
            stages[k] = stages.get(k, 0.0) + v
    write_result(
        {
            "variant": args.child,
            "step_ms": statistics.median(times),
            "capture_s": capture_s,
            "graphs": len(stats),
            "nodes": nodes,
            "references": sum(g["references"] for g in stats),
            "analysis_ms": analysis_ms,
            "analysis_ms_by_stage": stages,
            "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "outcome": outcome,
            "allocs_per_step": allocs_per_step,
            "trace_events_per_step": events,
            "allocator_log": san.report().allocator_log if san else None,
        }
    )


def set_gpu_trace(on: bool) -> None:
    """Switch PyTorch's GPU trace dispatch on or off (c10::impl::GPUTrace::haveState: PyTorch
    offers no way to switch it off once on; a diagnostic for this bench only)."""
    import ctypes

    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "_ZN3c104impl8GPUTrace9haveStateE").value = on


def count_trace_events(step, steps: int = 3) -> dict[str, float]:
    """The GPU-trace events a step fires, per kind (each one is a call into Python)."""
    import torch
    from torch.cuda import _gpu_trace

    counts: dict[str, int] = {}
    for name in dir(_gpu_trace):
        reg = getattr(_gpu_trace, name)
        if name.endswith("Callbacks") and hasattr(reg, "add_callback"):

            def bump(*_args, _name=name[: -len("Callbacks")]):
                counts[_name] = counts.get(_name, 0) + 1

            reg.add_callback(bump)
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return {k: v / steps for k, v in sorted(counts.items())}


def run_child(variant: str, args: argparse.Namespace, extra=(), prefix=(), bug=False):
    cmd = [
        *prefix,
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--layers",
        str(args.layers),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--hidden",
        str(args.hidden),
        "--tokens",
        str(args.tokens),
        "--optimizer",
        args.optimizer,
        *extra,
    ]
    if bug:
        cmd.append("--bug")
    if args.no_alloc_stacks:
        cmd.append("--no-alloc-stacks")
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    if variant.startswith(("record", "raise")):
        env["GRAPHSAN_TRACELOG"] = "1" if variant == "record-compiled" else "0"
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t
    res = read_result(proc.stdout)
    if res is not None:
        res["wall_s"] = wall
        res["log"] = proc.stdout[-4000:] + proc.stderr[-4000:]
        return res
    return {
        "variant": variant,
        "outcome": f"failed rc={proc.returncode}",
        "wall_s": wall,
        "log": proc.stdout[-4000:] + proc.stderr[-4000:],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=VARIANTS)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)} (off is always run: the baseline)",
    )
    p.add_argument(
        "--optimizer",
        choices=["foreach", "fused", "none"],
        default="foreach",
        help="AdamW with foreach (many eager allocations a step), fused (few), or none",
    )
    p.add_argument("--bug", action="store_true")
    p.add_argument(
        "--no-alloc-stacks",
        action="store_true",
        help="every graphsan variant with alloc_stacks=False (no allocation-site walk per allocation)",
    )
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the variants")
    p.add_argument("--memcheck", action="store_true", help="also run compute-sanitizer memcheck")
    args = p.parse_args()
    variants = ["off", *(v for v in args.variants.split(",") if v and v != "off")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(
            f"--variants: unknown {', '.join(unknown)} (expected some of {', '.join(VARIANTS)})"
        )
    if args.child:
        child(args)
        return

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_sanitizer: needs a CUDA GPU (torch.cuda.is_available() is False)")

    print(
        f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  layers={args.layers} "
        f"hidden={args.hidden} tokens={args.tokens} optimizer={args.optimizer}"
    )
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in results:
            results[v].append(run_child(v, args))
    base = statistics.median(r["step_ms"] for r in results["off"])
    print(
        "| variant | step ms (median of runs) | runs | ratio vs off | graphs | nodes | analysis ms/node | capture s | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for v, rs in results.items():
        ms = [r.get("step_ms", float("nan")) for r in rs]
        r0 = rs[0]
        per_node = r0["analysis_ms"] / r0["nodes"] if r0.get("nodes") else float("nan")
        print(
            f"| {v} | {statistics.median(ms):.3f} | {', '.join(f'{m:.3f}' for m in ms)} | "
            f"{statistics.median(ms) / base:.4f} | {r0.get('graphs', 0)} | {r0.get('nodes', 0)} | "
            f"{per_node:.4f} | {r0.get('capture_s', float('nan')):.2f} | {r0.get('rss_mb', 0):.0f} |"
        )
        if "failed" in r0.get("outcome", ""):
            print(r0["log"])
        elif r0.get("outcome", "ran") != "ran" or "FINDING " in r0.get("log", ""):
            print(f"# {v}: a finding on the clean run (a false alarm): {r0['outcome']}")
            print(r0["log"][-3000:])
    for v, rs in results.items():
        by = rs[0].get("analysis_ms_by_stage")
        if by and rs[0].get("nodes"):
            n = rs[0]["nodes"]
            parts = ", ".join(f"{k} {ms / n:.3f}" for k, ms in by.items())
            print(f"# {v}: capture analysis ms per node by stage: {parts}")
    for v, rs in results.items():
        if rs[0].get("allocator_log"):
            print(f"# {v}: allocator events from {rs[0]['allocator_log']}")
    allocs = statistics.median(r.get("allocs_per_step", float("nan")) for r in results["off"])
    print(f"# eager allocations per step: {allocs:.0f}")
    if results.get("trace"):
        events = results["trace"][0].get("trace_events_per_step") or {}
        total = sum(events.values())
        parts = ", ".join(f"{k} {n:.0f}" for k, n in events.items() if n)
        print(f"# GPU-trace events per step (each a call into Python): {total:.0f} ({parts})")
    for v in [v for v in variants if v != "off"]:
        extra = statistics.median(r.get("step_ms", float("nan")) for r in results[v]) - base
        if allocs == allocs and allocs > 0:  # not nan
            print(
                f"# {v}: {extra * 1e3 / allocs:.2f} us of added step time per eager allocation (if allocations were all of it)"
            )

    # the bug: a weight re-pointed under the graphs (silent stale read)
    bug_raise = run_child("raise", args, bug=True)
    print(
        f"\nbug (weight .data replaced, no empty_cache) under graphsan raise: {bug_raise['outcome']}"
    )
    if args.memcheck:
        cs = shutil.which("compute-sanitizer")
        if cs is None:
            print("compute-sanitizer: not found on PATH")
            return
        small = argparse.Namespace(**{**vars(args), "steps": 5, "rounds": 1, "layers": 8})
        plain = run_child("off", small, extra=["--warmup", "2"])
        mc = run_child(
            "off",
            small,
            extra=["--warmup", "2"],
            prefix=[cs, "--tool", "memcheck", "--print-limit", "5"],
        )
        mc_bug = run_child(
            "off",
            small,
            extra=["--warmup", "2"],
            prefix=[cs, "--tool", "memcheck", "--print-limit", "5"],
            bug=True,
        )
        found = "Invalid __global__" in mc_bug["log"]
        print("| run | step ms | whole process s | reports the bug |")
        print("|---|---|---|---|")
        print(f"| plain | {plain.get('step_ms', float('nan')):.3f} | {plain['wall_s']:.1f} | - |")
        print(
            f"| memcheck, clean | {mc.get('step_ms', float('nan')):.3f} | {mc['wall_s']:.1f} | - |"
        )
        print(
            f"| memcheck, bug | {mc_bug.get('step_ms', float('nan')):.3f} | {mc_bug['wall_s']:.1f} | "
            f"{'yes' if found else 'no'} |"
        )
        print(
            f"memcheck slowdown per step: {mc.get('step_ms', float('nan')) / plain['step_ms']:.1f}x"
        )
        if not found:
            print("memcheck bug-run tail:", mc_bug["log"][-600:])


if __name__ == "__main__":
    main()

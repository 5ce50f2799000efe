"""What graphsan adds to capturing CUDA graphs in a process that holds many allocator blocks.

    python bench/bench_capture_scale.py [--blocks 1000,20000,100000] [--graphs 200]
                                        [--scale-graphs 1000 --scale-nodes 100 --scale-blocks 20000]

Two runs, each variant (off, record, raise) in its own fresh process:
- the block sweep: N live blocks (small tensors of several sizes, allocated with graphsan already
  on, as under `graphsan run`), then `--graphs` captures of three kernel nodes each;
- the scale run: `--scale-graphs` graphs of `--scale-nodes` kernel nodes each (elementwise kernels
  and cuBLAS matmuls, whose operands sit in packed parameter buffers) over `--scale-blocks` live
  blocks, then every graph replayed.
Per variant: the first capture, the median capture, the whole capture phase, the replay round,
the allocation phase and the resident memory; ratios are to "off". The capture analysis split by
stage comes from graphsan's own report (the median graph, the first capture aside: it seeds the
allocator view); the last columns say where graphsan read the allocator's events (the compiled
tracker, graphsan's default, built into the cache before the first run; or snapshots and why;
`GRAPHSAN_TRACELOG=0` forces snapshots) and what walked the graphs. `--repeats N` runs every
variant in N processes, interleaved, and gives the median of each number: processes of one
variant differ by up to a third on the H200's host.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

from graphsan.command_line import read_result, write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("off", "record", "raise")


def child(args: argparse.Namespace) -> None:
    import torch

    import graphsan

    variant, blocks, graphs, nodes = args.child, args.n_blocks, args.n_graphs, args.n_nodes
    torch.empty(1, device="cuda")  # the CUDA context, outside every timing
    t0 = time.perf_counter()
    san = graphsan.enable(policy=variant) if variant != "off" else None
    enable_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sizes = (128, 512, 1000, 2048, 4096, 3000)
    hold = [torch.empty(sizes[i % len(sizes)], device="cuda") for i in range(blocks)]
    torch.cuda.synchronize()
    alloc_s = time.perf_counter() - t0
    w = torch.randn(64, 64, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # cuBLAS makes its handle outside any capture
        (w @ w).sum().item()
    captured, times = [], []
    for i in range(graphs):
        x = torch.randn(64, 64, device="cuda")
        g = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.graph(g, stream=stream):
            y = x
            for k in range(nodes):
                y = y @ w if k % 10 == 9 else y * 1.0001
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        captured.append((g, x, y))
        if i == 0:
            del hold[-1]  # one free in the process (not referenced by any graph)
    for g, _, _ in captured:  # warm the replays
        g.replay()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for g, _, _ in captured:
            g.replay()
        torch.cuda.synchronize()
        rounds.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20_000):  # what every eager allocation pays: an alloc/free pair
        del_me = torch.empty(1024, device="cuda")
        del del_me
    pair_us = (time.perf_counter() - t0) / 20_000 * 1e6
    stages: dict[str, float] = {}
    walks: dict[str, int] = {}
    if san is not None:  # the median graph of each stage, the first capture (the seed) aside
        per_graph = san.report().graphs
        for st in per_graph:
            walks[st.get("walk", "?")] = walks.get(st.get("walk", "?"), 0) + 1
        later = per_graph[1:] or per_graph
        for k in later[0].get("analysis_ms_by_stage", {}) if later else ():
            stages[k] = statistics.median(st["analysis_ms_by_stage"][k] for st in later)
    out = {
        "enable_s": enable_s,
        "alloc_s": alloc_s,
        "pair_us": pair_us,
        "first_ms": times[0] * 1e3,
        "median_ms": statistics.median(times[1:] or times) * 1e3,
        "phase_s": sum(times),
        "replay_ms": statistics.median(rounds) * 1e3,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "segments": torch.cuda.memory_stats().get("segment.all.current", 0),
        "stages_ms": stages,
        "disabled": san.disabled_reason if san is not None else None,
        "allocator_log": san.memory.event_source if san is not None else None,
        "walks": walks,
        "findings": len(san.findings) if san is not None else 0,
        "kernel_nodes": sum(s.get("kernels", 0) for s in san.report().graphs) if san else None,
    }
    write_result(out)


def run(variant: str, blocks: int, graphs: int, nodes: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--child", variant, "--n-blocks", str(blocks)]
    cmd += ["--n-graphs", str(graphs), "--n-nodes", str(nodes)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    res = read_result(proc.stdout)
    if res is not None:
        return res
    raise SystemExit(f"{variant} at {blocks} blocks failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def repeated(variants: list[tuple[str, tuple]], repeats: int) -> list[tuple[str, dict]]:
    """Each (name, run arguments) in `repeats` processes, interleaved; per name the median of
    every number over its processes (stages too), the rest from the first."""
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for _ in range(repeats):
        for name, argv in variants:
            runs[name].append(run(*argv))
    out = []
    for name, rs in runs.items():
        merged = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                merged[k] = statistics.median(r[k] for r in rs)
        merged["stages_ms"] = {
            k: statistics.median(r["stages_ms"][k] for r in rs) for k in rs[0]["stages_ms"]
        }
        merged["findings"] = max(r["findings"] for r in rs)
        merged["disabled"] = next((r["disabled"] for r in rs if r["disabled"]), None)
        out.append((name, merged))
    return out


def table(title: str, rows: list[tuple[str, dict]]) -> None:
    base = {k: v for k, v in rows if k.endswith("off")}
    print(f"\n{title}")
    print(
        "| run | first capture ms | median capture ms | vs off | capture phase s | vs off "
        "| replay round ms | vs off | alloc phase s | alloc+free us | RSS MB | segments "
        "| analysis ms/graph by stage (median) | allocator log | graph walk |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key, r in rows:
        off = base[key.rsplit(" ", 1)[0] + " off"]
        stages = ", ".join(f"{k} {v:.3f}" for k, v in r["stages_ms"].items()) or "-"
        print(
            f"| {key} | {r['first_ms']:.2f} | {r['median_ms']:.3f} "
            f"| {r['median_ms'] / off['median_ms']:.2f}x | {r['phase_s']:.2f} "
            f"| {r['phase_s'] / off['phase_s']:.2f}x | {r['replay_ms']:.3f} "
            f"| {r['replay_ms'] / off['replay_ms']:.4f} | {r['alloc_s']:.2f} | {r['pair_us']:.1f} "
            f"| {r['rss_mb']:.0f} | {r.get('segments', '-')} "
            f"| {stages} | {r.get('allocator_log') or '-'} "
            f"| {', '.join(f'{k} x{n}' for k, n in r.get('walks', {}).items()) or '-'} |"
        )
        if r["disabled"] or r["findings"]:
            print(f"  ! {key}: disabled={r['disabled']} findings={r['findings']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="1000,20000,100000", help="live blocks, comma-separated")
    p.add_argument("--graphs", type=int, default=200, help="captures per block count")
    p.add_argument("--scale-graphs", type=int, default=1000)
    p.add_argument("--scale-nodes", type=int, default=100)
    p.add_argument("--scale-blocks", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=1, help="processes per variant (median)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--n-blocks", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n-graphs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n-nodes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    try:
        counts = [int(x) for x in args.blocks.split(",") if x]
    except ValueError:
        p.error(f"--blocks: expected comma-separated integers, got {args.blocks!r}")
    if args.repeats < 1:
        p.error(f"--repeats: expected at least 1, got {args.repeats}")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_capture_scale: needs a CUDA GPU (torch.cuda.is_available() is False)"
        )
    if os.environ.get("GRAPHSAN_TRACELOG", "").strip() != "0":
        # the compiled tracker into the cache first, so that no variant reads snapshots meanwhile
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
        subprocess.run([sys.executable, "-m", "graphsan.cuda.tracelog"], env=env, check=False)
    sweep = repeated(
        [(f"{n} blocks {v}", (v, n, args.graphs, 3)) for n in counts for v in VARIANTS],
        args.repeats,
    )
    table(f"Block sweep: {args.graphs} graphs of 3 kernel nodes ({args.repeats} runs)", sweep)
    g, n, b = args.scale_graphs, args.scale_nodes, args.scale_blocks
    scale = repeated([(f"scale {v}", (v, b, g, n)) for v in VARIANTS], args.repeats)
    nodes = scale[1][1]["kernel_nodes"]
    table(f"Scale: {g} graphs of {n} kernel nodes ({nodes} kernel nodes seen), {b} blocks", scale)


if __name__ == "__main__":
    main()

"""Benchmark QuantLinear (and the grouped experts' GroupedQuantLinear) forward+backward against a
bf16 `nn.Linear` (CUDA only); prints one ratio table with every GEMM path.

    PYTHONPATH=src python3 bench/bench_quant_linear.py [--size 8192] [--iters 10] [--profile]

x [size, size] bf16, weight [size, size]; one eager step (forward, backward into main_grad)
timed alone between two CUDA events, the median of the runs. Per quantized recipe three GEMM
paths: "prepared" (the default on CUDA: each operand dequantized to bf16 by one Triton pass over
its packed data, then cuBLAS), "fused GEMM" (`kernels.launch_gemm.FUSED_GEMM`: one Triton GEMM reads
the packed operands), and "torch" (GRAPHSAN_NO_TRITON=1: the torch reference for quantization and
dequantization, what the emulation cost before the kernels). Targets: NVFP4 at most
2.5x and MXFP8 at most 1.8x of nn.Linear. The grouped rows run GroupedQuantLinear with GROUPS
equal experts of [size/2, size/2] weights over the same rows, against its own bf16 recipe.
`--profile` then prints, per quantized recipe on the default path, where one step's device time
goes (torch.profiler, kernels grouped by name, the largest first).
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
from quant_timing import bench

from graphsan.lab.quant import GroupedQuantLinear, QuantLinear, get_recipe, kernels

TARGETS = {"nvfp4": 2.5, "mxfp8": 1.8}
GROUPS = 8
PATHS = ("prepared", "fused GEMM", "torch")


def _use_path(path: str) -> None:
    from graphsan.lab.quant.kernels import launch_gemm

    launch_gemm.FUSED_GEMM = path == "fused GEMM"
    if path == "torch":
        os.environ["GRAPHSAN_NO_TRITON"] = "1"
    else:
        os.environ.pop("GRAPHSAN_NO_TRITON", None)


def quant_linear_table(n: int, iters: int) -> None:
    """Print the QuantLinear table for size n (tokens = in = out = n)."""
    dev = torch.device("cuda")
    reps = max(3, iters)
    print(f"QuantLinear fwd+bwd, x [{n}, {n}] bf16, weight [{n}, {n}]: step time vs bf16 nn.Linear")
    xg = torch.randn(n, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    base = torch.nn.Linear(n, n, bias=False, device=dev, dtype=torch.bfloat16)

    def step(mod, *extra):
        def run():
            xg.grad = None
            mod(xg, *extra).backward(dy)

        return run

    t_base = bench(step(base), reps)
    print("| module | recipe | GEMM path | ms/step | vs baseline | target |")
    print("|---|---|---|---|---|---|")
    print(f"| nn.Linear | bf16 | cuBLAS | {t_base * 1e3:.2f} | 1.00 | - |")
    for name in ("bf16", "fp8", "mxfp8", "nvfp4"):
        lin = QuantLinear(n, n, device=dev)
        lin.set_recipe(get_recipe(name))
        for path in PATHS if name in TARGETS else ("prepared",):
            _use_path(path)
            lin.clear_workspace()
            t = bench(step(lin), reps)
            ratio = t / t_base
            target = "-"
            if name in TARGETS and path == "prepared":
                ok = "ok" if ratio <= TARGETS[name] else "MISSED"
                target = f"<= {TARGETS[name]}x {ok}"
            print(
                f"| QuantLinear | {lin.recipe.describe()} | {path} | {t * 1e3:.2f} | "
                f"{ratio:.2f} | {target} |"
            )
        _use_path("prepared")
        del lin
        torch.cuda.empty_cache()

    half = n // 2
    xs = torch.randn(n, half, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dys = torch.randn(n, half, device=dev, dtype=torch.bfloat16)
    offsets = torch.arange(1, GROUPS + 1, device=dev, dtype=torch.int32) * (n // GROUPS)

    def grouped_step(mod):
        def run():
            xs.grad = None
            mod(xs, offsets).backward(dys)

        return run

    t_gbase = None
    for name in ("bf16", "mxfp8", "nvfp4"):
        lin = GroupedQuantLinear(GROUPS, half, half, device=dev)
        lin.set_recipe(get_recipe(name))
        for path in ("prepared", "torch") if name != "bf16" else ("prepared",):
            _use_path(path)
            lin.clear_workspace()
            t = bench(grouped_step(lin), reps)
            t_gbase = t if t_gbase is None else t_gbase
            print(
                f"| GroupedQuantLinear ({GROUPS} x [{half}, {half}]) | {lin.recipe.describe()} | "
                f"{path} | {t * 1e3:.2f} | {t / t_gbase:.2f} (vs grouped bf16) | - |"
            )
        _use_path("prepared")
        del lin
        torch.cuda.empty_cache()


def profile_table(n: int, top: int = 12) -> None:
    """Per quantized recipe (default GEMM path), one step's device time by kernel."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    xg = torch.randn(n, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for name in ("mxfp8", "nvfp4"):
        lin = QuantLinear(n, n, device=dev)
        lin.set_recipe(get_recipe(name))
        for _ in range(3):
            xg.grad = None
            lin(xg).backward(dy)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                xg.grad = None
                lin(xg).backward(dy)
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda e: -e.device_time_total)
        total = sum(e.self_device_time_total for e in rows) / 3 / 1e3
        print(f"\nprofile, QuantLinear {lin.recipe.describe()}: {total:.2f} ms of kernels a step")
        print("| kernel | ms/step | calls/step |")
        print("|---|---|---|")
        for e in rows[:top]:
            print(f"| {e.key[:90]} | {e.self_device_time_total / 3 / 1e3:.3f} | {e.count / 3:g} |")
        del lin
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="then each recipe's kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant_linear: needs CUDA")
    if not kernels.available():
        raise SystemExit("bench_quant_linear: needs Triton")
    import triton

    print(f"# bench_quant_linear {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    )
    quant_linear_table(args.size, args.iters)
    if args.profile:
        profile_table(args.size)


if __name__ == "__main__":
    main()

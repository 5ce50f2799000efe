"""Host cost of one quantized module call (forward + backward) on the CUDA path, at the lab
trainer's sizes, where the kernels are small and an eager step waits on the host.

    PYTHONPATH=src python3 bench/bench_host.py [--iters 50] [--tokens 2048]

For QuantLinear [tokens, 512] -> 1024 (the shared expert's fc1) and GroupedQuantLinear (64
experts of [256 -> 256], tokens x 6 routed rows, the routed experts' fc1), per recipe: the wall
time of `iters` calls launched back to back, divided by `iters` (host-bound at these sizes: the
GPU finishes each call's kernels before the host has launched the next call's); the same with the
skip flag at 1 (every microbatch after the first: a `SkipFlag`, as the trainer's, so the weight is
not quantized then); the torch operators and Triton launches a call makes; and the host time
spent launching those (`fastlaunch`, and Triton's binding for a key not seen before). Prints one table; never asserts timings.
`--cprofile RECIPE` then profiles both modules' calls with that recipe (cProfile, the functions
with the most time of their own first).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphsan.lab.quant import GroupedQuantLinear, QuantLinear, SkipFlag, get_recipe, kernels

RECIPES = ("bf16", "mxfp8", "nvfp4")
EXPERTS, TOPK = 64, 6


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _TritonLaunches:
    """Counts the quantize kernels' launches and the host time inside them (wraps
    `fastlaunch.FastKernel._run`, through which the `kernels.launch_*` modules launch every
    kernel)."""

    def __init__(self):
        from graphsan.lab.quant.kernels.fastlaunch import FastKernel

        self.orig = FastKernel._run
        self.n, self.seconds = 0, 0.0
        self.on = False

        def run(fn, *args, **kw):
            if not self.on:
                return self.orig(fn, *args, **kw)
            t0 = time.perf_counter()
            try:
                return self.orig(fn, *args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0
                self.n += 1

        FastKernel._run = run


def _cases(tokens: int, dev):
    x = torch.randn(tokens, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
    rows = tokens * TOPK
    xe = torch.randn(rows, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    per = rows // EXPERTS // 32 * 32
    offsets = torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.int32) * per
    lin = lambda: QuantLinear(512, 1024, device=dev)  # noqa: E731
    grp = lambda: GroupedQuantLinear(EXPERTS, 256, 256, device=dev)  # noqa: E731
    return [
        ("QuantLinear 512->1024", lin, lambda m: m(x)),
        (f"GroupedQuantLinear {EXPERTS}x256->256", grp, lambda m: m(xe, offsets)),
    ]


def measure(m, call, iters: int, launches: _TritonLaunches) -> list[str]:
    """The table cells of one module: host us per call with the skip flag at 0 and at 1, torch
    operators, Triton launches and the us spent launching them per call (flag at 0)."""
    m.skip_weight_update = SkipFlag("cuda")  # as the trainer shares it
    grad = []

    def step():
        y = call(m)
        if not grad:
            grad.append(torch.randn_like(y))
        y.backward(grad[0])

    times = {}
    for skip in (1, 0):
        m.skip_weight_update.set(skip)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        launches.on, launches.n, launches.seconds = skip == 0, 0, 0.0
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
        times[skip] = (time.perf_counter() - t0) / iters
        launches.on = False
    with _CountOps() as ops:
        step()
    return [
        f"{times[0] * 1e6:.0f}",
        f"{times[1] * 1e6:.0f}",
        f"{ops.n}",
        f"{launches.n / iters:.0f}",
        f"{launches.seconds / iters * 1e6:.0f}",
    ]


def launch_costs(iters: int) -> str:
    """Host us per launch of a one-program Triton kernel with the quantize kernels' launch
    options, and of a small torch in-place add (the two kinds of launches a call makes)."""
    from graphsan.lab.quant.kernels.gemm import dequant_nvfp4_kernel
    from graphsan.lab.quant.kernels.launch_common import COMPILE_OPTIONS
    from graphsan.lab.quant.kernels.launch_gemm import DEQUANT_NVFP4_TILE

    data = torch.zeros(4096, device="cuda", dtype=torch.uint8)
    scale = torch.zeros(512, device="cuda", dtype=torch.uint8)
    out = torch.empty(8192, device="cuda", dtype=torch.int32)

    def triton_launch():
        dequant_nvfp4_kernel[(2,)](
            data, scale, out, 4096, NAN16=0, EVEN=True, **DEQUANT_NVFP4_TILE, **COMPILE_OPTIONS
        )

    result = []
    for fn in (triton_launch, lambda: out.add_(1)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters * 20):
            fn()
        torch.cuda.synchronize()
        result.append((time.perf_counter() - t0) / (iters * 20) * 1e6)
    return f"host us per launch: Triton kernel {result[0]:.1f}, torch add_ {result[1]:.1f}"


def cprofile(m, call, iters: int) -> None:
    import cProfile
    import pstats

    y = call(m)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        call(m).backward(grad)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--cprofile", choices=RECIPES, help="then a cProfile of this recipe's calls")
    a = ap.parse_args()
    if a.iters < 1 or a.tokens < 256 or a.tokens % 256:
        print(
            f"bench_host: --iters {a.iters} --tokens {a.tokens}: expected iters >= 1 and tokens a "
            "multiple of 256",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("bench_host: expected a CUDA GPU (it times the CUDA code path)", file=sys.stderr)
        return 2
    if not kernels.available():
        print("bench_host: expected Triton (the quantize kernels)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    launches = _TritonLaunches()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.tokens} tokens")
    print(
        "| module | recipe | host us/call | skip=1 us/call | torch ops | Triton launches | "
        "us launching them |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    footer = launch_costs(a.iters)
    for name, make, call in _cases(a.tokens, dev):
        for recipe in RECIPES:
            m = make()
            m.set_recipe(get_recipe(recipe))
            row = measure(m, call, a.iters, launches)
            print(f"| {name} | {recipe} | " + " | ".join(row) + " |", flush=True)
            if recipe == a.cprofile:
                cprofile(m, call, a.iters)
            del m
    print(footer)
    return 0


if __name__ == "__main__":
    sys.exit(main())

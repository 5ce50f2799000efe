"""Benchmark the lab's quantize kernels and QuantLinear (CUDA only); prints ratio tables.

    PYTHONPATH=src python3 bench/bench_quant.py [--size 8192] [--iters 20]

1. Each Triton quantize kernel on a size x size bf16 tensor: time, achieved bytes/s (bytes that
   must move: the bf16 input read once plus the outputs written), as a fraction of a measured
   device copy bandwidth (`dst.copy_(src)`, read + write), and the speedup over the torch
   reference. The NVFP4 quantize rows time the quantize kernel given the global amax (computed
   once, as TE computes it in a separate kernel or fused into the op before); the amax pass has
   its own row, and "end to end" rows time both, crediting both reads of the input.
2. QuantLinear forward+backward step time per recipe vs a bf16 `nn.Linear` (tokens = in = out =
   size), as a ratio.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from graphsan.lab.quant import QuantLinear, get_recipe, mxfp8, nvfp4, triton_kernels


def bench(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-linear", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant: needs CUDA")
    if not triton_kernels.available():
        raise SystemExit("bench_quant: needs Triton")
    import triton

    n = args.size
    dev = torch.device("cuda")
    print(f"# bench_quant {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"size {n}x{n} bf16"
    )
    torch.manual_seed(0)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    elems = x.numel()
    t_copy = bench(lambda: dst.copy_(x), args.iters)
    copy_bw = 2 * elems * 2 / t_copy
    print(
        f"# device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read+write of {2 * elems / 2**20:.0f} MiB)"
    )
    gen = torch.Generator(device=dev).manual_seed(0)

    def ref_both():
        mxfp8.quantize_reference(x, -1)
        mxfp8.quantize_reference(x, 0)

    amax = triton_kernels.global_amax(x)
    rows = [
        # name, triton fn, reference fn, bytes moved, target fraction of copy bandwidth
        ("mxfp8 row+col (1 pass)", lambda: triton_kernels.mxfp8_quantize_both(x), ref_both,
         2 * elems + 2 * elems + 2 * elems // 32, 0.70),
        ("mxfp8 rowwise", lambda: triton_kernels.mxfp8_quantize(x, -1),
         lambda: mxfp8.quantize_reference(x, -1), 2 * elems + elems + elems // 32, 0.70),
        ("mxfp8 columnwise", lambda: triton_kernels.mxfp8_quantize(x, 0),
         lambda: mxfp8.quantize_reference(x, 0), 2 * elems + elems + elems // 32, 0.70),
        ("nvfp4 global amax", lambda: triton_kernels.global_amax(x),
         lambda: x.abs().amax(), 2 * elems, None),
        ("nvfp4 rowwise 1D", lambda: triton_kernels.nvfp4_quantize(x, -1, amax=amax),
         lambda: nvfp4.quantize_reference(x, -1), 2 * elems + elems // 2 + elems // 16, 0.60),
        ("nvfp4 columnwise 1D", lambda: triton_kernels.nvfp4_quantize(x, 0, amax=amax),
         lambda: nvfp4.quantize_reference(x, 0), 2 * elems + elems // 2 + elems // 16, 0.60),
        ("nvfp4 rowwise 2D (weights)", lambda: triton_kernels.nvfp4_quantize(x, -1, block_2d=True, amax=amax),
         lambda: nvfp4.quantize_reference(x, -1, block_2d=True), 2 * elems + elems // 2 + elems // 16, 0.60),
        ("nvfp4 rowwise 1D end to end", lambda: triton_kernels.nvfp4_quantize(x, -1),
         lambda: nvfp4.quantize_reference(x, -1), 4 * elems + elems // 2 + elems // 16, None),
        ("nvfp4 columnwise 1D end to end", lambda: triton_kernels.nvfp4_quantize(x, 0),
         lambda: nvfp4.quantize_reference(x, 0), 4 * elems + elems // 2 + elems // 16, None),
        ("nvfp4 col RHT+SR (wgrad dY)", lambda: triton_kernels.nvfp4_quantize(x, 0, rht=True, generator=gen),
         lambda: nvfp4.quantize_reference(x, 0, rht=True, generator=gen), 2 * elems + elems // 2 + elems // 16, None),
    ]  # fmt: skip
    print()
    print("| kernel | triton ms | GB/s | of copy bw | target | torch ref ms | speedup |")
    print("|---|---|---|---|---|---|---|")
    for name, fast, ref, nbytes, target in rows:
        t_fast = bench(fast, args.iters)
        t_ref = bench(ref, max(3, args.iters // 4), warmup=1)
        frac = nbytes / t_fast / copy_bw
        tgt = f">= {target:.0%} {'ok' if frac >= target else 'MISSED'}" if target else "-"
        print(
            f"| {name} | {t_fast * 1e3:.3f} | {nbytes / t_fast / 1e9:.0f} | {frac:.0%} | {tgt} | "
            f"{t_ref * 1e3:.2f} | {t_ref / t_fast:.1f}x |"
        )
    impl = triton_kernels._impl()
    if impl.AUTOTUNED:  # the tile each problem chose, to pick the fixed defaults from
        for name, kern in (("mxfp8", impl.mxfp8_kernel), ("nvfp4", impl.nvfp4_kernel)):
            for key, cfg in kern.cache.items():
                print(f"# autotuned {name} {key}: {cfg}")
    if args.skip_linear:
        return

    print()
    print(f"QuantLinear fwd+bwd, x [{n}, {n}] bf16, weight [{n}, {n}]: step time vs bf16 nn.Linear")
    xg = torch.randn(n, n, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    base = torch.nn.Linear(n, n, bias=False, device=dev, dtype=torch.bfloat16)

    def step(mod):
        def run():
            xg.grad = None
            mod(xg).backward(dy)

        return run

    t_base = bench(step(base), max(3, args.iters // 2))
    print("| recipe | ms/step | vs nn.Linear |")
    print("|---|---|---|")
    print(f"| nn.Linear (bf16) | {t_base * 1e3:.2f} | 1.00 |")
    recipes = ["bf16", "fp8", "mxfp8", "nvfp4"]
    for name in recipes:
        lin = QuantLinear(n, n, device=dev)
        lin.set_recipe(get_recipe(name))
        t = bench(step(lin), max(3, args.iters // 2))
        print(f"| QuantLinear {lin.recipe.describe()} | {t * 1e3:.2f} | {t / t_base:.2f} |")
        del lin
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Benchmark the lab's quantize kernels and QuantLinear (CUDA only); prints ratio tables.

    PYTHONPATH=src python3 bench/bench_quant.py [--size 8192] [--iters 20]

1. Each Triton quantize kernel on a size x size bf16 tensor, every kernel variant
   (`triton_kernels.VARIANTS`, "v2", "v3") side by side on the same input: time per variant, the
   fastest variant, the time ratio v2/v3 (> 1: v3 faster; where a kernel has no v3 of its own, v3
   runs v2's kernel and the two times differ by noise only), achieved bytes/s (bytes that must move: the bf16 input read once
   plus the outputs written) as a fraction of a measured device copy bandwidth (`dst.copy_(src)`,
   read + write), the target check on the fastest variant, whether all the variants' output
   bytes (data, scales, amax) are equal, and the torch reference time. Kernel times are device
   time: the calls replayed from a CUDA graph, so the host's launch cost (Python argument
   checks, output allocation, Triton's launcher: tens of microseconds, a large part of a 0.1 ms
   kernel) is not in them; the copy is timed the same way. The "eager ms" columns time one call
   alone, launch included, as an eager caller sees it. The RHT+SR row is timed eagerly only. The NVFP4 quantize
   rows time the quantize kernel given the global amax (computed once, as TE computes it in a
   separate kernel or fused into the op before); the amax pass has its own row, and "end to end"
   rows time both, crediting both reads of the input.
2. QuantLinear forward+backward step time per recipe vs a bf16 `nn.Linear` (tokens = in = out =
   size), as a ratio.
"""

from __future__ import annotations

import argparse
import datetime

import torch

from graphsan.lab.quant import QuantLinear, get_recipe, mxfp8, nvfp4, triton_kernels


def bench(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds per call, each call alone between two CUDA events: the GPU waits while the
    host launches it, so this includes the host's launch cost (what an eager caller pays)."""
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


def bench_device(fn, iters: int, reps: int = 20) -> float | None:
    """Median seconds per call of device time: `reps` calls captured in one CUDA graph, replayed
    `iters` times between CUDA events, so no host launch cost is in the time (the kernels are
    graph-capturable by design). None where the call cannot be captured."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception:
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    torch.cuda.empty_cache()
    times.sort()
    return times[len(times) // 2]


def _tensors(out):
    """The tensors of a kernel's result (a quantized tensor, a pair of them, or an amax)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple):
        return [t for o in out for t in _tensors(o)]
    return list(out.buffers())


def _same_bytes(a, b) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb, strict=True)
    )


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
    t_copy = bench_device(lambda: dst.copy_(x), args.iters)
    copy_bw = 2 * elems * 2 / t_copy
    print(
        f"# device copy bandwidth: {copy_bw / 1e9:.0f} GB/s (read+write of {2 * elems / 2**20:.0f} "
        f"MiB; {2 * elems * 2 / bench(lambda: dst.copy_(x), args.iters) / 1e9:.0f} GB/s timed per "
        "eager call)"
    )
    print(
        "# times are device time per call (calls replayed from a CUDA graph, no host launch cost);"
        " 'eager ms' is one call alone, host launch included"
    )
    variants = triton_kernels.VARIANTS
    print(f"# variants {', '.join(variants)}; default {triton_kernels.default_variant()}")

    def ref_both():
        mxfp8.quantize_reference(x, -1)
        mxfp8.quantize_reference(x, 0)

    tk = triton_kernels
    amax = tk.global_amax(x)
    row_bytes_mx = 2 * elems + elems + elems // 32
    row_bytes_nv = 2 * elems + elems // 2 + elems // 16

    def sr_rht(v, seed=None):
        g = torch.Generator(device=dev).manual_seed(seed) if seed is not None else gen
        return tk.nvfp4_quantize(x, 0, rht=True, generator=g, variant=v)

    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [
        # name, triton fn of the variant, reference fn, bytes moved, target fraction of copy bw
        ("mxfp8 row+col (1 pass)", lambda v: tk.mxfp8_quantize_both(x, variant=v), ref_both,
         2 * elems + 2 * elems + 2 * elems // 32, 0.70),
        ("mxfp8 rowwise", lambda v: tk.mxfp8_quantize(x, -1, variant=v),
         lambda: mxfp8.quantize_reference(x, -1), row_bytes_mx, 0.70),
        ("mxfp8 columnwise", lambda v: tk.mxfp8_quantize(x, 0, variant=v),
         lambda: mxfp8.quantize_reference(x, 0), row_bytes_mx, 0.70),
        ("nvfp4 global amax", lambda v: tk.global_amax(x, v), lambda: x.abs().amax(), 2 * elems, None),
        ("nvfp4 rowwise 1D", lambda v: tk.nvfp4_quantize(x, -1, amax=amax, variant=v),
         lambda: nvfp4.quantize_reference(x, -1), row_bytes_nv, 0.60),
        ("nvfp4 columnwise 1D", lambda v: tk.nvfp4_quantize(x, 0, amax=amax, variant=v),
         lambda: nvfp4.quantize_reference(x, 0), row_bytes_nv, 0.60),
        ("nvfp4 rowwise 2D (weights)",
         lambda v: tk.nvfp4_quantize(x, -1, block_2d=True, amax=amax, variant=v),
         lambda: nvfp4.quantize_reference(x, -1, block_2d=True), row_bytes_nv, 0.60),
        ("nvfp4 columnwise 2D (weights)",
         lambda v: tk.nvfp4_quantize(x, 0, block_2d=True, amax=amax, variant=v),
         lambda: nvfp4.quantize_reference(x, 0, block_2d=True), row_bytes_nv, 0.60),
        ("nvfp4 rowwise 1D end to end", lambda v: tk.nvfp4_quantize(x, -1, variant=v),
         lambda: nvfp4.quantize_reference(x, -1), row_bytes_nv + 2 * elems, None),
        ("nvfp4 columnwise 1D end to end", lambda v: tk.nvfp4_quantize(x, 0, variant=v),
         lambda: nvfp4.quantize_reference(x, 0), row_bytes_nv + 2 * elems, None),
        ("nvfp4 col RHT+SR (wgrad dY)", sr_rht,
         lambda: nvfp4.quantize_reference(x, 0, rht=True, generator=gen), row_bytes_nv, None),
    ]  # fmt: skip
    print()
    head = " | ".join(f"{v} ms" for v in variants)
    later = variants[1:]
    ratios = " | ".join(f"{variants[0]}/{v} time" for v in later)
    fracs = " | ".join(f"{v} of copy bw" for v in variants)
    eager = " | ".join(f"{v} eager ms" for v in variants)
    print(
        f"| kernel | {head} | best | {ratios} | {fracs} | target (best) | bytes equal | {eager} "
        "| torch ref ms |"
    )
    print("|---" * (4 + 4 * len(variants)) + "|")
    for name, fast, ref, nbytes, target in rows:
        eager_t = {v: bench(lambda v=v, fast=fast: fast(v), args.iters) for v in variants}
        times = {}
        for v in variants:
            if fast is sr_rht:  # a generator of its own: time it eagerly
                times[v] = None
            else:
                times[v] = bench_device(lambda v=v, fast=fast: fast(v), args.iters)
            if times[v] is None:
                times[v] = eager_t[v]
        t_ref = bench(ref, max(3, args.iters // 4), warmup=1)
        best_v = min(variants, key=lambda v: times[v])
        best = times[best_v]
        frac = {v: nbytes / t / copy_bw for v, t in times.items()}
        tgt = "-"
        if target:
            tgt = f">= {target:.0%} {'ok' if nbytes / best / copy_bw >= target else 'MISSED'}"
        if fast is sr_rht:  # the same generator state for every variant
            outs = [sr_rht(v, seed=1) for v in variants]
        else:
            outs = [fast(v) for v in variants]
        equal = all(_same_bytes(outs[0], o) for o in outs[1:])
        print(
            f"| {name} | "
            + " | ".join(f"{times[v] * 1e3:.3f}" for v in variants)
            + f" | {best_v} | "
            + " | ".join(f"{times[variants[0]] / times[v]:.2f}x" for v in later)
            + " | "
            + " | ".join(f"{frac[v]:.0%}" for v in variants)
            + f" | {tgt} | {'yes' if equal else 'NO, DIFFERENT BYTES'} | "
            + " | ".join(f"{eager_t[v] * 1e3:.3f}" for v in variants)
            + f" | {t_ref * 1e3:.2f} |"
        )
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

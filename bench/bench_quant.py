"""Benchmark the lab's quantize kernels and QuantLinear (CUDA only); prints ratio tables.

    PYTHONPATH=src python3 bench/bench_quant.py [--size 8192] [--iters 20]

1. Each Triton quantize kernel on a size x size bf16 tensor, the two kernel families side by side
   on the same input: "strided" (the kernels for any dtype and strides, forced with the
   launchers' private `_strided=True`) and "default" (what `mxfp8.quantize` / `nvfp4.quantize`
   run: the bf16-word kernels where they exist; where they do not, as for MXFP8 rowwise alone and
   the global amax, both columns run the same kernel and differ by noise only). Per row: time
   per family, the faster one, the time ratio strided/default (> 1: default faster), achieved
   bytes/s (bytes that must move: the bf16 input read once plus the outputs written) as a
   fraction of a measured device copy bandwidth (`dst.copy_(src)`, read + write), the target
   check on the faster one, whether both families' output bytes (data, scales, amax) are equal,
   and the torch reference time. Kernel times are device
   time: the calls replayed from a CUDA graph, so the host's launch cost (Python argument
   checks, output allocation, Triton's launcher: tens of microseconds, a large part of a 0.1 ms
   kernel) is not in them; the copy is timed the same way. The "eager ms" columns time one call
   alone, launch included, as an eager caller sees it. The NVFP4 quantize
   rows time the quantize kernel given the global amax (computed once, as TE computes it in a
   separate kernel or fused into the op before); the amax pass has its own row, and "end to end"
   rows time both, crediting both reads of the input where the two passes read it as it is
   (the RHT end to end rows credit one read: the bytes the operation must move). The RHT
   quantize rows, like the plain ones, are given their (post-RHT) amax: TE takes it in a separate
   pass together with the plain amax of the rowwise copy, and so does `nvfp4.quantize_both`,
   whose rows ("both copies") time that pass and the two copies against two separate calls
   ("strided" there: `nvfp4_quantize` rowwise then columnwise, the default kernels).
   The RHT and SR rows: "default" is the fused column kernel (transform and Philox bits in
   registers) or the row words kernel (Philox bits in registers), "strided" the torch RHT and
   the bits handed to the strided kernel as a tensor. The
   grouped rows (GROUPS equal row groups, one amax each): "default" is the grouped kernels,
   "strided" the torch reference the routed experts ran before them.
2. QuantLinear forward+backward step time per recipe vs a bf16 `nn.Linear` (tokens = in = out =
   size), as a ratio, with both GEMM paths: bench_quant_linear.py (also runnable alone).
"""

from __future__ import annotations

import argparse
import datetime

import torch
from bench_quant_linear import quant_linear_table
from quant_timing import amax_pass_both, bench, bench_device, launchers, same_bytes

from graphsan.lab.quant import NVFP4Options, kernels, mxfp8, nvfp4

STRIDED = {"strided": True, "default": False}  # kernel family -> the launchers' `_strided`
GROUPS = 8  # experts in the grouped rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-linear", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quant: needs CUDA")
    if not kernels.available():
        raise SystemExit("bench_quant: needs Triton")
    import triton

    tk = launchers()

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
    families = tuple(STRIDED)
    print("# kernels: strided (forced) and default (bf16 words where they exist)")

    def ref_both():
        mxfp8.quantize_reference(x, -1)
        mxfp8.quantize_reference(x, 0)

    amax = tk.nv.global_amax(x)
    row_bytes_mx = 2 * elems + elems + elems // 32
    row_bytes_nv = 2 * elems + elems // 2 + elems // 16

    # the device's default generator: CUDA-graph capture (device time) handles it
    gen = torch.cuda.default_generators[torch.cuda.current_device()]

    def col_fused(rht, sr, axis=0):
        def run(v, seed=None):
            if seed is not None:  # the byte comparison: the same generator state per family
                torch.cuda.manual_seed(seed)
            g = gen if sr else None
            options = NVFP4Options(rht=rht, generator=g)
            return tk.nv.nvfp4_quantize(x, axis, options, _strided=STRIDED[v])

        run.seeded = True
        return run

    sr_rht = col_fused(True, True)
    rht_only = NVFP4Options(rht=True)
    post_amax = tk.nv.nvfp4_quantize(x, 0, rht_only).amax  # the post-RHT amax, taken once

    def col_given(sr):
        def run(v, seed=None):
            if seed is not None:
                torch.cuda.manual_seed(seed)
            g = gen if sr else None
            options = NVFP4Options(rht=True, generator=g)
            return tk.nv.nvfp4_quantize(x, 0, options, post_amax, _strided=STRIDED[v])

        run.seeded = True
        return run

    def both_copies(sr):
        def run(v, seed=None):
            if seed is not None:
                torch.cuda.manual_seed(seed)
            g = gen if sr else None
            if v == "strided":  # two calls: each copy takes its own amax
                row = tk.nv.nvfp4_quantize(x, -1, NVFP4Options(generator=g))
                return row, tk.nv.nvfp4_quantize(x, 0, NVFP4Options(rht=True, generator=g))
            return tk.nv.nvfp4_quantize_both(x, NVFP4Options(rht=True, generator=g))

        run.seeded = True
        return run

    def ref_pair(sr):
        g = gen if sr else None
        nvfp4.quantize_reference(x, -1, NVFP4Options(generator=g))
        nvfp4.quantize_reference(x, 0, NVFP4Options(rht=True, generator=g))

    groups = torch.arange(n, device=dev) // (n // GROUPS)  # GROUPS equal experts

    def grouped(axis, rht, sr):
        def run(v, seed=None):
            if seed is not None:
                torch.cuda.manual_seed(seed)
            g = gen if sr else None
            options = NVFP4Options(rht=rht, generator=g)
            if v == "strided":  # the torch reference: what the experts ran before the kernels
                return nvfp4.quantize_grouped_reference(x, groups, GROUPS, axis, options)
            return nvfp4.quantize_grouped(x, groups, GROUPS, axis, options)

        run.seeded = True
        return run

    w2d = NVFP4Options(block_2d=True)
    rht_sr, sr_only = NVFP4Options(rht=True, generator=gen), NVFP4Options(generator=gen)
    rows = [
        # name, triton fn of the family, reference fn, bytes moved, target fraction of copy bw
        ("mxfp8 row+col (1 pass)", lambda v: tk.mx.mxfp8_quantize_both(x, _strided=STRIDED[v]), ref_both,
         2 * elems + 2 * elems + 2 * elems // 32, 0.70),
        ("mxfp8 rowwise", lambda v: tk.mx.mxfp8_quantize(x, -1, _strided=STRIDED[v]),
         lambda: mxfp8.quantize_reference(x, -1), row_bytes_mx, 0.70),
        ("mxfp8 columnwise", lambda v: tk.mx.mxfp8_quantize(x, 0, _strided=STRIDED[v]),
         lambda: mxfp8.quantize_reference(x, 0), row_bytes_mx, 0.70),
        ("nvfp4 global amax", lambda v: tk.nv.global_amax(x), lambda: x.abs().amax(), 2 * elems, None),
        ("nvfp4 rowwise 1D", lambda v: tk.nv.nvfp4_quantize(x, -1, amax=amax, _strided=STRIDED[v]),
         lambda: nvfp4.quantize_reference(x, -1), row_bytes_nv, 0.60),
        ("nvfp4 columnwise 1D", lambda v: tk.nv.nvfp4_quantize(x, 0, amax=amax, _strided=STRIDED[v]),
         lambda: nvfp4.quantize_reference(x, 0), row_bytes_nv, 0.60),
        ("nvfp4 rowwise 2D (weights)",
         lambda v: tk.nv.nvfp4_quantize(x, -1, w2d, amax, _strided=STRIDED[v]),
         lambda: nvfp4.quantize_reference(x, -1, w2d), row_bytes_nv, 0.60),
        ("nvfp4 columnwise 2D (weights)",
         lambda v: tk.nv.nvfp4_quantize(x, 0, w2d, amax, _strided=STRIDED[v]),
         lambda: nvfp4.quantize_reference(x, 0, w2d), row_bytes_nv, 0.60),
        ("nvfp4 rowwise 1D end to end", lambda v: tk.nv.nvfp4_quantize(x, -1, _strided=STRIDED[v]),
         lambda: nvfp4.quantize_reference(x, -1), row_bytes_nv + 2 * elems, None),
        ("nvfp4 columnwise 1D end to end", lambda v: tk.nv.nvfp4_quantize(x, 0, _strided=STRIDED[v]),
         lambda: nvfp4.quantize_reference(x, 0), row_bytes_nv + 2 * elems, None),
        ("nvfp4 col RHT+SR (wgrad dY)", col_given(True),
         lambda: nvfp4.quantize_reference(x, 0, rht_sr), row_bytes_nv, 0.50),
        ("nvfp4 col RHT (wgrad X)", col_given(False),
         lambda: nvfp4.quantize_reference(x, 0, rht_only), row_bytes_nv, 0.50),
        ("nvfp4 RHT amax pass (post-RHT and plain amax)", lambda v: amax_pass_both(tk, x), None, 2 * elems, None),
        ("nvfp4 col RHT+SR end to end (wgrad dY)", sr_rht,
         lambda: nvfp4.quantize_reference(x, 0, rht_sr), row_bytes_nv, None),
        ("nvfp4 col RHT end to end (wgrad X)", col_fused(True, False),
         lambda: nvfp4.quantize_reference(x, 0, rht_only), row_bytes_nv, None),
        ("nvfp4 dY both copies (row SR, col RHT+SR) end to end", both_copies(True),
         lambda: ref_pair(True), 2 * row_bytes_nv - 2 * elems, None),
        ("nvfp4 X both copies (row, col RHT) end to end", both_copies(False),
         lambda: ref_pair(False), 2 * row_bytes_nv - 2 * elems, None),
        ("nvfp4 col SR end to end (no RHT)", col_fused(False, True),
         lambda: nvfp4.quantize_reference(x, 0, sr_only), row_bytes_nv + 2 * elems, None),
        ("nvfp4 rowwise SR end to end (dgrad dY)", col_fused(False, True, -1),
         lambda: nvfp4.quantize_reference(x, -1, sr_only), row_bytes_nv + 2 * elems, None),
        (f"nvfp4 grouped rowwise, {GROUPS} groups, end to end", grouped(-1, False, False),
         None, row_bytes_nv + 2 * elems, None),
        (f"nvfp4 grouped col RHT+SR, {GROUPS} groups, end to end", grouped(0, True, True),
         None, row_bytes_nv, None),
    ]  # fmt: skip
    print()
    head = " | ".join(f"{v} ms" for v in families)
    later = families[1:]
    ratios = " | ".join(f"{families[0]}/{v} time" for v in later)
    fracs = " | ".join(f"{v} of copy bw" for v in families)
    eager = " | ".join(f"{v} eager ms" for v in families)
    print(
        f"| kernel | {head} | best | {ratios} | {fracs} | target (best) | bytes equal | {eager} "
        "| torch ref ms |"
    )
    print("|---" * (4 + 4 * len(families)) + "|")
    for name, fast, ref, nbytes, target in rows:
        eager_t = {v: bench(lambda v=v, fast=fast: fast(v), args.iters) for v in families}
        times = {}
        for v in families:
            times[v] = bench_device(lambda v=v, fast=fast: fast(v), args.iters)
            if times[v] is None:
                times[v] = eager_t[v]
        t_ref = bench(ref, max(3, args.iters // 4), warmup=1) if ref else eager_t["strided"]
        best_v = min(families, key=lambda v: times[v])
        best = times[best_v]
        frac = {v: nbytes / t / copy_bw for v, t in times.items()}
        tgt = "-"
        if target:
            tgt = f">= {target:.0%} {'ok' if nbytes / best / copy_bw >= target else 'MISSED'}"
        if getattr(fast, "seeded", False):  # the same generator state for both
            outs = [fast(v, seed=1) for v in families]
        else:
            outs = [fast(v) for v in families]
        equal = all(same_bytes(outs[0], o) for o in outs[1:])
        print(
            f"| {name} | "
            + " | ".join(f"{times[v] * 1e3:.3f}" for v in families)
            + f" | {best_v} | "
            + " | ".join(f"{times[families[0]] / times[v]:.2f}x" for v in later)
            + " | "
            + " | ".join(f"{frac[v]:.0%}" for v in families)
            + f" | {tgt} | {'yes' if equal else 'NO, DIFFERENT BYTES'} | "
            + " | ".join(f"{eager_t[v] * 1e3:.3f}" for v in families)
            + f" | {t_ref * 1e3:.2f} |"
        )
    if args.skip_linear:
        return

    print()
    quant_linear_table(n, args.iters)


if __name__ == "__main__":
    main()

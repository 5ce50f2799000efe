"""Timing helpers shared by the quantize benchmarks (bench_quant.py, tile_sweep.py; CUDA only)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def launchers() -> SimpleNamespace:
    """The launcher modules the quant benchmarks drive: .mx, .nv and .gemm are
    `graphsan.lab.quant.kernels.launch_mxfp8`, `launch_nvfp4` and `launch_gemm`."""
    from graphsan.lab.quant.kernels import launch_gemm, launch_mxfp8, launch_nvfp4

    return SimpleNamespace(mx=launch_mxfp8, nv=launch_nvfp4, gemm=launch_gemm)


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


def amax_pass_both(tk, x):
    """The RHT amax pass (`launch_nvfp4._col_amax_pass`) taking the post-RHT and the plain amax
    together, into a fresh [2] buffer (the benches' timed call)."""
    amax = torch.zeros(2, dtype=torch.float32, device=x.device)
    tk.nv._col_amax_pass(x, amax[0], amax[1])
    return amax


def tensors(out):
    """The tensors of a kernel's result (a quantized tensor, a pair of them, or an amax)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple):
        return [t for o in out for t in tensors(o)]
    return list(out.buffers())


def same_bytes(a, b) -> bool:
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype
        and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(ta, tb, strict=True)
    )

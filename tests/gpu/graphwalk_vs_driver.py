"""On a GPU: graphsan's compiled walk (graphwalk.cpp) reads a real capture exactly as the walk
through cuda-bindings does. The capture holds PyTorch's elementwise, copy, reduction and cuBLAS
kernels, a Triton kernel, memcpy nodes (pinned host to device, device to device) and a memset.
Prints `RESULT {json}`: whether the records and stats are equal, the kinds seen, and both walks'
cost per node (informational, not asserted).
"""

import time

import torch
from cuda.bindings import runtime as rt

from graphsan.command_line import write_result
from graphsan.cuda import driver, tracelog
from graphsan.runtime.capture import _describe

log, _ = tracelog.for_this_torch(wait=True)
compiled, why = log.graph_walk()
out = {"compiled": compiled is not None, "why": why}
if compiled is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def scale(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2.0, mask=i < n)

    x = torch.randn(64, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    host = torch.randn(64, 64).pin_memory()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # cuBLAS makes its handle and Triton compiles outside
        (x @ w).sum().item()
        scale[(4,)](x, torch.empty_like(x), x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        y = x
        for k in range(40):
            y = y @ w if k % 5 == 4 else (y * 1.0001 if k % 2 else y.t().contiguous() + 1)
        z = torch.cat([y, x]).sum(0).softmax(0)
        staged = torch.empty_like(x)
        staged.copy_(host, non_blocking=True)  # memcpy from pinned host memory
        again = torch.empty_like(x)
        again.copy_(staged)  # device to device
        t = torch.empty_like(x)
        scale[(4,)](staged, t, x.numel(), BLOCK=1024)
        (err,) = rt.cudaMemsetAsync(t.data_ptr(), 0, 256, stream.cuda_stream)
        assert err == rt.cudaError_t.cudaSuccess, err
        handle = driver.capturing_graph(stream.cuda_stream)
        ref, ref_stats = driver.walk(handle)
        got, got_stats = compiled.walk(int(handle), _describe)
        out["equal"] = ref == got
        out["stats_equal"] = ref_stats == got_stats
        out["stats"] = vars(got_stats)
        out["first_difference"] = next(
            (repr((a, b))[:400] for a, b in zip(ref, got, strict=False) if a != b), None
        )
        out["kinds"] = sorted({getattr(r, "kind", "kernel") for r in got})
        out["triton"] = any("scale" in getattr(r, "name", "") for r in got)
        out["host_copies"] = sum(
            1 for r in got if getattr(r, "kind", "") == "memcpy" and len(r.addresses) == 2
        )
        for name, fn in (
            ("driver_us_per_node", lambda: driver.walk(handle)),
            ("compiled_us_per_node", lambda: compiled.walk(int(handle), _describe)),
        ):
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            out[name] = (time.perf_counter() - t0) / 20 / max(got_stats.nodes, 1) * 1e6
    torch.cuda.synchronize()
write_result(out)

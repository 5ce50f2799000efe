"""On a GPU: the walk's parameter reads on a real capture. Inside a capture of elementwise,
copy, reduction and cuBLAS kernels, every kernel node's parameter block as `driver.gather`
reads it must equal each parameter read on its own. Prints `RESULT {json}` with how many
blocks took the one-read path and the walk's cost per node (informational, not asserted).
"""

import ctypes
import time

import torch
from cuda.bindings import driver as drv

from graphsan.command_line import write_result
from graphsan.core.records import WalkStats
from graphsan.cuda import driver


def one_by_one(ptrs, layout, size):
    buf = bytearray(size)
    for (off, sz), ptr in zip(layout, ptrs, strict=True):
        if ptr:
            buf[off : off + sz] = ctypes.string_at(ptr, sz)
    return bytes(buf)


x = torch.randn(64, 64, device="cuda")
w = torch.randn(64, 64, device="cuda")
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):  # cuBLAS makes its handle outside the capture
    (x @ w).sum().item()
g = torch.cuda.CUDAGraph()
out = {"kernels": 0, "with_params": 0, "one_read": 0, "mismatches": 0, "first_bad": None}
with torch.cuda.graph(g, stream=stream):
    y = x
    for k in range(40):
        y = y @ w if k % 5 == 4 else (y * 1.0001 if k % 2 else y.t().contiguous() + 1)
    z = torch.cat([y, x]).sum(0).softmax(0)
    handle = driver.capturing_graph(stream.cuda_stream)
    for node, kind in driver._nodes(handle, WalkStats()):
        if kind != drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        out["kernels"] += 1
        _, p = drv.cuGraphKernelNodeGetParams(node)
        func, kern = int(p.func), int(p.kern)
        info = driver.function_info(func, False) if func else driver.function_info(kern, True)
        if not int(p.kernelParams) or not info.layout:
            continue
        out["with_params"] += 1
        ptrs = info.pointers.from_address(int(p.kernelParams))[:]
        live = [(ptr, sz) for (_, sz), ptr in zip(info.layout, ptrs, strict=True) if ptr and sz]
        if live and max(a + n for a, n in live) - min(a for a, _ in live) <= driver.PAGE:
            out["one_read"] += 1
        if driver.gather(ptrs, info.layout, info.size) != one_by_one(ptrs, info.layout, info.size):
            out["mismatches"] += 1
            out["first_bad"] = out["first_bad"] or info.name
    nodes, stats = driver.walk(handle)
    t0 = time.perf_counter()
    for _ in range(20):
        driver.walk(handle)
    out["walk_us_per_node"] = (time.perf_counter() - t0) / 20 / max(stats.nodes, 1) * 1e6
    out["walk_kernels"] = stats.kernels
    out["walk_unreadable"] = stats.unreadable
torch.cuda.synchronize()
write_result(out)

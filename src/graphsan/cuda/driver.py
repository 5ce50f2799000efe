"""CUDA driver access through NVIDIA's cuda-bindings: the graph being captured, its nodes, kernel
names and the raw bytes of every kernel's arguments.

Imported only when a graph is captured, so CPU machines never load libcuda. Every call that can
fail raises `DriverError` with the driver's error name; callers decide what is fatal.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterator
from typing import NamedTuple

from cuda.bindings import driver as drv

from graphsan.core.records import AllocArgs, CopyArgs, KernelArgs, WalkStats

CU_LAUNCH_PARAM_END = 0
CU_LAUNCH_PARAM_BUFFER_POINTER = 1
CU_LAUNCH_PARAM_BUFFER_SIZE = 2
MAX_PARAMS = 4096  # no kernel takes more; a guard against runaway loops


# looked up once: every node of every graph compares against them
_SUCCESS = drv.CUresult.CUDA_SUCCESS
_T = drv.CUgraphNodeType
_KERNEL, _MEMCPY, _MEMSET = (
    _T.CU_GRAPH_NODE_TYPE_KERNEL,
    _T.CU_GRAPH_NODE_TYPE_MEMCPY,
    _T.CU_GRAPH_NODE_TYPE_MEMSET,
)
_CHILD, _CONDITIONAL = _T.CU_GRAPH_NODE_TYPE_GRAPH, _T.CU_GRAPH_NODE_TYPE_CONDITIONAL
_MEM_ALLOC = _T.CU_GRAPH_NODE_TYPE_MEM_ALLOC
# the smallest page size of the hosts CUDA runs on (x86-64, aarch64)
PAGE = 4096


class DriverError(RuntimeError):
    pass


def _check(result, what: str):
    err, *rest = result
    if err != _SUCCESS:
        raise DriverError(f"{what} failed: {err.name}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


# ----------------------------------------------------------------------------- the capture
def capturing_graph(stream_handle: int):
    """The CUgraph that `stream_handle` is capturing into right now (before capture end)."""
    res = _check(drv.cuStreamGetCaptureInfo(drv.CUstream(stream_handle)), "cuStreamGetCaptureInfo")
    status, graph = res[0], res[2]
    if status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        raise DriverError(f"stream {stream_handle:#x} is not capturing (status {status.name})")
    return graph


def walk(graph) -> tuple[list[KernelArgs | CopyArgs | AllocArgs], WalkStats]:
    """Every kernel, memcpy and memset node of `graph`, child and conditional bodies included."""
    stats = WalkStats()
    out: list[KernelArgs | CopyArgs] = []
    for node, kind in _nodes(graph, stats):
        rec = _read_node(node, kind, len(out), stats)
        if rec is not None:
            out.append(rec)
    return out, stats


def _nodes(graph, stats: WalkStats) -> Iterator:
    _, count = _check_pair(drv.cuGraphGetNodes(graph), "cuGraphGetNodes")
    nodes, _ = _check_pair(drv.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
    for node in nodes[:count]:
        stats.nodes += 1
        kind = _check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
        if kind == _CHILD:
            stats.child_graphs += 1
            yield from _nodes(
                _check(drv.cuGraphChildGraphNodeGetGraph(node), "cuGraphChildGraphNodeGetGraph"),
                stats,
            )
        elif kind == _CONDITIONAL:
            try:
                params = _check(drv.cuGraphNodeGetParams(node), "cuGraphNodeGetParams")
                cond = params.conditional
                for body in list(cond.phGraph_out)[: cond.size]:
                    stats.child_graphs += 1
                    yield from _nodes(body, stats)
            except (DriverError, AttributeError, TypeError):
                stats.unreadable += 1
        else:
            yield node, kind


def _check_pair(result, what):
    err, nodes, count = result
    if err != _SUCCESS:
        raise DriverError(f"{what} failed: {err.name}")
    return nodes, count


def _read_node(node, kind, index: int, stats: WalkStats) -> KernelArgs | CopyArgs | None:
    try:
        if kind == _KERNEL:
            stats.kernels += 1
            return _read_kernel(node, index)
        if kind == _MEMCPY:
            stats.copies += 1
            p = _check(drv.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
            addrs = []
            for side in ("src", "dst"):
                mtype = getattr(p, f"{side}MemoryType")
                if mtype in (
                    drv.CUmemorytype.CU_MEMORYTYPE_DEVICE,
                    drv.CUmemorytype.CU_MEMORYTYPE_UNIFIED,
                ):
                    base = int(getattr(p, f"{side}Device"))
                    addrs.append((side, base + int(getattr(p, f"{side}XInBytes"))))
                elif mtype == drv.CUmemorytype.CU_MEMORYTYPE_HOST:  # pinned host memory
                    base = _host_address(getattr(p, f"{side}Host"))
                    if base:
                        addrs.append((side, base + int(getattr(p, f"{side}XInBytes"))))
            return CopyArgs(index, "memcpy", addrs)
        if kind == _MEMSET:
            stats.copies += 1
            p = _check(drv.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
            return CopyArgs(index, "memset", [("dst", int(p.dst))])
        if kind == _MEM_ALLOC:
            p = _check(drv.cuGraphMemAllocNodeGetParams(node), "cuGraphMemAllocNodeGetParams")
            return AllocArgs(index, int(p.dptr), int(p.bytesize))
    except DriverError:
        stats.unreadable += 1
    return None


def _host_address(ptr) -> int:
    """A memcpy node's host pointer as an int (the bindings hand it as an int or a void*)."""
    if ptr is None:
        return 0
    try:
        return int(ptr)
    except TypeError:
        return int(getattr(ptr, "value", 0) or 0)


def _read_kernel(node, index: int) -> KernelArgs:
    p = _check(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
    func = int(p.func)
    kern = 0 if func else int(p.kern)
    info = function_info(func, False) if func else function_info(kern, True) if kern else None
    if info is None:
        info = FunctionInfo("<unknown kernel>", (), 0, ())
    grid = (int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ))
    kp = int(p.kernelParams)
    if kp:
        if not info.layout:
            raise DriverError(f"no parameter layout for {info.name}")
        ptrs = info.pointers.from_address(kp)[:]
        return KernelArgs(
            index, info.name, gather(ptrs, info.layout, info.size), list(info.offsets), grid
        )
    extra = int(p.extra)
    if extra:
        return KernelArgs(index, info.name, _packed_buffer(extra), list(info.offsets), grid)
    return KernelArgs(index, info.name, b"", [], grid)


def gather(ptrs: list[int | None], layout: tuple[tuple[int, int], ...], size: int) -> bytes:
    """A kernel's parameter block from `kernelParams` (one pointer per parameter; (offset,
    size) of each in `layout`), zeros in the padding and for null pointers. A ctypes read costs
    more than the copy: when the values span at most a page, one read takes them all (it touches
    at most two pages, each holding a parameter byte, so mapped); else each is read alone."""
    lo = hi = None
    for (_, sz), ptr in zip(layout, ptrs, strict=True):
        if ptr and sz:
            if lo is None or ptr < lo:
                lo = ptr
            if hi is None or ptr + sz > hi:
                hi = ptr + sz
    buf = bytearray(size)
    if lo is None:
        return bytes(buf)
    if hi - lo <= PAGE:
        data = ctypes.string_at(lo, hi - lo)
        for (off, sz), ptr in zip(layout, ptrs, strict=True):
            if ptr:
                buf[off : off + sz] = data[ptr - lo : ptr - lo + sz]
    else:
        for (off, sz), ptr in zip(layout, ptrs, strict=True):
            if ptr:
                buf[off : off + sz] = ctypes.string_at(ptr, sz)
    return bytes(buf)


def _packed_buffer(extra: int) -> bytes:
    """Read a `CU_LAUNCH_PARAM_BUFFER_POINTER`/`_SIZE` launch buffer (as cuBLASLt passes it)."""
    words = (ctypes.c_void_p * 16).from_address(extra)
    ptr = size = None
    for i in range(0, 16, 2):
        key = words[i] or 0
        if key == CU_LAUNCH_PARAM_END:
            break
        if key == CU_LAUNCH_PARAM_BUFFER_POINTER:
            ptr = words[i + 1]
        elif key == CU_LAUNCH_PARAM_BUFFER_SIZE:
            size = ctypes.c_size_t.from_address(words[i + 1]).value
    if not ptr or not size:
        raise DriverError("kernel node has an `extra` array without a parameter buffer")
    return ctypes.string_at(ptr, size)


class FunctionInfo(NamedTuple):
    """What the walk needs of a kernel's function, looked up once per function."""

    name: str  # demangled
    layout: tuple[tuple[int, int], ...]  # (offset, size) of each parameter
    size: int  # bytes of the parameter block
    offsets: tuple[int, ...]
    pointers: type | None = None  # ctypes array of one pointer per parameter (kernelParams)


@functools.lru_cache(maxsize=65536)
def function_info(handle: int, is_kernel: bool) -> FunctionInfo:
    """Demangled name and parameter layout of a CUfunction or CUkernel."""
    if is_kernel:
        h, get_name, get_param = drv.CUkernel(handle), drv.cuKernelGetName, drv.cuKernelGetParamInfo
    else:
        h, get_name, get_param = drv.CUfunction(handle), drv.cuFuncGetName, drv.cuFuncGetParamInfo
    try:
        raw = _check(get_name(h), "cuFuncGetName")
        name = demangle(raw.decode() if isinstance(raw, bytes) else str(raw))
    except DriverError:
        name = f"<kernel {handle:#x}>"
    layout = []
    for i in range(MAX_PARAMS):
        err, off, size = get_param(h, i)
        if err != _SUCCESS:
            break
        layout.append((int(off), int(size)))
    return FunctionInfo(
        name,
        tuple(layout),
        max((off + sz for off, sz in layout), default=0),
        tuple(off for off, _ in layout),
        ctypes.c_void_p * len(layout),
    )


# ----------------------------------------------------------------------------- addresses
def address_range(ptr: int) -> tuple[int, int] | None:
    """(base, size) of the driver allocation holding `ptr`, or None (not device memory)."""
    err, base, size = drv.cuMemGetAddressRange(drv.CUdeviceptr(ptr))
    if err != _SUCCESS:
        return None
    return int(base), int(size)


def allocation(ptr: int) -> tuple[int, int, int] | None:
    """(base, size, buffer id) of the allocation holding `ptr`, or None. The buffer id is the
    driver's process-wide unique id of an allocation: memory freed and allocated anew at the
    same address gets a new one."""
    span = address_range(ptr)
    if span is None:
        return None
    err, ident = drv.cuPointerGetAttribute(
        drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr
    )
    return (*span, int(ident) if err == _SUCCESS else 0)


def is_host(ptr: int) -> bool:
    """Whether `ptr` is page-locked host memory the driver knows (cudaHostAlloc, registered)."""
    try:
        err, mtype = drv.cuPointerGetAttribute(
            drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr
        )
        return err == _SUCCESS and int(mtype) == int(drv.CUmemorytype.CU_MEMORYTYPE_HOST)
    except Exception:  # an address the bindings cannot take is not pinned memory
        return False


def is_mapped(ptr: int) -> bool:
    """Whether physical memory is mapped at `ptr` (for expandable segments, where the virtual
    range outlives the pages: cuMemGetAddressRange still answers after an unmap)."""
    err, handle = drv.cuMemRetainAllocationHandle(ptr)
    if err != _SUCCESS:
        return False
    drv.cuMemRelease(handle)
    return True


def read_device(spans: list[tuple[int, int]], stream_handle: int) -> list[bytes]:
    """The bytes of each (address, size) span of device memory, copied in order on
    `stream_handle` (so after the work queued there) with one synchronization for all. Never
    call it on a capturing stream."""
    bufs = [(ctypes.c_char * size)() for _, size in spans]
    stream = drv.CUstream(stream_handle)
    try:
        for (ptr, size), buf in zip(spans, bufs, strict=True):
            _check(
                drv.cuMemcpyDtoHAsync(ctypes.addressof(buf), drv.CUdeviceptr(ptr), size, stream),
                "cuMemcpyDtoHAsync",
            )
    finally:  # the copies queued before a failed one still write into bufs: wait for them
        synced = drv.cuStreamSynchronize(stream)
    _check(synced, "cuStreamSynchronize")
    return [bytes(buf) for buf in bufs]


# ----------------------------------------------------------------------------- names
@functools.lru_cache(maxsize=1)
def _cxa_demangle():
    lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
    fn = lib.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int),
    ]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    return fn, libc.free


def demangle(name: str) -> str:
    """Itanium C++ demangling through libstdc++'s `__cxa_demangle`; names it cannot read pass."""
    if not name.startswith("_Z"):
        return name
    try:
        fn, free = _cxa_demangle()
    except (OSError, AttributeError):
        return name
    status = ctypes.c_int(0)
    out = fn(name.encode(), None, None, ctypes.byref(status))
    if status.value != 0 or not out:
        return name
    try:
        return ctypes.string_at(out).decode(errors="replace")
    finally:
        free(out)

"""The CUDA-facing pieces of the sanitizer replaced by fakes, for CPU tests of its flow: one graph
of one kernel whose argument points at the start of a one-segment default pool, and an allocator
view the test sets (`state["map"]`). A test may also set the nodes the next capture walks
(`state["nodes"]`), the allocations it made (`state["carves"]`), the device memory a pointer
table holds (`state["memory"]`), and use `graph_class` for a
`torch.cuda.CUDAGraph` whose methods the sanitizer's hooks can wrap."""

from __future__ import annotations

import types

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import KernelArgs, WalkStats
from graphsan.cuda import driver
from graphsan.cuda.allocator import AllocatorWatch

SEG = 0x7F00_0000_0000


def one_segment(blocks: list[tuple[int, str]], pool=(0, 0)) -> MemoryMap:
    """A segment of `pool` (default: the default pool) at SEG holding `blocks` ((size, state),
    in address order)."""
    return MemoryMap.from_snapshot(
        {
            "segments": [
                {
                    "address": SEG,
                    "total_size": sum(size for size, _ in blocks),
                    "segment_pool_id": pool,
                    "blocks": [
                        {
                            "address": SEG + sum(sz for sz, _ in blocks[:i]),
                            "size": size,
                            "state": st,
                        }
                        for i, (size, st) in enumerate(blocks)
                    ],
                }
            ]
        }
    )


def install(monkeypatch, kernel: str, stream: int) -> dict:
    """Fake the driver, the allocator view and the current device and stream; returns the state
    whose "map" the view answers with."""
    state = {"map": one_segment([(4096, "active_allocated"), (4096, "inactive")])}
    buf = SEG.to_bytes(8, "little") + (0).to_bytes(8, "little")
    monkeypatch.setattr(driver, "capturing_graph", lambda stream: "graph")
    state["nodes"] = [KernelArgs(0, kernel, buf, [0, 8])]
    state["carves"] = []
    monkeypatch.setattr(
        driver, "walk", lambda g: (state["nodes"], WalkStats(len(state["nodes"]), 1))
    )
    monkeypatch.setattr(
        AllocatorWatch, "capture_ended", lambda self, tag, pool: list(state["carves"])
    )
    # device memory the sanitizer reads (pointer tables): block address -> bytes, zeros elsewhere
    state["memory"] = {}
    monkeypatch.setattr(
        driver,
        "read_device",
        lambda spans, stream: [state["memory"].get(a, bytes(n))[:n] for a, n in spans],
    )
    monkeypatch.setattr(driver, "is_mapped", lambda ptr: True)
    monkeypatch.setattr(driver, "is_host", lambda ptr: False)
    monkeypatch.setattr(driver, "address_range", lambda ptr: None)
    monkeypatch.setattr(AllocatorWatch, "view", lambda self, device, sync=True, **kw: state["map"])
    monkeypatch.setattr(AllocatorWatch, "sync", lambda self: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=stream)
    )
    return state


def kernel(index: int, *addresses: int) -> KernelArgs:
    """A kernel node whose parameters are `addresses`, one 8-byte pointer each."""
    buf = b"".join(a.to_bytes(8, "little") for a in addresses)
    return KernelArgs(index, f"void k{index}(float*)", buf, [8 * i for i in range(len(addresses))])


def graph_class(monkeypatch, pool=(1, 3)) -> type:
    """A stand-in for `torch.cuda.CUDAGraph` (CPU torch cannot make one) with the four methods
    the hooks wrap; `launched` counts the replays that really ran."""

    def __init__(self):
        self.launched = 0

    def replay(self):
        self.launched += 1

    cls = type(
        "FakeCUDAGraph",
        (),
        {
            "__init__": __init__,
            "capture_begin": lambda self, pool=None: None,
            "capture_end": lambda self: None,
            "replay": replay,
            "reset": lambda self: None,
            "pool": lambda self: pool,
        },
    )
    monkeypatch.setattr(torch.cuda, "CUDAGraph", cls)
    return cls

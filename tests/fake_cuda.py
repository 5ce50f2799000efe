"""The CUDA-facing pieces of the sanitizer replaced by fakes, for CPU tests of its flow: one graph
of one kernel whose argument points at the start of a one-segment default pool, and an allocator
view the test sets (`state["map"]`)."""

from __future__ import annotations

import types

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import KernelArgs, WalkStats
from graphsan.cuda import driver
from graphsan.cuda.allocator import AllocatorWatch

SEG = 0x7F00_0000_0000


def one_segment(blocks: list[tuple[int, str]]) -> MemoryMap:
    """A default-pool segment at SEG holding `blocks` ((size, state), in address order)."""
    return MemoryMap.from_snapshot(
        {
            "segments": [
                {
                    "address": SEG,
                    "total_size": sum(size for size, _ in blocks),
                    "segment_pool_id": (0, 0),
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
    monkeypatch.setattr(
        driver, "walk", lambda g: ([KernelArgs(0, kernel, buf, [0, 8])], WalkStats(1, 1))
    )
    monkeypatch.setattr(driver, "is_mapped", lambda ptr: True)
    monkeypatch.setattr(driver, "address_range", lambda ptr: None)
    monkeypatch.setattr(AllocatorWatch, "view", lambda self, device, sync=True: state["map"])
    monkeypatch.setattr(AllocatorWatch, "sync", lambda self: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=stream)
    )
    return state

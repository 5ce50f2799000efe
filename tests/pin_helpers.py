"""Helpers for the pin policy's CPU tests and bench/bench_pin_scan.py: a tracker, an allocator
stand-in and a context, as a Pinner is given them by the sanitizer."""

from __future__ import annotations

import types

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import GraphInfo, Reference
from graphsan.core.tracker import Tracker
from graphsan.cuda.context import Context
from graphsan.policies.pin import Pinner


def fake_san():
    def fail(err):
        raise err

    return types.SimpleNamespace(
        tracker=Tracker(),
        memory=types.SimpleNamespace(redirect_resize=None),
        context=Context(),
        on_error=fail,
    )


def pinner_for(san, device_type: str = "cpu") -> Pinner:
    return Pinner(san.tracker, san.memory, san.context, san.on_error, device_type=device_type)


def memmap_for(*tensors: torch.Tensor) -> MemoryMap:
    segs = []
    for t in tensors:
        st = t.untyped_storage()
        segs.append(
            {
                "address": st.data_ptr(),
                "total_size": st.nbytes(),
                "segment_pool_id": (0, 0),
                "blocks": [
                    {"address": st.data_ptr(), "size": st.nbytes(), "state": "active_allocated"}
                ],
            }
        )
    return MemoryMap.from_snapshot({"segments": segs})


class Holder:
    pass


def capture(san, pinner, gid, tensors):
    m = memmap_for(*tensors)
    refs = [Reference(i, "k", 0, 0, t.data_ptr()) for i, t in enumerate(tensors)]
    state = san.tracker.add_graph(GraphInfo(gid, f"g{gid}", [], (1, gid), 0), refs, m)
    pinner.pin(state)
    return state

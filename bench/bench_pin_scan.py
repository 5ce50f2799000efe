"""What the pin policy's owner search costs: one gc scan per capture phase, against the number of
live Python objects and graphs. Device-independent (runs on CPU tensors), so it runs anywhere.

Beside the pinner's flush, the same process times two ways of listing the tensors among the
collector's objects: `gc_tensors` (one C-level pass that keeps no tuple; what the pinner uses) and
a Python loop over `gc.get_objects()` judging each object by its type.

    python bench/bench_pin_scan.py [--objects 1000000 3000000] [--graphs 500]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import types

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import GraphInfo, Reference
from graphsan.core.tracker import Tracker
from graphsan.cuda.context import Context
from graphsan.cuda.owners import gc_tensors
from graphsan.policies.pin import Pinner


def _raise(err: BaseException) -> None:
    raise err


def capture(tracker: Tracker, pinner: Pinner, gid: int, tensors: list[torch.Tensor]) -> None:
    """A graph of one kernel per tensor, registered and pinned as a capture would be."""
    segments = [
        {
            "address": t.untyped_storage().data_ptr(),
            "total_size": t.untyped_storage().nbytes(),
            "segment_pool_id": (0, 0),
            "blocks": [
                {
                    "address": t.untyped_storage().data_ptr(),
                    "size": t.untyped_storage().nbytes(),
                    "state": "active_allocated",
                }
            ],
        }
        for t in tensors
    ]
    refs = [Reference(i, "k", 0, 0, t.data_ptr()) for i, t in enumerate(tensors)]
    info = GraphInfo(gid, f"g{gid}", [], (1, gid), 0)
    state = tracker.add_graph(info, refs, MemoryMap.from_snapshot({"segments": segments}))
    pinner.pin(state)


def python_loop() -> list:
    tensor = torch.Tensor
    return [o for o in gc.get_objects() if issubclass(type(o), tensor)]


def best_of(n: int, fn) -> float:
    """The shortest of `n` timed calls, in ms."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--objects", type=int, nargs="+", default=[1_000_000, 3_000_000])
    p.add_argument("--graphs", type=int, default=500)
    p.add_argument("--blocks-per-graph", type=int, default=8)
    args = p.parse_args()
    print(
        f"# {os.cpu_count()} CPU cores, torch {torch.__version__}, Python {sys.version.split()[0]}"
    )
    print(
        "| live Python objects | graphs | watched blocks | flush ms | ms per million objects "
        "| gc_tensors ms | Python loop ms | loop / gc_tensors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in args.objects:
        clutter = [[i] for i in range(n)]  # gc-tracked containers, like a large program's
        tracker = Tracker()
        allocator = types.SimpleNamespace()  # a memory watch that sees no resize
        pinner = Pinner(tracker, allocator, Context(), _raise, device_type="cpu")
        owners = types.SimpleNamespace(t=[])
        for gid in range(1, args.graphs + 1):
            ts = [torch.empty(16) for _ in range(args.blocks_per_graph)]
            owners.t.extend(ts)
            capture(tracker, pinner, gid, ts)
        objects = len(gc.get_objects())
        t0 = time.perf_counter()
        pinner.flush()
        ms = (time.perf_counter() - t0) * 1e3
        blocks = pinner.summary()["blocks"]
        listed = best_of(3, gc_tensors)
        looped = best_of(3, python_loop)
        print(
            f"| {objects:,} | {args.graphs} | {blocks} | {ms:.0f} | {ms / objects * 1e6:.0f} "
            f"| {listed:.0f} | {looped:.0f} | {looped / listed:.2f} |"
        )
        del clutter, owners, pinner, tracker


if __name__ == "__main__":
    main()

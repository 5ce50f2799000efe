"""What the pin policy's owner search costs: one gc scan per capture phase, against the number of
live Python objects and graphs. Device-independent (runs on CPU tensors), so it runs anywhere.

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.pin_helpers import capture, fake_san, pinner_for  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--objects", type=int, nargs="+", default=[1_000_000, 3_000_000])
    p.add_argument("--graphs", type=int, default=500)
    p.add_argument("--blocks-per-graph", type=int, default=8)
    args = p.parse_args()
    print(
        f"# {os.cpu_count()} CPU cores, torch {torch.__version__}, Python {sys.version.split()[0]}"
    )
    print("| live Python objects | graphs | watched blocks | scan ms | ms per million objects |")
    print("|---|---|---|---|---|")
    for n in args.objects:
        clutter = [[i] for i in range(n)]  # gc-tracked containers, like a large program's
        san = fake_san()
        pinner = pinner_for(san)
        owners = types.SimpleNamespace(t=[])
        for gid in range(1, args.graphs + 1):
            ts = [torch.empty(16) for _ in range(args.blocks_per_graph)]
            owners.t.extend(ts)
            capture(san, pinner, gid, ts)
        objects = len(gc.get_objects())
        t0 = time.perf_counter()
        pinner.flush()
        ms = (time.perf_counter() - t0) * 1e3
        blocks = pinner.summary()["blocks"]
        print(f"| {objects:,} | {args.graphs} | {blocks} | {ms:.0f} | {ms / objects * 1e6:.0f} |")
        del clutter, owners, pinner, san


if __name__ == "__main__":
    main()

"""The capture-time cost of reading PyTorch's argument structs (`core.argstructs`), on real
graphs: the dumps `graphsan selftest --dump DIR` writes (every node's name, offsets, grid and
argument bytes, and the live storages at capture end), scanned with the layouts a probe
confirmed and with none (the word-by-word scan), side by side.

    python bench/bench_scan_structs.py --dump DIR [--repeat 5]

No GPU. Prints, per program and in all: kernel nodes, references kept by each scan, and the
scan's microseconds per kernel node (best of --repeat), with the ratio.
"""

from __future__ import annotations

import argparse
import base64
import glob
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from graphsan.core import argstructs as A  # noqa: E402
from graphsan.core.memory_map import MemoryMap  # noqa: E402
from graphsan.core.records import CopyArgs, KernelArgs  # noqa: E402
from graphsan.core.scan import references  # noqa: E402

# what the probe confirmed on the H200 (torch 2.11.0+cu130; tests/data/h200-torch2.11-probes)
H200 = A.Layouts(
    mta=A.MtaLayout(
        1,
        320,
        65536,
        (
            ("FusedOptimizerTensorListMetadata", True),
            ("TensorListMetadata", True),
            ("TensorListScalarListMetadata", False),
        ),
    ),
    max_dims=25,
    closure=True,
    reduce=True,
    cat=True,
    pointer_list=True,
    tensor_info=True,
)


def graphs(path: str):
    with gzip.open(path, "rt") as fh:
        for line in fh:
            rec = json.loads(line)
            nodes = []
            for n in rec["nodes"]:
                if "name" in n:
                    buf = base64.b64decode(n["buffer"])
                    nodes.append(
                        KernelArgs(n["index"], n["name"], buf, n["offsets"], tuple(n["grid"]))
                    )
                elif "copy" in n:
                    nodes.append(
                        CopyArgs(n["index"], n["copy"], [tuple(a) for a in n["addresses"]])
                    )
            # the map the scan confirms against: the words it took at capture, as 8-byte blocks
            addrs = sorted({r[3] for r in rec["refs"]})
            segs = [
                {
                    "address": a,
                    "total_size": 8,
                    "blocks": [{"address": a, "size": 8, "state": "active_allocated"}],
                }
                for a in addrs
            ]
            yield nodes, MemoryMap.from_snapshot({"segments": segs})


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dump", required=True, metavar="DIR", help="a `graphsan selftest --dump` folder"
    )
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    files = sorted(glob.glob(os.path.join(args.dump, "*.jsonl.gz")))
    if not files:
        p.error(f"--dump {args.dump}: no *.jsonl.gz files there")
    rows, total = [], [0, 0, 0, 0.0, 0.0]
    for path in files:
        name = os.path.basename(path)[: -len(".jsonl.gz")].replace("__", "/")
        kernels = refs_plain = refs_decoded = 0
        t_plain = t_decoded = 0.0
        for nodes, memmap in graphs(path):
            kernels += sum(isinstance(n, KernelArgs) for n in nodes)
            refs_plain += len(references(nodes, memmap, layouts=A.NOT_CALIBRATED))
            refs_decoded += len(references(nodes, memmap, layouts=H200))
            for layouts, acc in ((A.NOT_CALIBRATED, "plain"), (H200, "decoded")):
                took = best(
                    lambda n=nodes, m=memmap, lay=layouts: references(n, m, layouts=lay),
                    args.repeat,
                )
                if acc == "plain":
                    t_plain += took
                else:
                    t_decoded += took
        rows.append((name, kernels, refs_plain, refs_decoded, t_plain, t_decoded))
        for i, v in enumerate((kernels, refs_plain, refs_decoded, t_plain, t_decoded)):
            total[i] += v
    print(
        "| program | kernel nodes | references, word by word | references, decoded | us/node word by word | us/node decoded | ratio |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, k, rp, rd, tp, td in [*rows, ("all", *total)]:
        if k:
            print(
                f"| {name} | {k} | {rp} | {rd} | {tp / k * 1e6:.2f} | {td / k * 1e6:.2f} | {td / tp:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The CPU side of capture analysis, stage by stage, on synthetic graphs and allocator state.

    python bench/bench_analysis.py [--blocks 1000,20000,100000] [--graphs 100] [--nodes 100]
                                   [--expandable] [--against REV]

No GPU: what the sanitizer does in Python after the driver walk, fed with what a capture of
`--nodes` kernel nodes gives on the H200 (the scale run of bench_capture_scale.py):
- an `AllocatorView` seeded from a synthetic snapshot holding N live blocks (small tensors in
  2 MiB segments and a few large ones in 20 MiB segments; `--expandable`: all of them in one
  expandable segment);
- per graph, the allocator's log of one capture (a segment of the graph's pool, then per node the
  output's allocation and the free of the output two nodes back), after `--eager` frees and
  allocations of live default-pool blocks (the last one the graph's input);
- per graph, its nodes: vectorized elementwise kernels (N, a float scalar, two pointers),
  TensorIterator kernels (three pointers, then sizes as divisors and strides) and cuBLAS-like
  packed buffers (pointers, int32 pairs, int64 strides, floats).
Stages timed per graph (median over the graphs, the best of `--repeat` runs; us per kernel node
and us per graph): `apply`
(the view applies the capture's log), `references` (`core.scan.references`), `tables`
(`table_candidates`), `tracker` (`Tracker.add_graph`). The driver walk needs a GPU: only its
reading of parameter blocks out of host memory is timed (current revision).

`--against REV` runs the same inputs through graphsan's code at git revision REV too (extracted
to a temporary folder) and prints both side by side.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import struct
import sys
import time
import timeit

from revisions import revisions, run_at

from graphsan.command_line import write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("apply", "references", "tables", "tracker")
SEG_BASE = 0x7F00_0000_0000
SMALL_SEG, LARGE_SEG = 2 << 20, 20 << 20
# bench_capture_scale's tensors (floats): 128, 512, 1000, 2048, 4096, 3000 elements
SMALL_SIZES = (512, 2048, 4096, 8192, 16384, 12288)
STREAM, OTHER_STREAM = 0x5A5A00, 0x5A5B00


def synthetic_snapshot(blocks: int, expandable: bool, rng: random.Random) -> tuple[dict, list]:
    """A snapshot with `blocks` live blocks (one in 50 large) and a free block now and then; and
    the (address, size) of every live block."""
    segments, live = [], []
    addr = SEG_BASE
    made = 0
    while made < blocks:
        large = not expandable and (not segments or rng.random() < 0.02)
        if expandable:  # one reservation holds them all, as with one stream
            seg_size = -(-blocks * (20 << 10) // SMALL_SEG) * SMALL_SEG
        else:
            seg_size = LARGE_SEG if large else SMALL_SEG
        seg = {
            "device": 0,
            "address": addr,
            "total_size": seg_size,
            "segment_pool_id": (0, 0),
            "is_expandable": expandable,
            "blocks": [],
        }
        pos = addr
        while made < blocks:
            size = rng.choice((2 << 20, 4 << 20)) if large else rng.choice(SMALL_SIZES)
            if rng.random() < 0.05:
                size = 512 * rng.randint(1, 8)  # a free gap
                state = "inactive"
            else:
                state = "active_allocated"
            if pos + size > addr + seg_size:
                break
            seg["blocks"].append({"address": pos, "size": size, "requested_size": size - 64,
                                  "state": state, "frames": []})  # fmt: skip
            if state != "inactive":
                live.append((pos, size))
                made += 1
            pos += size
        if pos < addr + seg_size:
            seg["blocks"].append(
                {"address": pos, "size": addr + seg_size - pos, "state": "inactive", "frames": []}
            )
        segments.append(seg)
        addr += seg_size + (SMALL_SEG if rng.random() < 0.3 else 0)
    return {"segments": segments, "device_traces": []}, live


def entry(action: str, addr: int, size: int, stream: int, tag: str = "") -> dict:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": stream,
        "time_us": 0,
        "user_metadata": tag,
        "frames": [],
    }


def pack(fmt: str, *values) -> bytes:
    return struct.pack("<" + fmt, *values)


def elementwise(n: int, src: int, dst: int) -> tuple[bytes, list[int]]:
    """vectorized_elementwise_kernel(int N, functor{float}, array<char*, 2>)."""
    return pack("iffxxxxQQ", n, 1.0001, 0.0, dst, src), [0, 4, 16]


def int_divider(d: int) -> tuple[int, int, int]:
    """PyTorch's IntDivider<uint32_t>(d): divisor, magic number, shift."""
    shift = next(s for s in range(32) if (1 << s) >= d)
    return d, (1 << 32) * ((1 << shift) - d) // d + 1, shift


def tensor_iterator(n: int, ptrs: list[int], rng: random.Random) -> tuple[bytes, list[int]]:
    """elementwise_kernel(int N, a functor holding the data pointers and an OffsetCalculator of
    25 dimensions: a divisor (d, magic, shift) per size, uint32 strides; 2 dimensions used, the
    rest left as the host stack had it (random words here))."""
    junk = [rng.getrandbits(32) for _ in range(3 * 23 + 3 * 23)]
    calc = pack("i", 2) + pack("3I", *int_divider(64)) + pack("3I", *int_divider(64))
    calc += pack("69I", *junk[:69]) + pack("6I", 256, 256, 256, 4, 4, 4) + pack("69I", *junk[69:])
    buf = pack("ixxxx", n) + b"".join(pack("Q", p) for p in ptrs) + calc
    return buf + b"\0" * (-len(buf) % 8), [0, 8]


def cublas_packed(a: int, b: int, d: int, ws: int, rng: random.Random) -> tuple[bytes, list[int]]:
    """A cuBLASLt-style launch buffer (passed as one packed `extra` blob, no parameter layout)."""
    m, n, k = 64, 64, 64
    parts = [
        pack("iiii", m, n, k, 1),  # problem shape and batch (int32 pairs: 2^32 and up)
        pack("QQQQ", a, b, d, d),  # A, B, C, D
        pack("qqqq", 64, 1, 64, 1),  # strides
        pack("qqqq", m * k, k * n, m * n, m * n),  # batch strides
        pack("ff", 1.0, 0.0),  # alpha, beta
        pack("QQ", ws, 0),  # workspace, a null semaphore
        pack("iiii", 132, 1, 1, 2),  # tiles, swizzle
        pack("iiii", 64, 4096, 128, 4096),  # tile shapes and leading dimensions (int32 pairs)
        bytes(rng.getrandbits(8) & 0x3F for _ in range(40)),  # scheduler state
        pack("Q", 0) * 8,
    ]
    return b"".join(parts), []


def workload(
    blocks: int, graphs: int, nodes: int, expandable: bool, eager: int = 1, seed: int = 7
) -> dict:
    """Everything the stages get, as plain data (the same for every revision)."""
    rng = random.Random(seed * 1_000_003 + blocks)
    snap, live = synthetic_snapshot(blocks, expandable, rng)
    top = max(s["address"] + s["total_size"] for s in snap["segments"])
    caps = []
    seg_addr = top + SMALL_SEG
    weight = live[len(live) // 3][0]
    workspace = next((a for a, s in live if s >= (2 << 20)), live[-1][0])
    for g in range(graphs):
        pool = (g + 1, 0)
        tag = f"graphsan capture {g + 1}"
        log = []
        # eager work before the capture, the last of it the graph's input: live blocks of the
        # default pool freed and allocated again
        for _ in range(eager):
            x = live[rng.randrange(len(live))]
            log.append(entry("free_requested", x[0], x[1], STREAM))
            log.append(entry("free_completed", x[0], x[1], STREAM))
            log.append(entry("alloc", x[0], x[1], STREAM))
        log.append(entry("segment_alloc", seg_addr, SMALL_SEG, STREAM, tag))
        out_size = 16384
        outs = [seg_addr + i * out_size for i in range(3)]
        node_specs = []
        prev = x[0]
        for k in range(nodes):
            dst = outs[k % 3]
            log.append(entry("alloc", dst, out_size, STREAM, tag))
            if k >= 2:  # the output two nodes back is dropped
                old = outs[(k - 2) % 3]
                log.append(entry("free_requested", old, out_size, STREAM, tag))
                log.append(entry("free_completed", old, out_size, STREAM, tag))
            if k % 10 == 9:
                buf, offsets = cublas_packed(prev, weight, dst, workspace, rng)
                name = f"sm90_xmma_gemm_{k % 10}"
            elif k % 10 == 4:
                buf, offsets = tensor_iterator(4096, [dst, prev, weight], rng)
                name = f"void at::native::elementwise_kernel<128, 2, {k % 10}>(int, F)"
            else:
                buf, offsets = elementwise(4096, prev, dst)
                name = f"void at::native::vectorized_elementwise_kernel<4, {k % 10}>(int, F, A)"
            node_specs.append((k, name, buf, offsets))
            prev = dst
        caps.append({"pool": pool, "tag": tag, "log": log, "nodes": node_specs})
        seg_addr += SMALL_SEG * 2
    return {"snapshot": snap, "captures": caps}


def child(blocks: int, graphs: int, nodes: int, expandable: bool, eager: int) -> dict:
    """Time the stages with whichever graphsan is on the path."""
    from graphsan.core.allocview import AllocatorView
    from graphsan.core.records import GraphInfo, KernelArgs
    from graphsan.core.scan import references, table_candidates
    from graphsan.core.tracker import Tracker

    work = workload(blocks, graphs, nodes, expandable, eager)
    view = AllocatorView(lambda addr: [])
    t0 = time.perf_counter()
    view.seed(work["snapshot"], 0)
    seed_s = time.perf_counter() - t0
    tracker = Tracker()
    times: dict[str, list[float]] = {s: [] for s in STAGES}
    counts = {"refs": 0, "foreign_asked": 0, "entries": 0, "tables": 0}

    def foreign(value: int) -> bool:
        counts["foreign_asked"] += 1
        return False

    for c in work["captures"]:
        tag, pool = c["tag"], c["pool"]

        def pool_of(e, following, tag=tag, pool=pool):
            return pool if (following or e).get("user_metadata") == tag else (0, 0)

        nodes_ = [KernelArgs(i, name, buf, list(offs)) for i, name, buf, offs in c["nodes"]]
        t0 = time.perf_counter()
        view.apply(c["log"], pool_of)
        t1 = time.perf_counter()
        refs = references(nodes_, view, foreign=foreign)
        t2 = time.perf_counter()
        tables = table_candidates(refs, view, pool)
        t3 = time.perf_counter()
        info = GraphInfo(len(tracker.graphs) + 1, tag, (), pool, 0)
        tracker.add_graph(info, refs, view, host=lambda addr: None)
        t4 = time.perf_counter()
        for stage, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            times[stage].append(dt)
        counts["refs"] += len(refs)
        counts["entries"] += len(c["log"])
        counts["tables"] += len(tables)
    med = {s: statistics.median(v) * 1e6 for s, v in times.items()}
    per_graph = {k: v / graphs for k, v in counts.items()}
    drain = empty_drain_us(work["snapshot"])
    return {"seed_ms": seed_s * 1e3, "stages_us": med, "per_graph": per_graph, "drain_us": drain}


def empty_drain_us(snapshot: dict, rounds: int = 200) -> float:
    """us for one `AllocatorWatch.sync` whose compiled-tracker log holds nothing new: what every
    capture's begin and end pay before their own events (a stub log; no GPU)."""
    import torch

    from graphsan.core.tracker import Tracker
    from graphsan.cuda import allocator, allocator_log
    from graphsan.cuda.context import Context

    class EmptyLog:
        def drain_raw(self):
            return b"", [], False

    def fail(err):
        raise err

    allocator_log._snapshot = lambda pool=(0, 0), traces=False: snapshot
    torch.cuda.is_current_stream_capturing = lambda: False
    watch = allocator.AllocatorWatch(Tracker(), Context(), fail)
    # the compiled tracker's attribute, as the revision benched names it
    setattr(watch, "tracelog" if hasattr(type(watch), "tracelog") else "log", EmptyLog())
    watch.check_trace = lambda: None
    watch.view(0)  # the seed
    t0 = time.perf_counter()
    for _ in range(rounds):
        watch.sync()
    return (time.perf_counter() - t0) / rounds * 1e6


def parameter_reads(graphs: int, nodes: int) -> tuple[float, float] | None:
    """us per kernel node to read the parameter blocks of the workload's kernels (those with a
    layout) through `kernelParams`-style pointers into host memory: each parameter on its own,
    as the walk did before, and with `driver.gather`. None where graphsan has no `gather`."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    try:
        from graphsan.cuda import driver

        gather = driver.gather
    except (ImportError, AttributeError):
        return None
    work = workload(1000, min(graphs, 10), nodes, False)
    items, keep = [], []
    for c in work["captures"]:
        for _, _, buf, offs in c["nodes"]:
            if not offs:
                continue
            ends = offs[1:] + [len(buf)]
            layout = tuple((o, e - o) for o, e in zip(offs, ends, strict=True))
            arena = ctypes.create_string_buffer(buf)  # the node's copy, laid out as the ABI says
            array_type = ctypes.c_void_p * len(layout)
            ptrs = array_type(*[ctypes.addressof(arena) + o for o in offs])
            keep += [arena, ptrs]
            items.append((ctypes.addressof(ptrs), layout, len(buf), array_type))

    def one_by_one():
        for kp, layout, size, _ in items:
            out = bytearray(size)
            ptrs = (ctypes.c_void_p * len(layout)).from_address(kp)
            for (off, sz), ptr in zip(layout, ptrs, strict=True):
                if ptr:
                    out[off : off + sz] = ctypes.string_at(ptr, sz)

    def gathered():
        for kp, layout, size, array_type in items:
            gather(array_type.from_address(kp)[:], layout, size)

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=20, repeat=5)) / 20 / len(items) * 1e6

    return best(one_by_one), best(gathered)


def run_child(src: str, args: argparse.Namespace, blocks: int, rev: str = "") -> dict:
    """One timed run in a fresh process with graphsan from `src` (`rev`: the revision it was
    extracted from, for `--against`)."""
    argv = [os.path.abspath(__file__), "--child", "--n-blocks", str(blocks)]
    argv += ["--graphs", str(args.graphs), "--nodes", str(args.nodes)]
    if args.expandable:
        argv.append("--expandable")
    argv += ["--eager", str(args.eager)]
    return run_at(src, argv, rev, f"at {blocks} blocks", timeout=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", default="1000,20000,100000", help="live blocks, comma-separated")
    p.add_argument("--graphs", type=int, default=100, help="captures per block count")
    p.add_argument("--nodes", type=int, default=100, help="kernel nodes per graph")
    p.add_argument("--expandable", action="store_true", help="live blocks in expandable segments")
    p.add_argument("--eager", type=int, default=1, help="eager free+alloc pairs before a capture")
    p.add_argument("--against", metavar="REV", help="also run graphsan at git revision REV")
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the best median counts")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--n-blocks", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        out = child(args.n_blocks, args.graphs, args.nodes, args.expandable, args.eager)
        write_result(out)
        return
    try:
        counts = [int(x) for x in args.blocks.split(",") if x]
    except ValueError:
        p.error(f"--blocks: expected comma-separated integers, got {args.blocks!r}")
    if args.graphs < 1 or args.nodes < 3 or args.repeat < 1 or args.eager < 1:
        p.error("--graphs, --repeat and --eager must be at least 1, --nodes at least 3")
    with revisions(args.against, p.error) as revs:
        kind = "one expandable segment" if args.expandable else "2 MiB / 20 MiB segments"
        print(
            f"{args.graphs} graphs of {args.nodes} kernel nodes; live blocks in {kind}; "
            f"{args.eager} eager free+alloc pairs before each capture"
        )
        print("us per kernel node (us per graph); target: 1000 us per graph + 20 us per node")
        print(
            "| live blocks | revision | seed ms | "
            + " | ".join(STAGES)
            + " | total | empty drain us |"
        )
        print("|---|---|---|" + "---|" * (len(STAGES) + 2))
        per_graph = None
        for blocks in counts:
            for name, src, rev in revs:
                runs = [run_child(src, args, blocks, rev) for _ in range(args.repeat)]
                r = runs[0]  # each stage's best median of the runs (the machine may be shared)
                st = {s: min(x["stages_us"][s] for x in runs) for s in STAGES}
                r["seed_ms"] = min(x["seed_ms"] for x in runs)
                cells = [f"{st[s] / args.nodes:.2f} ({st[s]:.0f})" for s in STAGES]
                total = sum(st.values())
                cells.append(f"{total / args.nodes:.2f} ({total:.0f})")
                cells.append(f"{min(x['drain_us'] for x in runs):.1f}")
                print(f"| {blocks} | {name} | {r['seed_ms']:.1f} | " + " | ".join(cells) + " |")
                per_graph = r["per_graph"]
        if per_graph:
            print(
                "per graph: {entries:.0f} log entries, {refs:.0f} references, {tables:.0f} table "
                "candidates, {foreign_asked:.0f} words asked of the driver".format(**per_graph)
            )
        reads = parameter_reads(args.graphs, args.nodes)
        if reads is not None:
            print(
                "the walk's parameter reads (host side, kernels with a layout): {:.2f} us per kernel "
                "node one parameter at a time, {:.2f} us with driver.gather".format(*reads)
            )


if __name__ == "__main__":
    main()

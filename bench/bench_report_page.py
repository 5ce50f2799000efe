"""The HTML report page at scale: its size, write time and peak memory for N synthetic findings.

    python bench/bench_report_page.py [--findings 200,2000,20000] [--sites 16] [--repeat 1]
                                      [--against REV] [--render]

A synthetic report stands for a long `policy="record"` run: 8 captured graphs of 24 kernel nodes each
(long templated kernel names, a node summary as the sanitizer writes it), and `--sites` stale
references (graph, node, argument, kind) found again at every step, each finding with its own
step, free time and replay (so no two findings are equal, but they share `--sites` sites).
Stacks are 16 frames deep; the timeline keeps a capture per graph, a phase change per step and a
judged replay per finding, up to the recorder's bound of 10,000 events.

Each count runs in a fresh process: the page is written once timed, then once under tracemalloc
for the peak of Python memory the write takes (the report itself is built beforehand and not
counted). `--against REV` runs the same reports through graphsan's code at git revision REV
too (extracted to a temporary folder) and prints both side by side. `--render` then opens the
page in headless Chromium (bench/browser.py; Debian's `chromium`) as the page tests do: the
seconds from navigation to the load event, then to lay the whole page out, then for a
screenshot of the first screen (the browser's start is not counted).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import tracemalloc

from revisions import revisions, run_at

from graphsan.command_line import write_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = 1_780_000_000.0
GRAPHS, NODES, DEPTH = 8, 24, 16
KINDS = ("freed", "reowned", "unmapped", "pool-reuse")
MAX_EVENTS = 10_000  # graphsan.core.timeline's bound on recorded events
# sites repeat their graph, node, argument and kind every CYCLE sites; a site's offset grows by
# cycle, so that every site is a distinct finding on the page however many there are
CYCLE = 120


def kernel_name(i: int) -> str:
    """A demangled templated kernel name of realistic length (about 300 characters)."""
    return (
        f"void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
        f"at::native::(anonymous namespace)::op{i}_kernel_impl(at::TensorIterator&)::"
        f"{{lambda()#1}}::operator()() const::{{lambda(float, float)#1}}>"
        f"(at::TensorIteratorBase&, at::native::(anonymous namespace)::op{i}_kernel_impl::"
        f"{{lambda(float, float)#1}} const&)::{{lambda(int)#1}}>(int, float*, float const*)"
    )


def stack(where: str, n: int) -> list[tuple[str, int, str]]:
    """A `DEPTH`-frame stack ending in `where`'s frame number `n`."""
    site = "/opt/venv/lib/python3.12/site-packages/model"
    frames = [(f"{site}/layer{k}.py", 40 + k, f"fn{k}") for k in range(DEPTH - 1)]
    return [*frames, (f"/home/user/project/{where}.py", 100 + n, where)]


def graph_dict(gid: int, names: list[str]) -> dict:
    nodes = [(gid + k) % len(names) for k in range(NODES)]
    return {
        "id": gid,
        "label": f"layers.{gid}:layer fwd",
        "capture_site": stack("capture", gid),
        "pool": [1, gid],
        "nodes": NODES,
        "kernels": NODES,
        "references": 300,
        "watched_blocks": 40,
        "replays_judged": 1000,
        "captured_at": T0 + 0.1 * gid,
        "node_summary": {"names": names, "nodes": nodes, "total": NODES},
    }


def synthetic_report(n: int, sites: int = 16):
    """A report of `n` findings over `sites` distinct (graph, node, argument, kind) sites, each
    found again one step after the other."""
    from graphsan.report import Finding, GraphInfo, OtherUse, Report

    names = [kernel_name(i) for i in range(24)]
    graphs = [graph_dict(g, names) for g in range(1, GRAPHS + 1)]
    infos = [GraphInfo(g["id"], g["label"], g["capture_site"], (1, g["id"]), 0) for g in graphs]
    stream = 0x7F00_DEAD_0000
    events = [
        {"t": g["captured_at"], "kind": "capture", "rank": None, "graph": g["id"]}
        | {"label": g["label"], "device": 0, "stream": stream, "begin": g["captured_at"] - 0.05}
        for g in graphs
    ]
    findings = []
    for j in range(n):
        site, step = j % sites, j // sites
        g = graphs[site % GRAPHS]
        info = infos[site % GRAPHS]
        node = site % NODES
        name = names[g["node_summary"]["nodes"][node]]
        found = T0 + 2.0 + 0.05 * j
        block = 0x7F3A_0000_0000 + (site << 24)
        if site == 0:
            events.append({"t": found - 0.02, "kind": "phase", "rank": None, "phase": "train"})
            events[-1]["step"] = step
        events.append(
            {"t": found, "kind": "replay", "rank": None, "graph": g["id"], "label": g["label"]}
            | {"device": 0, "stream": stream, "outcome": "findings", "findings": 1}
        )
        findings.append(
            Finding.of(  # flat, as the JSON holds it: a baked kind's free stack is its change
                kind=KINDS[site % len(KINDS)],
                graph=info,
                node=node,
                kernel=name,
                param=site % 3,
                offset=8 * (site % 5) + 64 * (site // CYCLE),
                address=block + 4096,
                nbytes=2 << 20,
                block_address=block,
                pool="default pool",
                alloc_stack=stack("alloc", site),
                free_stack=stack("free", site),
                phase="train",
                step=step,
                now="free in the allocator's cache; any allocation may take it",
                other_nodes=1,
                also_used_by=(OtherUse(g["id"] % GRAPHS + 1, "next", node, name, 0, 8),),
                freed_at=found - 0.01,
                found_at=found,
            )
        )
    kept = sorted(events, key=lambda e: e["t"])[:MAX_EVENTS]
    return Report(
        findings=findings,
        graphs=graphs,
        policy="record",
        events=kept,
        events_dropped=len(events) - len(kept),
    )


def child(n: int, sites: int, render: bool = False) -> dict:
    """Write the page of `n` findings twice: timed, then under tracemalloc; `render`: open it
    in headless Chromium too."""
    from graphsan.report.pages import write_report_outputs

    report = synthetic_report(n, sites)
    out = os.path.join(tempfile.mkdtemp(prefix="graphsan-page-"), "page.html")
    gc.collect()
    start = time.perf_counter()
    write_report_outputs([report], ["bench.json"], html=out)
    seconds = time.perf_counter() - start
    size = os.path.getsize(out)
    gc.collect()
    tracemalloc.start()
    write_report_outputs([report], ["bench.json"], html=out)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    result = {"bytes": size, "seconds": seconds, "peak_bytes": peak}
    if render:
        result |= rendered(out)
    os.unlink(out)
    os.rmdir(os.path.dirname(out))
    return result


def rendered(path: str) -> dict:
    """Seconds headless Chromium takes to load the page, lay it out and show its first screen."""
    from browser import find_chromium, open_page

    binary = find_chromium()
    if binary is None:
        raise SystemExit("--render: no Chromium found (apt-get install chromium)")
    shot = path + ".png"
    page = open_page(binary, path, shot, timeout=1800, whole=False)
    os.unlink(shot)
    return {f"{k}_s": v for k, v in page.timings.items()}


def run_child(src: str, n: int, sites: int, rev: str = "", render: bool = False) -> dict:
    """One count in a fresh process with graphsan from `src`."""
    argv = [os.path.abspath(__file__), "--child", str(n), "--sites", str(sites)]
    argv += ["--render"] if render else []
    return run_at(src, argv, rev, f"of {n} findings", timeout=3600)


def counts_arg(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts of at least 1, got {text!r}")
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--findings", type=counts_arg, default=[200, 2000, 20000], metavar="N,N,...")
    p.add_argument("--sites", type=int, default=16, help="distinct (graph, node, arg, kind)")
    p.add_argument("--repeat", type=int, default=1, help="runs per row; the fastest counts")
    p.add_argument("--against", metavar="REV", help="also run graphsan at git revision REV")
    p.add_argument(
        "--render", action="store_true", help="also time headless Chromium opening the page"
    )
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        write_result(child(args.child, args.sites, args.render))
        return
    if args.sites < 1 or args.repeat < 1:
        p.error("--sites and --repeat must be at least 1")
    with revisions(args.against, p.error) as revs:
        print(
            f"{args.sites} distinct sites, {GRAPHS} graphs of {NODES} nodes, {DEPTH}-frame stacks"
        )
        browser = " load s | layout s | screenshot s |" if args.render else ""
        print(f"| findings | revision | page MB | write s | peak MiB (tracemalloc) |{browser}")
        print("|---:|---|---:|---:|---:|" + "---:|" * (3 if args.render else 0))
        for n in args.findings:
            for name, src, rev in revs:
                runs = [run_child(src, n, args.sites, rev, args.render) for _ in range(args.repeat)]
                best = min(runs, key=lambda r: r["seconds"])
                row = (
                    f"| {n:,} | {name} | {best['bytes'] / 1e6:.2f} | {best['seconds']:.2f} | "
                    f"{best['peak_bytes'] / 2**20:.0f} |"
                )
                if args.render:
                    fastest = min(runs, key=lambda r: r["load_s"] + r["layout_s"])
                    row += "".join(
                        f" {fastest[k]:.2f} |" for k in ("load_s", "layout_s", "screenshot_s")
                    )
                print(row, flush=True)


if __name__ == "__main__":
    main()

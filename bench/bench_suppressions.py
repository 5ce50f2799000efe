"""Suppressions at scale: the time to split N findings by M suppression entries.

    python bench/bench_suppressions.py [--entries 50000] [--findings 20000] [--matched 10000]
                                       [--repeat 1] [--against REV]

The findings are bench_report_page.py's synthetic report with every finding at a site of its
own (8 graphs of 24 kernel nodes, 16-frame stacks). The entries are what
`graphsan report --gen-suppressions` writes for findings at M sites (kind, kernel, graph label,
innermost allocation and free frames), read back from that YAML: the first `--matched` of them
are the sites of findings in the report, the others sites it does not have, so most findings are
checked against every entry that could match and are kept.

Each row runs in a fresh process, the entries and findings built beforehand and not counted:
`split` is timed as `graphsan report --suppressions` calls it, once. `--against REV` runs the
same through graphsan's code at git revision REV (extracted to a temporary folder) first.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

from bench_report_page import synthetic_report
from revisions import revisions, run_at

from graphsan.command_line import write_result


def child(n_entries: int, n_findings: int, matched: int) -> dict:
    import yaml

    from graphsan.report import suppressions

    findings = synthetic_report(n_findings, n_findings).findings
    # the entries' sites: the first `matched` of the report's, then sites past its last one
    sites = list(range(matched)) + list(range(n_findings, n_findings + n_entries - matched))
    made = synthetic_report(max(sites) + 1, max(sites) + 1).findings
    text = suppressions.generate([made[i] for i in sites])
    listed = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    entries = [suppressions.Suppression(**e) for e in listed]
    gc.collect()
    start = time.perf_counter()
    kept, suppressed = suppressions.split(entries, findings)
    seconds = time.perf_counter() - start
    return {
        "entries": len(entries),
        "findings": len(findings),
        "suppressed": len(suppressed),
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=int, default=50_000)
    p.add_argument("--findings", type=int, default=20_000)
    p.add_argument("--matched", type=int, default=10_000, help="entries matching a finding")
    p.add_argument("--repeat", type=int, default=1, help="runs per row; the fastest counts")
    p.add_argument("--against", metavar="REV", help="also run graphsan at git revision REV")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 0 <= args.matched <= min(args.entries, args.findings) or args.repeat < 1:
        p.error("expected 0 <= --matched <= --entries, --findings and --repeat >= 1")
    sizes = ["--entries", str(args.entries), "--findings", str(args.findings)]
    sizes += ["--matched", str(args.matched)]
    if args.child:
        write_result(child(args.entries, args.findings, args.matched))
        return
    argv = [os.path.abspath(__file__), "--child", *sizes]
    with revisions(args.against, p.error) as revs:
        print("| entries | findings | suppressed | revision | split s |")
        print("|---:|---:|---:|---|---:|")
        for name, src, rev in revs:
            runs = [
                run_at(src, argv, rev, "of the split", timeout=7200) for _ in range(args.repeat)
            ]
            best = min(runs, key=lambda r: r["seconds"])
            print(
                f"| {best['entries']:,} | {best['findings']:,} | {best['suppressed']:,} | "
                f"{name} | {best['seconds']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

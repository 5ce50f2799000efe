"""The `graphsan repro` command line: list the cases, or run the matrix (each case in a process
of its own: `graphsan.lab.repro.child`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time

from graphsan.command_line import EXIT_CANNOT_WRITE, EXIT_NO_GPU, CliError
from graphsan.lab.repro import runner
from graphsan.lab.repro.cases import BY_NUMBER, CASES, model_overrides
from graphsan.lab.repro.table import print_cases, print_results
from graphsan.report.output import STDOUT, output_path, write_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--case",
        type=int,
        action="append",
        metavar="N",
        help=f"run only case N (1-{len(CASES)}; repeatable: the cases given, in that order, "
        "each once however often it is named)",
    )
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--preset", default="small", help="model preset")
    parser.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="processes run side by side (0: every case and the eager reference at "
        "once, up to the number of CPU cores)",
    )
    parser.add_argument(
        "--mamba-heads",
        type=int,
        default=0,
        metavar="N",
        help="Mamba heads (of 64 channels) on the small preset (0: 64, so out_proj's MXFP8 "
        "weight workspace holds 2 MiB per half; the real model's spans many 2 MiB pages)",
    )
    parser.add_argument(
        "--html",
        metavar="PATH",
        help="also write the matrix and per-case loss curves as one self-contained HTML page "
        "(not with --list, which runs nothing)",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="also write the cases (--list) or the results as JSON to PATH; without PATH "
        "(or with -) to stdout, the tables then go to stderr; an existing file is replaced "
        "only when it is empty or an earlier repro JSON",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a case may take")
    parser.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="ranks per case: each case runs as a torch.distributed job of N processes (one "
        "GPU each, NCCL; data parallel, the routed experts split across the ranks), as under "
        "torchrun; the table says what each rank saw",
    )
    parser.add_argument(
        "--report",
        metavar="DIR",
        help="write graphsan's JSON report of each case that runs it to DIR/caseN.json "
        "(DIR/caseN.rankR.json per rank with --nproc; `graphsan report` merges them)",
    )


def build_parser() -> argparse.ArgumentParser:
    from graphsan.command_line import DefaultsHelpFormatter, OneLineParser

    parser = OneLineParser(
        prog="graphsan repro",
        description="The Transformer Engine #3316 scenario matrix: each case in its own process "
        "on one NVIDIA GPU (or as N ranks on N GPUs with --nproc); exits 1 when a case does not "
        "end as expected, 4 on a machine without a GPU.",
        formatter_class=DefaultsHelpFormatter,
    )
    add_arguments(parser)
    return parser


def run(argv: list[str] | None = None) -> int:
    return main(build_parser().parse_args(argv))


def _error(msg: str) -> int:
    sys.stderr.write(f"graphsan repro: error: {msg}\n")
    return 2


def _check_args(args: argparse.Namespace) -> str:
    """What is wrong with the options of a matrix run ("" when nothing)."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout {args.timeout}: expected a number of seconds > 0"
    if args.jobs < 0:
        return f"--jobs {args.jobs}: expected >= 0 (0: as many as the cases need)"
    if args.mamba_heads < 0:
        return f"--mamba-heads {args.mamba_heads}: expected >= 0 (0: the default width)"
    if args.nproc < 1:
        return f"--nproc {args.nproc}: expected >= 1 (ranks per case)"
    from graphsan.lab.models import PRESETS, get_preset

    if args.preset not in PRESETS:
        return f"--preset {args.preset}: expected one of {', '.join(PRESETS)}"
    try:
        get_preset(args.preset).replace(**model_overrides(args.preset, args.mamba_heads))
    except ValueError as err:
        return f"--mamba-heads {args.mamba_heads}: {err}"
    return ""


def main(args: argparse.Namespace) -> int:
    unknown = [n for n in args.case or [] if n not in BY_NUMBER]
    if unknown:
        return _error(f"no case {unknown[0]}; expected 1-{len(CASES)}")
    # a case named twice runs once: its result would only repeat, at the cost of another run
    cases = [BY_NUMBER[n] for n in dict.fromkeys(args.case)] if args.case else CASES
    to_stdout = args.json == STDOUT
    problem = _check_outputs(args)
    if problem:
        return _error(problem)
    # resolved here, in the folder the command started in
    json_path = None if args.json is None else output_path(args.json)
    html_path = None if args.html is None else output_path(args.html)
    out = sys.stderr if to_stdout else sys.stdout  # the JSON alone goes to stdout
    if args.list:
        print_cases(cases, out)
        if args.json is not None:
            return _write_json([c.to_json() for c in cases], json_path, args.json)
        return 0
    problem = _check_args(args)
    if problem:
        return _error(problem)
    import torch

    if not torch.cuda.is_available():
        print_cases(cases, out)
        sys.stderr.write(
            "graphsan repro: error: these cases train with CUDA graphs and need an NVIDIA GPU "
            "(torch.cuda.is_available() is False here); `graphsan repro --list` shows them, "
            "`graphsan train --preset tiny` runs the lab eagerly on CPU\n"
        )
        return EXIT_NO_GPU
    gpus = torch.cuda.device_count() if args.nproc > 1 else 1
    if args.nproc > gpus:
        return _error(
            f"--nproc {args.nproc}: each rank needs a GPU of its own and this machine has "
            f"{gpus}; expected --nproc <= {gpus}"
        )
    problem = _prepare_report_dir(args.report)
    if problem:
        return _error(problem)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="graphsan-repro-reports-") as scratch:
        # on several ranks the reports are always written: the table's report merges them
        report_dir = output_path(args.report) if args.report else None
        report_dir = report_dir or (scratch if args.nproc > 1 else None)
        results = runner.run_matrix(
            cases,
            args.preset,
            args.jobs,
            args.timeout,
            args.mamba_heads,
            out,
            nproc=args.nproc,
            report_dir=report_dir,
        )
    print_results(results, out)
    ref = next((r.reference_outcome for _, r in results if r.reference_outcome), None)
    if ref:
        print(f"\neager reference run (for the comparisons): {ref}", file=out)
    where = torch.cuda.get_device_name()
    where = f"{args.nproc} x {where} ({args.nproc} ranks per case)" if args.nproc > 1 else where
    print(f"\nwhole matrix: {time.perf_counter() - t0:.0f} s wall on {where}", file=out)
    for c, r in results:
        if r.report:
            merged = " (the ranks' reports merged)" if r.ranks else ""
            print(f"\ncase {c.n}, graphsan's report{merged}:\n{r.report}", file=out)
    if args.report:
        print(
            f"\ngraphsan's reports: {args.report} (`graphsan report FILE...` reads them)", file=out
        )
    rows = [{"case": c.to_json(), "result": r.to_json()} for c, r in results]
    if args.json is not None and _write_json(rows, json_path, args.json):
        return EXIT_CANNOT_WRITE
    if args.html and _write_page(rows, html_path, args.html):
        return EXIT_CANNOT_WRITE
    missed = [(c, r) for c, r in results if not r.matched]
    for c, r in missed:
        sys.stderr.write(
            f"graphsan repro: case {c.n} ({c.title}) did not end as expected: "
            f"{r.outcome}; {r.mismatch}\n"
        )
    return 1 if missed else 0


# how repro's JSON begins, as _write_json writes it: the cases (--list), or the results
_CASES = re.compile(rb'^\s*\[\s*\{\s*"case"\s*:\s*\d+\s*,\s*"title"\s*:')
_RESULTS = re.compile(rb'^\s*\[\s*\{\s*"case"\s*:\s*\{\s*"case"\s*:\s*\d+')


def is_repro_json(path: str) -> bool:
    """Whether the file at `path` begins as `graphsan repro --json` writes (the first bytes are
    read, not the whole file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return bool(_CASES.match(head) or _RESULTS.match(head))


def _check_outputs(args: argparse.Namespace) -> str:
    """What is wrong with --json and --html ("" when nothing): each a path a file can be written
    at, --json one whose loss costs nothing, --html not with --list (which draws nothing)."""
    from graphsan.command_line import check_kept_file, check_output_file

    try:
        if args.html is not None:
            if args.html == STDOUT:
                raise CliError("--html -: the page cannot go to stdout; expected a file path")
            check_output_file(args.html, "--html")
            if args.list:
                raise CliError(
                    f"--html {args.html}: --list runs no case, so there is no matrix to draw "
                    "(expected --html without --list)"
                )
        if args.json is not None and args.json != STDOUT:
            check_kept_file(
                args.json,
                "--json",
                is_repro_json,
                "graphsan repro's JSON",
                "the JSON",
                "an earlier repro JSON",
            )
    except CliError as err:
        return str(err)
    return ""


def _write_json(data, path: str, name: str) -> int:
    """The cases or results, whole (graphsan.report.output; `-`: stdout) to `path` (resolved at
    start; the user named it `name`): 0, or EXIT_CANNOT_WRITE after one line saying why."""
    try:
        write_output(path, json.dumps(data, indent=1, default=str) + "\n")
    except BrokenPipeError:  # `--json | head`: the reader left (graphsan.cli says nothing)
        raise
    except OSError as err:
        _error(f"--json {name}: cannot write ({err.strerror or err})")
        return EXIT_CANNOT_WRITE
    return 0


def _write_page(rows: list, path: str, name: str) -> int:
    """The matrix page, as `_write_json` writes the JSON."""
    from graphsan.report.pages.matrix import render_matrix

    try:
        write_output(path, render_matrix(rows, None))
    except OSError as err:
        _error(f"--html {name}: cannot write ({err.strerror or err})")
        return EXIT_CANNOT_WRITE
    sys.stderr.write(f"graphsan: matrix page written to {name}\n")
    return 0


def _prepare_report_dir(path: str | None) -> str:
    """Create the --report folder if needed and check it takes files ("" when fine)."""
    if path is None:
        return ""
    from graphsan.command_line import CliError, check_output_file

    if os.path.exists(path) and not os.path.isdir(path):
        return f"--report {path}: is a file; expected a folder"
    try:
        os.makedirs(path, exist_ok=True)
        check_output_file(os.path.join(path, "case1.json"), "--report")
    except OSError as err:
        return f"--report {path}: cannot create the folder ({err.strerror})"
    except CliError as err:
        return str(err)
    return ""

"""`graphsan selftest`: the corpus of correct CUDA-graph programs and their broken twins, listed
(no GPU needed) or run on this machine's GPU (`graphsan.selftest`).

    graphsan selftest [--list [--json PATH]] [-k PATTERN] [--jobs N] [--json PATH] [--dump DIR]
"""

from __future__ import annotations

import os
import sys

from graphsan.command_line import (
    EXIT_NO_GPU,
    CliError,
    DefaultsHelpFormatter,
    OneLineParser,
    cannot_write,
    check_kept_file,
)
from graphsan.report.output import STDOUT, output_path


def make_parser() -> OneLineParser:
    p = OneLineParser(
        prog="graphsan selftest",
        description="Run graphsan's corpus of correct CUDA-graph programs, each with a broken "
        "twin, on this machine's GPU: every correct program must end with no finding, every "
        "twin must be stopped before its bad replay. Exits 1 on any false alarm, miss or error, 4 "
        "on a machine without a GPU.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--list", action="store_true", help="list the programs (no GPU needed)")
    p.add_argument(
        "--json",
        metavar="PATH",
        help="write the list (with --list) or the results as JSON; - for stdout (the progress "
        "and summary then go to stderr); an existing file is replaced only when it is empty or "
        "an earlier selftest JSON",
    )
    p.add_argument("-k", dest="pattern", metavar="PATTERN", help="only runs whose name contains it")
    p.add_argument(
        "--jobs",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="runs side by side (each its own process on the one GPU)",
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds one run may take")
    p.add_argument(
        "--dump",
        metavar="DIR",
        help="also write each correct program's captured nodes and argument bytes here, one "
        "gzipped file per program (to attach to a bug report)",
    )
    return p


def main(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    if args.jobs < 1:
        raise CliError(f"--jobs {args.jobs}: expected 1 or more")
    if args.timeout <= 0:
        raise CliError(f"--timeout {args.timeout}: expected a positive number of seconds")
    if args.json is not None and args.json != STDOUT:
        from graphsan.selftest.runner import is_selftest_json

        check_kept_file(
            args.json,
            "--json",
            is_selftest_json,
            "graphsan selftest's JSON",
            "the JSON",
            "an earlier selftest JSON",
        )
    target = None if args.json is None else output_path(args.json)
    if args.dump is not None and not os.path.isdir(args.dump):
        raise CliError(f"--dump {args.dump}: expected an existing folder")
    from graphsan.selftest import runner, runs

    if args.list:
        listing = [r for r in runs() if not args.pattern or args.pattern in r["name"]]
        if not listing:
            raise CliError(f"-k {args.pattern}: no run's name contains it (see --list alone)")
        if args.json:
            _write(target, listing, args.json)
            where = "stdout" if args.json == STDOUT else args.json
            sys.stderr.write(f"graphsan selftest: {len(listing)} runs listed in {where}\n")
        else:
            width = max((len(r["name"]) for r in listing), default=0)
            for r in listing:
                print(f"{r['name']:<{width}}  {r['kind']:<7}  {r.get('bug') or r['pattern']}")
        return 0
    chosen = runner.selected(args.pattern)
    if not chosen:
        raise CliError(f"-k {args.pattern}: no run's name contains it (see --list)")
    code = runner.run_and_report(chosen, args.jobs, args.timeout, args.dump, target, args.json)
    return EXIT_NO_GPU if code is None else code


def _write(path: str, data, name: str) -> None:
    """The listing to `path` (resolved at start; the user named it `name`)."""
    from graphsan.selftest import runner

    try:
        runner.write_json(path, data)
    except BrokenPipeError:  # `... --json - | head`: the reader left (graphsan.cli says nothing)
        raise
    except OSError as err:
        raise cannot_write("--json", name, err) from None

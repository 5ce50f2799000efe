"""`graphsan run | report | train | repro`.

    graphsan run [--policy P] [--report out.json] script.py [args...]
    graphsan run [--policy P] [--report out.json] -m package.module [args...]
    graphsan report out.json [more.json ...]
    graphsan train [...]      the lab trainer (see `graphsan train --help`)
    graphsan repro [...]      the Transformer Engine #3316 scenario matrix

Every error is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

EXIT_USAGE = 2
EXIT_FINDINGS = 3


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 2."""


def report_path_for(path: str, rank: int | None) -> str:
    """`out.json` -> `out.rank{N}.json` under torchrun, so ranks never overwrite each other."""
    if rank is None:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def _cmd_run(args: argparse.Namespace) -> int:
    import graphsan

    target = args.target
    if args.module is None and not target:
        raise CliError("graphsan run: expected a script path or -m MODULE")
    if args.module is None and not os.path.isfile(target[0]):
        raise CliError(f"graphsan run: no such script: {target[0]}")
    san = graphsan.enable(policy=args.policy)
    path = report_path_for(args.report, san.rank) if args.report else None
    code = 0
    sys.argv = list(target) if args.module is None else [args.module, *target]
    try:
        if args.module is not None:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        graphsan.disable()
        if path:
            san.report().save(path)
            sys.stderr.write(f"graphsan: report written to {path}\n")
    if code == 0 and san.findings and args.policy != "pin":
        code = EXIT_FINDINGS if args.fail_on_findings else 0
    return code


def _cmd_report(args: argparse.Namespace) -> int:
    from graphsan.ranks import merge_reports
    from graphsan.report import Report

    reports = []
    for path in args.paths:
        try:
            reports.append(Report.load(path))
        except ValueError as err:
            raise CliError(str(err)) from None
    if args.html or args.trace:
        from graphsan.pages import OutputError, write_report_outputs

        try:
            said = write_report_outputs(reports, args.paths, args.html, args.trace)
        except OutputError as err:
            raise CliError(f"graphsan report: {err}") from None
        sys.stderr.write("".join(f"{line}\n" for line in said))
    elif len(reports) == 1:
        print(reports[0].render())
    else:
        print(merge_reports(reports, args.paths))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from graphsan.lab.train import cli as train_cli

    return train_cli.main(args)


def _cmd_repro(args: argparse.Namespace) -> int:
    from graphsan.lab import repro

    return repro.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphsan", description="Catch stale memory in CUDA graphs before they replay."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a script or module with the sanitizer on")
    run.add_argument("--policy", default="raise", choices=["raise", "warn", "record", "pin"])
    run.add_argument("--report", help="write a JSON report here (per rank under torchrun)")
    run.add_argument(
        "--fail-on-findings",
        action="store_true",
        help=f"exit {EXIT_FINDINGS} when the program finishes with findings (warn/record)",
    )
    run.add_argument("-m", dest="module", help="run a library module as a script")
    run.add_argument("target", nargs=argparse.REMAINDER, help="script.py [args...]")
    run.set_defaults(func=_cmd_run)

    rep = sub.add_parser("report", help="render saved reports (several: merged by rank)")
    rep.add_argument("paths", nargs="+")
    rep.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    rep.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto)")
    rep.set_defaults(func=_cmd_report)

    try:
        from graphsan.lab.train import cli as train_cli
    except ImportError:
        train_cli = None
    train = sub.add_parser("train", help="train the lab's hybrid model")
    if train_cli is not None:
        train_cli.add_arguments(train)
    train.set_defaults(func=_cmd_train)

    try:
        from graphsan.lab import repro
    except ImportError:
        repro = None
    rp = sub.add_parser("repro", help="the Transformer Engine #3316 scenario matrix")
    if repro is not None:
        repro.add_arguments(rp)
    rp.set_defaults(func=_cmd_repro)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as err:
        sys.stderr.write(f"error: {err}\n")
        return EXIT_USAGE
    except ImportError as err:
        sys.stderr.write(f"error: graphsan {args.command}: not available ({err})\n")
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())

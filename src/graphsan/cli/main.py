"""`graphsan run | report | selftest | train | repro`: the console entry point.

    graphsan run [--policy P] [--report out.json] script.py [args...]
    graphsan run [--policy P] [--report out.json] -m package.module [args...]
    graphsan report [--html OUT.html] [--trace OUT.json] out.json [more.json ...]
    graphsan selftest [--list [--json PATH]] [-k PATTERN] [--jobs N] [--json PATH]
    graphsan train [...]      the lab trainer (see `graphsan train --help`)
    graphsan repro [...]      the Transformer Engine #3316 scenario matrix

Every user mistake is one line on stderr and a non-zero exit. Each command builds its own parser
when it is chosen (`graphsan.cli`: run, report, selftest; the lab's train and repro, below):
`graphsan --help` loads neither torch nor the lab, `graphsan run` never loads the lab.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from graphsan import __version__
from graphsan.cli import report, run, selftest
from graphsan.command_line import (
    EXIT_BROKEN_PIPE,
    EXIT_USAGE,
    CliError,
    DefaultsHelpFormatter,
    OneLineParser,
    check_output_file,
)

__all__ = ["CliError", "DefaultsHelpFormatter", "OneLineParser", "check_output_file", "main"]

COMMANDS = {
    "run": "run a script or module with the sanitizer on",
    "report": "render saved reports (several: merged by rank)",
    "selftest": "check graphsan on this torch and GPU: correct programs and broken twins",
    "train": "train the lab's hybrid model",
    "repro": "the Transformer Engine #3316 scenario matrix",
}


# ----------------------------------------------------------------------------- the lab
def _lab_import_error(err: ImportError) -> CliError:
    return CliError(f"the lab cannot be imported here ({err}); `graphsan run` does not need it")


def cmd_train(argv: list[str]) -> int:
    try:
        from graphsan.lab.train import cli as train_cli
    except ImportError as err:
        raise _lab_import_error(err) from None
    return train_cli.run(argv)


def cmd_repro(argv: list[str]) -> int:
    try:
        from graphsan.lab import repro
    except ImportError as err:
        raise _lab_import_error(err) from None
    return repro.run(argv)


_HANDLERS = {
    "run": run.main,
    "report": report.main,
    "selftest": selftest.main,
    "train": cmd_train,
    "repro": cmd_repro,
}


def _top_parser() -> OneLineParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {text}" for name, text in COMMANDS.items())
    p = OneLineParser(
        prog="graphsan",
        usage="graphsan [--version] COMMAND [args ...]",
        description="Catch stale memory in CUDA graphs before they replay.",
        epilog=f"commands:\n{listing}\n\n`graphsan COMMAND --help` describes each.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"graphsan {__version__}")
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=argparse.SUPPRESS)
    p.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        if not argv:
            top.error(f"expected a command: {', '.join(COMMANDS)}")
        if argv[0].startswith("-") and argv[0] not in top._option_string_actions:
            # argparse would ask for COMMAND first and never name the option it does not know
            top.error(
                f"unrecognized option {argv[0]}; expected a command ({', '.join(COMMANDS)}), "
                "--help or --version"
            )
        ns = top.parse_args(argv)  # --help, --version and mistakes end here
        argv = [ns.command, *ns.args]
    command, rest = argv[0], argv[1:]
    from graphsan import environment

    if not _asks_for_help(command, rest):  # help holds whatever the environment says
        errors, warnings = environment.problems()
        environment.said = True  # graphsan.enable() in this process says nothing again
        for line in warnings:
            sys.stderr.write(f"graphsan {command}: warning: {line}\n")
        if errors:
            sys.stderr.write("".join(f"graphsan {command}: error: {line}\n" for line in errors))
            return EXIT_USAGE
    try:
        code = int(_HANDLERS[command](rest) or 0)
        sys.stdout.flush()  # here, so that a reader gone early is seen here, not at exit
        return code
    except CliError as err:
        sys.stderr.write(f"graphsan {command}: error: {err}\n")
        return err.exit_status
    except BrokenPipeError:
        # `graphsan ... | head`: the reader is gone, nothing to report; the status `cat` gets
        # from the signal, and nothing more written to the closed pipe at exit
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _asks_for_help(command: str, rest: list[str]) -> bool:
    """Whether the command line asks for the command's --help (for `run`: among graphsan's
    options, before the program's own)."""
    if command == "run":
        rest = run._split_run_argv(run.make_parser(), rest)[0]
    return "-h" in rest or "--help" in rest


if __name__ == "__main__":
    sys.exit(main())

"""`graphsan run | report | train | repro`.

    graphsan run [--policy P] [--report out.json] script.py [args...]
    graphsan run [--policy P] [--report out.json] -m package.module [args...]
    graphsan report [--html OUT.html] [--trace OUT.json] out.json [more.json ...]
    graphsan selftest [--list [--json PATH]] [-k PATTERN] [--jobs N] [--json PATH]
    graphsan train [...]      the lab trainer (see `graphsan train --help`)
    graphsan repro [...]      the Transformer Engine #3316 scenario matrix

Every user mistake is one line on stderr and a non-zero exit. Each command builds its own parser
when it is chosen: `graphsan --help` loads neither torch nor the lab, `graphsan run` never loads
the lab.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from graphsan import __version__
from graphsan.command_line import (
    EXIT_NO_GPU,
    EXIT_USAGE,
    CliError,
    DefaultsHelpFormatter,
    OneLineParser,
    check_output_file,
)
from graphsan.policies import Policy

EXIT_FINDINGS = 3
__all__ = ["CliError", "DefaultsHelpFormatter", "OneLineParser", "check_output_file", "main"]

COMMANDS = {
    "run": "run a script or module with the sanitizer on",
    "report": "render saved reports (several: merged by rank)",
    "selftest": "check graphsan on this torch and GPU: correct programs and broken twins",
    "train": "train the lab's hybrid model",
    "repro": "the Transformer Engine #3316 scenario matrix",
}


def report_path_for(path: str, rank: int | None) -> str:
    """`out.json` -> `out.rank{N}.json` under torchrun, so ranks never overwrite each other."""
    if rank is None:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


# ----------------------------------------------------------------------------- graphsan run
def _run_parser() -> OneLineParser:
    from graphsan.policies import POLICIES

    p = OneLineParser(
        prog="graphsan run",
        usage="graphsan run [options] (script.py | -m MODULE) [args ...]",
        description="Run a Python script or module with the sanitizer on, as `python` would "
        "(sys.argv, sys.path, __main__, exit status); options after the script or module "
        "are its own.",
        formatter_class=DefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--policy",
        default=Policy.RAISE.value,
        choices=POLICIES,
        help="raise: stop the replay (StaleMemoryError); warn: print each finding, replay; "
        "record: only collect; pin: keep the memory alive, raise for what cannot be pinned",
    )
    p.add_argument(
        "--report",
        metavar="PATH",
        help="write a JSON report here, also when the program fails (per rank under torchrun: "
        "out.rank{N}.json)",
    )
    p.add_argument(
        "--fail-on-findings",
        action="store_true",
        help=f"exit {EXIT_FINDINGS} when the program finishes with findings (warn/record)",
    )
    p.add_argument(
        "--suppressions",
        metavar="FILE",
        help="a YAML file of findings to suppress (counted, never stopping a replay; see "
        "graphsan report --gen-suppressions)",
    )
    p.add_argument("-m", dest="module", metavar="MODULE", help="run a library module as a script")
    return p


def _split_run_argv(parser: argparse.ArgumentParser, argv: list[str]):
    """graphsan's options, then the program's: everything from the script (or from the module
    after -m) on belongs to the program, options included, as with `python`."""
    actions = parser._option_string_actions
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return argv[:i], argv[i + 1 :]
        if not tok.startswith("-") or tok == "-":
            return argv[:i], argv[i:]
        name = tok.split("=", 1)[0]
        if name not in actions and tok.startswith("-m"):  # -mpackage.module
            return argv[: i + 1], argv[i + 1 :]
        action = actions.get(name)
        takes_value = action is not None and action.nargs != 0 and "=" not in tok
        end = i + (2 if takes_value else 1)
        if action is not None and action.dest == "module":
            return argv[:end], argv[end:]
        i = end
    return argv, []


class _NoSuchModule(Exception):
    pass


class _Terminated(BaseException):
    """A scheduler's stop signal (torchrun stops the other ranks with SIGTERM when one fails;
    SLURM and Kubernetes stop jobs with it): raised in the program so that the report is
    written as on Ctrl-C, then the process ends by the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1")


def _catch_stop_signals() -> dict:
    """Turn the stop signals into `_Terminated` while the program runs; returns the handlers
    to put back. A signal the program already handles is left to it."""
    import signal

    saved = {}
    for name in STOP_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is None or signal.getsignal(sig) not in (signal.SIG_DFL, None):
            continue

        def stop(signum, frame):
            raise _Terminated(signum)

        saved[sig] = signal.signal(sig, stop)
    return saved


def _end_by_signal(signum: int) -> None:
    """Die of `signum` as the program would have without graphsan (the exit status a shell,
    torchrun or a scheduler expects: 128 + signum)."""
    import signal

    signal.signal(signum, signal.SIG_DFL)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signum)


def _run_program(module: str | None, target: list[str]) -> None:
    """Run the program as `python script.py` / `python -m module` would."""
    import runpy

    if module is None:  # __file__ absolute, as `python script.py` sets it
        runpy.run_path(os.path.abspath(target[0]), run_name="__main__")
        return
    from importlib.util import find_spec

    try:
        spec = find_spec(module)  # imports the parent packages, as `python -m` does
    except ModuleNotFoundError as err:
        if err.name and (module == err.name or module.startswith(err.name + ".")):
            raise _NoSuchModule(f"no module named {err.name!r}") from None
        raise
    if spec is None:
        raise _NoSuchModule(f"no module named {module!r}")
    if spec.submodule_search_locations is not None and find_spec(f"{module}.__main__") is None:
        raise _NoSuchModule(f"{module!r} is a package without a __main__ module")
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _exit_status(code) -> int:
    """What `python` makes of `sys.exit(code)`: None 0, an int itself, anything else is printed
    to stderr and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)
    sys.stderr.write(f"{code}\n")
    return 1


_OWN_FILES = {os.path.abspath(__file__)}


def _print_user_traceback(exc: BaseException) -> None:
    """The program's traceback as `python` prints it: graphsan's and runpy's frames, which lead
    into the program, are left out."""
    import runpy

    own = _OWN_FILES | {os.path.abspath(runpy.__file__)}
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name in own or name.startswith("<frozen ") or name.endswith("importlib/util.py")):
            break
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    from graphsan.command_line import rank_from_env

    rank = rank_from_env()
    if rank is None or sys.excepthook is not sys.__excepthook__:
        sys.excepthook(type(exc), exc, tb)  # the hook prints exc's own traceback
        return
    import traceback  # under torchrun: every line says which rank it comes from

    text = "".join(traceback.format_exception(type(exc), exc, tb))
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))


def _write_report(san, path: str) -> bool:
    who = f"[rank {san.rank}] " if san.rank is not None else ""
    try:
        san.report().save(path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.unlink(f"{path}.tmp")
        sys.stderr.write(
            f"{who}graphsan run: error: could not write the report to {path} ({err.strerror}); "
            "here it is instead:\n"
        )
        sys.stderr.write(san.report().render() + "\n")
        return False
    sys.stderr.write(f"{who}graphsan: report written to {path}\n")
    return True


def cmd_run(argv: list[str]) -> int:
    parser = _run_parser()
    ours, target = _split_run_argv(parser, argv)
    args = parser.parse_args(ours)
    module = args.module
    if module is not None and not module.strip():
        raise CliError("-m '': expected a module name")
    if module is None:
        if not target:
            raise CliError("expected a script path or -m MODULE (see graphsan run --help)")
        script = target[0]
        if not os.path.exists(script):
            raise CliError(f"no such script: {script}")
        if os.path.isdir(script) and not os.path.isfile(os.path.join(script, "__main__.py")):
            raise CliError(f"{script} is a directory without __main__.py; expected a script")
    from graphsan.command_line import rank_from_env

    path = None
    if args.report is not None:
        path = report_path_for(args.report, rank_from_env())
        check_output_file(path, "--report")
    entries = _suppressions(args.suppressions)

    import graphsan

    san = graphsan.enable(policy=args.policy)
    san.suppressions = entries
    saved_argv, saved_path = sys.argv, list(sys.path)
    # sys.path[0] is the script's folder, or the current one for -m, as with `python`
    if module is None:
        sys.argv = list(target)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
    else:
        sys.argv = [module, *target]
        sys.path.insert(0, os.getcwd())
    code = 0
    signalled = None
    saved_handlers = _catch_stop_signals()
    try:
        _run_program(module, target)
    except _NoSuchModule as err:
        graphsan.disable()
        raise CliError(f"-m {module}: {err}") from None
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except _Terminated as exc:
        signalled = exc.signum
    except BaseException as exc:  # the program's own error, KeyboardInterrupt included
        _print_user_traceback(exc)
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    graphsan.disable()
    if san.suppressed:
        from graphsan.report.suppressions import summary

        who = f"[rank {san.rank}] " if san.rank is not None else ""
        sys.stderr.write(f"{who}graphsan: {summary(san.suppressed)}\n")
    if path and not _write_report(san, path) and code == 0:
        code = 1
    if signalled is not None:
        _end_by_signal(signalled)
    import signal

    for sig, handler in saved_handlers.items():
        signal.signal(sig, handler)
    if (
        code == 0
        and san.findings
        and Policy(args.policy) is not Policy.PIN
        and args.fail_on_findings
    ):
        code = EXIT_FINDINGS
    return code


def _suppressions(path: str | None) -> list:
    """The entries of --suppressions FILE (none without one); a bad file is one CliError."""
    if path is None:
        return []
    from graphsan.report import suppressions

    try:
        return suppressions.load(path)
    except ValueError as err:
        raise CliError(f"--suppressions {err}") from None


# ----------------------------------------------------------------------------- graphsan report
def cmd_report(argv: list[str]) -> int:
    p = OneLineParser(
        prog="graphsan report",
        description="Print saved reports; several (one per rank) are merged into one summary.",
    )
    from graphsan.report.json_report import SAMPLES, sample_path

    p.add_argument("paths", nargs="*", metavar="REPORT.json")
    p.add_argument("--html", metavar="OUT.html", help="write one self-contained HTML page")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto)")
    p.add_argument(
        "--sample",
        choices=list(SAMPLES),
        help="a report recorded on an NVIDIA H200, shipped with graphsan (no GPU needed): "
        + "; ".join(f"{k}: {v[1]}" for k, v in SAMPLES.items()),
    )
    p.add_argument(
        "--suppressions",
        metavar="FILE",
        help="leave out the findings a YAML suppression file matches (they are counted)",
    )
    p.add_argument(
        "--gen-suppressions",
        action="store_true",
        help="print a suppression entry for each finding, ready to edit, and exit",
    )
    p.add_argument(
        "--error-exitcode",
        type=int,
        metavar="N",
        help="exit N when findings remain after suppressions (compute-sanitizer's flag)",
    )
    args = p.parse_args(argv)
    if args.error_exitcode is not None and not 1 <= args.error_exitcode <= 255:
        raise CliError(f"--error-exitcode {args.error_exitcode}: expected 1 to 255")
    entries = _suppressions(args.suppressions)
    if args.sample is not None:
        if args.paths:
            raise CliError("--sample reads the shipped report; give it no REPORT.json as well")
        args.paths = [sample_path(args.sample)]
    elif not args.paths:
        raise CliError("expected REPORT.json (or --sample NAME; see graphsan report --help)")
    inputs = {os.path.realpath(x) for x in args.paths}
    if len(inputs) < len(args.paths):
        twice = next(
            x
            for i, x in enumerate(args.paths)
            if os.path.realpath(x) in {os.path.realpath(y) for y in args.paths[:i]}
        )
        raise CliError(f"{twice} is given twice; each report counts once")
    for path, option in ((args.html, "--html"), (args.trace, "--trace")):
        if path is not None:
            if os.path.realpath(path) in inputs:
                raise CliError(
                    f"{option} {path}: that is one of the reports being read; writing it would "
                    "replace the report (expected another path)"
                )
            check_output_file(path, option)
    from graphsan.report import Report
    from graphsan.report.ranks import merge_reports

    reports = []
    for path in args.paths:
        try:
            reports.append(Report.load(path))
        except ValueError as err:
            raise CliError(str(err)) from None
    if entries:
        from graphsan.report import suppressions

        for rep in reports:
            rep.findings, suppressed = suppressions.split(entries, rep.findings)
            rep.suppressed = rep.suppressed + suppressed
    if args.gen_suppressions:
        from graphsan.report.suppressions import generate

        print(generate([f for rep in reports for f in rep.findings]), end="")
        return 0
    if args.html or args.trace:
        from graphsan.report.pages import OutputError, write_report_outputs

        try:
            said = write_report_outputs(reports, args.paths, args.html, args.trace)
        except OutputError as err:
            raise CliError(f"graphsan report: {err}") from None
        sys.stderr.write("".join(f"{line}\n" for line in said))
    elif len(reports) == 1:
        print(reports[0].render())
    else:
        print(merge_reports(reports, args.paths))
    if args.error_exitcode is not None and any(rep.findings for rep in reports):
        return args.error_exitcode
    return 0


# ----------------------------------------------------------------------------- graphsan selftest
def _selftest_parser() -> OneLineParser:
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
        help="write the list (with --list) or the results as JSON",
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


def cmd_selftest(argv: list[str]) -> int:
    args = _selftest_parser().parse_args(argv)
    if args.jobs < 1:
        raise CliError(f"--jobs {args.jobs}: expected 1 or more")
    if args.timeout <= 0:
        raise CliError(f"--timeout {args.timeout}: expected a positive number of seconds")
    if args.json is not None:
        check_output_file(args.json, "--json")
    if args.dump is not None and not os.path.isdir(args.dump):
        raise CliError(f"--dump {args.dump}: expected an existing folder")
    from graphsan.selftest import runner, runs

    if args.list:
        listing = [r for r in runs() if not args.pattern or args.pattern in r["name"]]
        if args.json:
            runner.write_json(args.json, listing)
            sys.stderr.write(f"graphsan selftest: {len(listing)} runs listed in {args.json}\n")
        else:
            width = max((len(r["name"]) for r in listing), default=0)
            for r in listing:
                print(f"{r['name']:<{width}}  {r['kind']:<7}  {r.get('bug') or r['pattern']}")
        return 0
    chosen = runner.selected(args.pattern)
    if not chosen:
        raise CliError(f"-k {args.pattern}: no run's name contains it (see --list)")
    code = runner.run_and_report(chosen, args.jobs, args.timeout, args.dump, args.json)
    return EXIT_NO_GPU if code is None else code


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
    "run": cmd_run,
    "report": cmd_report,
    "selftest": cmd_selftest,
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
        ns = top.parse_args(argv)  # --help, --version and mistakes end here
        argv = [ns.command, *ns.args]
    command, rest = argv[0], argv[1:]
    from graphsan import environment

    errors, warnings = environment.problems()
    for line in warnings:
        sys.stderr.write(f"graphsan {command}: warning: {line}\n")
    if errors:
        sys.stderr.write("".join(f"graphsan {command}: error: {line}\n" for line in errors))
        return EXIT_USAGE
    try:
        return int(_HANDLERS[command](rest) or 0)
    except CliError as err:
        sys.stderr.write(f"graphsan {command}: error: {err}\n")
        return EXIT_USAGE
    except BrokenPipeError:  # `graphsan ... | head`: the reader is gone, nothing to report
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

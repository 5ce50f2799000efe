"""`graphsan run`: a Python script or module run as `python` would run it (sys.argv, sys.path,
`__main__`, exit status, traceback, stop signals), with the sanitizer on and a report written at
the end, also when the program fails.

    graphsan run [--policy P] [--report out.json] script.py [args...]
    graphsan run [--policy P] [--report out.json] -m package.module [args...]
"""

from __future__ import annotations

import argparse
import os
import sys

from graphsan.cli.options import SOURCE_ROOT_HELP, load_suppressions, set_source_root
from graphsan.command_line import (
    EXIT_CANNOT_WRITE,
    CliError,
    DefaultsHelpFormatter,
    OneLineParser,
    check_report_file,
)
from graphsan.policies import Policy

EXIT_FINDINGS = 3


def report_path_for(path: str, rank: int | None) -> str:
    """`out.json` -> `out.rank{N}.json` under torchrun, so ranks never overwrite each other."""
    if rank is None:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


def make_parser() -> OneLineParser:
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
        "out.rank{N}.json); a relative path is taken from the folder graphsan starts in, "
        "whatever folder the program moves to; an existing file is replaced only when it is "
        "empty or a report",
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
    p.add_argument("--source-root", metavar="DIR", help=SOURCE_ROOT_HELP)
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


# frames in these files lead into the program (the entry point, this module): not its traceback
_OWN_FILES = {
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "main.py"),
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py"),
    os.path.abspath(__file__),
}


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


def _check_report_path(path: str, script: str | None) -> None:
    """--report: a file that can be written, and one whose loss costs nothing: not the script,
    not a file that holds something else (an empty file or an older report is replaced)."""
    from graphsan.report.output import target_of

    if script is not None and target_of(path) == target_of(script):
        raise CliError(
            f"--report {path}: that is the script being run; writing the report would replace "
            "it (expected another path)"
        )
    check_report_file(path, "--report")


def _write_report(san, path: str, target: str) -> bool:
    """Write the report to `target` (`path` resolved at start); the user reads `path`."""
    who = f"[rank {san.rank}] " if san.rank is not None else ""
    try:
        san.report().save(target)
    except OSError as err:
        sys.stderr.write(
            f"{who}graphsan run: error: could not write the report to {path} ({err.strerror}); "
            "here it is instead:\n"
        )
        sys.stderr.write(san.report().render() + "\n")
        return False
    sys.stderr.write(f"{who}graphsan: report written to {path}\n")
    return True


def main(argv: list[str]) -> int:
    p = make_parser()
    ours, target = _split_run_argv(p, argv)
    args = p.parse_args(ours)
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

    path = target_path = None
    if args.report is not None:
        from graphsan.report.output import output_path

        path = report_path_for(args.report, rank_from_env())
        _check_report_path(path, None if module is not None else target[0])
        target_path = output_path(path)  # here: the program may change directory
    entries = load_suppressions(args.suppressions)
    set_source_root(args.source_root)

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
    if path and not _write_report(san, path, target_path) and code == 0:
        code = EXIT_CANNOT_WRITE
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

"""pytest plugin: `pytest --graphsan[=policy]` runs a test suite with the sanitizer on.

With "raise" (the default) or "pin", a test during which a replay was stopped fails with the
report, even if the test swallowed the `StaleMemoryError`. With "warn" or "record" the findings
are attached to the test's report as a section and the test's outcome is left alone. The
terminal summary counts graphs and findings.

Under pytest-xdist each worker runs its own sanitizer and hands its report to the controller
(xdist's `workeroutput`) when it finishes; the controller combines them
(`graphsan.report.ranks.combine`) into the summary and into `--graphsan-report`.

The plugin loads with every pytest run of the environment, so it imports nothing heavy (torch,
the sanitizer) unless `--graphsan` is given.
"""

from __future__ import annotations

import copy
import json
import os

import pytest

from graphsan.policies import POLICIES, Policy

OPTION = "--graphsan"
# the options that only mean something with --graphsan: (dest, option)
NEEDS_GRAPHSAN = (
    ("graphsan_report", "--graphsan-report"),
    ("graphsan_suppressions", "--graphsan-suppressions"),
    ("graphsan_source_root", "--graphsan-source-root"),
)
WORKER_KEY = "graphsan_report"  # a worker's report in xdist's workeroutput (JSON text)
WORKER_ERROR_KEY = "graphsan_report_error"  # why a worker could not hand its report over


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphsan", "CUDA graph memory sanitizer")
    group.addoption(
        OPTION,
        nargs="?",
        const=Policy.RAISE.value,
        default=None,
        metavar="POLICY",
        help=f"watch every CUDA graph for stale memory; POLICY one of {', '.join(POLICIES)} "
        f"(default {Policy.RAISE}; write --graphsan=POLICY)",
    )
    group.addoption(
        "--graphsan-suppressions",
        metavar="FILE",
        default=None,
        help="with --graphsan: a YAML file of findings to suppress (counted in the summary)",
    )
    group.addoption(
        "--graphsan-report",
        metavar="PATH",
        default=None,
        help="with --graphsan: write the run's JSON report here (under pytest-xdist: every "
        "worker's, combined)",
    )
    group.addoption(
        "--graphsan-source-root",
        metavar="DIR",
        default=None,
        help="with --graphsan: the project root; frames in files under it are printed and "
        "matched by their path from it (default: per file, the nearest folder above it "
        "holding .git, pyproject.toml or setup.py)",
    )


def _is_test_path(arg: str) -> bool:
    """Whether a word after `--graphsan` names tests (a path or a node id), not a policy."""
    path = arg.split("::", 1)[0]
    return (
        "::" in arg or "/" in arg or os.sep in arg or path.endswith(".py") or os.path.exists(path)
    )


def rewrite_args(args: list[str]) -> bool:
    """`--graphsan tests/x.py` means the default policy and the path, not the policy
    'tests/x.py': argparse would hand the path to the option (its value is optional), so the
    option gets its default spelled out. Changes `args` in place; True when it did."""
    if OPTION not in args:
        return False
    changed = False
    for i, arg in enumerate(args[:-1]):
        nxt = args[i + 1]
        if arg != OPTION or nxt.startswith("-"):
            continue
        if nxt not in POLICIES and _is_test_path(nxt):
            args[i] = f"{OPTION}={Policy.RAISE}"
            changed = True
    return changed


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args: list[str]) -> None:
    if rewrite_args(args):
        # the early parse already ran on the old words: parse again, so the initial conftests
        # are looked up next to the tests
        known = early_config.known_args_namespace
        again = parser.parse_known_args(args, namespace=copy.copy(early_config.option))
        if again.confcutdir is None:
            again.confcutdir = known.confcutdir
        early_config.known_args_namespace = again


def _is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (the controller has no workerinput)."""
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    policy = config.getoption("graphsan", None)
    if policy is None:
        for dest, option in NEEDS_GRAPHSAN:
            if config.getoption(dest, None) is not None:
                raise pytest.UsageError(
                    f"{option} needs {OPTION}, which turns the sanitizer on; expected "
                    f"{OPTION}[=POLICY] as well"
                )
        return
    if policy not in POLICIES:
        # `--graphsan tests_typo_dir`: argparse gave the policy a test path that does not exist
        nothing = "" if os.path.exists(policy) else " (and no file or folder has that name)"
        raise pytest.UsageError(
            f"--graphsan: unknown policy {policy!r}{nothing}; expected one of "
            f"{', '.join(POLICIES)} (write --graphsan=POLICY)"
        )
    entries = []
    path = config.getoption("graphsan_suppressions", None)
    if path is not None:
        from graphsan.report import suppressions

        try:
            entries = suppressions.load(path)
        except ValueError as err:
            raise pytest.UsageError(f"--graphsan-suppressions {err}") from None
        except RecursionError:
            from graphsan.cli.options import deep_yaml

            raise pytest.UsageError(f"--graphsan-suppressions {deep_yaml(path)}") from None
    report = config.getoption("graphsan_report", None)
    if report is not None:
        from graphsan.command_line import CliError, check_report_file
        from graphsan.report.output import output_path

        try:
            check_report_file(report, "--graphsan-report")
        except CliError as err:
            raise pytest.UsageError(str(err)) from None
        # where it goes, resolved now in the folder pytest started in: a test may change folder
        config._graphsan_report_path = output_path(report)
    _set_source_root(config.getoption("graphsan_source_root", None))
    import graphsan

    # a session inside a process that already watches (pytest's own in-process runs) leaves
    # that watch on at its end; otherwise the session's end turns off what it turned on
    config._graphsan_owned = not graphsan._enabled
    config._graphsan = graphsan.enable(policy=policy)
    config._graphsan.suppressions = entries
    config._graphsan_workers = {}  # on xdist's controller: worker id -> its report's JSON text
    config._graphsan_lost = {}  # worker id -> why its report did not come


def _set_source_root(path: str | None) -> None:
    from graphsan.cli.options import set_source_root
    from graphsan.command_line import CliError

    try:
        set_source_root(path)
    except CliError as err:
        message = str(err).replace("--source-root", "--graphsan-source-root")
        raise pytest.UsageError(message) from None


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "_graphsan", None) is not None:
        from graphsan.core.locations import set_source_root

        set_source_root(None)  # the next in-process session finds its own roots
        if getattr(config, "_graphsan_owned", False):
            import graphsan

            graphsan.disable()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    san = getattr(item.config, "_graphsan", None)
    before = len(san.findings) if san is not None else 0
    outcome = yield
    if san is None or len(san.findings) == before:
        return
    from graphsan.report import format_finding

    new = san.findings[before:]
    text = "\n\n".join(format_finding(f) for f in new)
    item.add_report_section("call", "graphsan", text)
    if san.policy.stops_replay and outcome.excinfo is None:
        pytest.fail(f"graphsan: {len(new)} stale graph reference(s)\n\n{text}", pytrace=False)


@pytest.hookimpl(trylast=True)  # on xdist's controller: after the workers are all down
def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its report to the controller (xdist sends `workeroutput` after
    this hook); the controller, or a run without xdist, writes `--graphsan-report`."""
    config = session.config
    san = getattr(config, "_graphsan", None)
    if san is None:
        return
    if not _is_worker(config):
        _finish(session, san)
        return
    try:
        config.workeroutput[WORKER_KEY] = json.dumps(san.report().to_dict())
    except Exception as err:  # the worker's tests ran: never fail them over the report
        config.workeroutput[WORKER_ERROR_KEY] = f"{type(err).__name__}: {err}"


def _finish(session: pytest.Session, san) -> None:
    """The run's report, written to --graphsan-report (the summary, later, says what became
    of it). A report that cannot be written fails a run that passed: CI must not pass without
    it (exit 6, graphsan's status for an output it could not write)."""
    config = session.config
    said: list[str] = []
    report = _run_report(config, san, said.append)
    path = config.getoption("graphsan_report", None)
    if path is not None:  # idle too: the report says why
        try:
            report.save(getattr(config, "_graphsan_report_path", path))
            said.append(f"graphsan: report written to {path}")
        except OSError as err:  # the tests ran: say it, never end the session in a traceback
            said.append(
                f"graphsan: error: could not write the report to {path} ({err.strerror or err})"
            )
            if session.exitstatus == 0:
                from graphsan.command_line import EXIT_CANNOT_WRITE

                session.exitstatus = EXIT_CANNOT_WRITE
    config._graphsan_finished = (report, said)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """xdist's controller: a worker finished (or died); keep the report it handed over."""
    config = node.config
    if getattr(config, "_graphsan", None) is None:
        return
    worker = node.gateway.id
    output = getattr(node, "workeroutput", None) or {}
    if WORKER_KEY in output:
        config._graphsan_workers[worker] = output[WORKER_KEY]
    else:
        config._graphsan_lost[worker] = output.get(WORKER_ERROR_KEY) or (
            f"it ended before handing over its report ({error})" if error else "no report came"
        )


def _run_report(config: pytest.Config, san, say):
    """The run's report: the sanitizer's own, or under xdist every worker's combined."""
    handed = getattr(config, "_graphsan_workers", {})
    lost = getattr(config, "_graphsan_lost", {})
    for worker, why in sorted(lost.items()):
        say(f"graphsan: worker {worker}: {why}; its findings are not in the summary")
    if not handed and not lost:
        return san.report()
    from graphsan.report.ranks import combine, report_from_json

    reports = []
    for worker, text in sorted(handed.items()):
        try:
            reports.append(report_from_json(text, f"worker {worker}"))
        except ValueError as err:
            say(f"graphsan: {err}; its findings are not in the summary")
    return combine(reports) if reports else san.report()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    san = getattr(config, "_graphsan", None)
    if san is None or _is_worker(config):
        return
    say = terminalreporter.write_line
    finished = getattr(config, "_graphsan_finished", None)
    if finished is None:  # the session did not finish through pytest_sessionfinish
        finished = (_run_report(config, san, say), [])
    report, said = finished
    for line in said:
        say(line)
    if not san.active and san.disabled_reason and not (report.graphs or report.findings):
        say(f"graphsan: idle ({san.disabled_reason}), policy {san.policy}")
        return
    workers = len(getattr(config, "_graphsan_workers", {}))
    over = f"{workers} xdist worker(s), " if workers else ""
    nodes = sum(g.get("nodes", 0) for g in report.graphs)
    say(
        f"graphsan: {over}{len(report.graphs)} graph(s), {nodes} node(s) watched, "
        f"{len(report.findings)} finding(s), policy {san.policy}"
    )
    if report.suppressed:
        from graphsan.report.suppressions import summary

        say(f"graphsan: {summary(report.suppressed)}")

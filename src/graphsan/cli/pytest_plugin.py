"""pytest plugin: `pytest --graphsan[=policy]` runs a test suite with the sanitizer on.

With "raise" (the default) or "pin", a test during which a replay was stopped fails with the
report, even if the test swallowed the `StaleMemoryError`. With "warn" or "record" the findings
are attached to the test's report as a section and the test's outcome is left alone. The
terminal summary counts graphs and findings.

Under pytest-xdist each worker runs its own sanitizer and hands its report to the controller
(xdist's `workeroutput`) when it finishes; the controller combines them
(`graphsan.report.ranks.combine`) into the summary and into `--graphsan-report`.

This module loads with every pytest run of the environment (the `pytest11` entry point), so it
only adds the options, reads the command line and imports nothing heavy (torch, the sanitizer).
With `--graphsan`, `pytest_configure` builds a `GraphsanPlugin` (the session's sanitizer and what
its hooks keep between them), keeps it in `config.stash` and registers it; its hooks are its
methods, so a session without `--graphsan` runs none of them. `pytest_unconfigure` unregisters it.
"""

from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING

import pytest

from graphsan.policies import POLICIES, Policy

if TYPE_CHECKING:
    from graphsan import Sanitizer
    from graphsan.report import Report

OPTION = "--graphsan"
# the options that only mean something with --graphsan: (dest, option)
NEEDS_GRAPHSAN = (
    ("graphsan_report", "--graphsan-report"),
    ("graphsan_suppressions", "--graphsan-suppressions"),
    ("graphsan_source_root", "--graphsan-source-root"),
)
WORKER_KEY = "graphsan_report"  # a worker's report in xdist's workeroutput (JSON text)
WORKER_ERROR_KEY = "graphsan_report_error"  # why a worker could not hand its report over
PLUGIN_NAME = "graphsan-session"  # the session's GraphsanPlugin, in pytest's plugin manager


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


class GraphsanPlugin:
    """One pytest session's sanitizer and what its hooks keep between them. Registered by
    `pytest_configure` only with `--graphsan` and unregistered by `pytest_unconfigure`, so its
    hooks run in no other session."""

    def __init__(
        self,
        san: Sanitizer,
        *,
        report: str | None = None,
        report_path: str | None = None,
        owned: bool = False,
        worker: bool = False,
    ) -> None:
        self.san = san
        self.report_option = report  # --graphsan-report as given: what the summary names
        # where it goes, resolved in the folder pytest started in: a test may change folder
        self.report_path = report if report_path is None else report_path
        # whether this session turned the sanitizer on, so that its end turns it off
        self.owned = owned
        self.worker = worker  # a pytest-xdist worker: it hands its report to the controller
        self.handed: dict[str, str] = {}  # on xdist's controller: worker id -> its report (JSON)
        self.lost: dict[str, str] = {}  # worker id -> why its report did not come
        self.finished: tuple[Report, list[str]] | None = None  # the report, what to say of it

    def close(self) -> None:
        """The session's end: the next in-process session finds its own source roots, and the
        sanitizer is off again if this session turned it on."""
        from graphsan.core.locations import set_source_root

        set_source_root(None)
        if self.owned:
            import graphsan

            graphsan.disable()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        san = self.san
        before = len(san.findings)
        outcome = yield
        if len(san.findings) == before:
            return
        from graphsan.report import format_finding

        new = san.findings[before:]
        text = "\n\n".join(format_finding(f) for f in new)
        item.add_report_section("call", "graphsan", text)
        if san.policy.stops_replay and outcome.excinfo is None:
            pytest.fail(f"graphsan: {len(new)} finding(s)\n\n{text}", pytrace=False)

    @pytest.hookimpl(trylast=True)  # on xdist's controller: after the workers are all down
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """An xdist worker hands its report to the controller (xdist sends `workeroutput` after
        this hook); the controller, or a run without xdist, writes `--graphsan-report`."""
        if not self.worker:
            self._finish(session)
            return
        output = session.config.workeroutput
        try:
            output[WORKER_KEY] = json.dumps(self.san.report().to_dict())
        except Exception as err:  # the worker's tests ran: never fail them over the report
            output[WORKER_ERROR_KEY] = f"{type(err).__name__}: {err}"

    def _finish(self, session: pytest.Session) -> None:
        """The run's report, written to --graphsan-report (the summary, later, says what became
        of it). A report that cannot be written fails a run that passed: CI must not pass
        without it (exit 6, graphsan's status for an output it could not write)."""
        said: list[str] = []
        report = self._run_report(said.append)
        path = self.report_option
        if path is not None:  # idle too: the report says why
            try:
                report.save(self.report_path)
                said.append(f"graphsan: report written to {path}")
            except OSError as err:  # the tests ran: say it, never end the session in a traceback
                said.append(
                    f"graphsan: error: could not write the report to {path} ({err.strerror or err})"
                )
                if session.exitstatus == 0:
                    from graphsan.command_line import EXIT_CANNOT_WRITE

                    session.exitstatus = EXIT_CANNOT_WRITE
        self.finished = (report, said)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """xdist's controller: a worker finished (or died); keep the report it handed over."""
        worker = node.gateway.id
        output = getattr(node, "workeroutput", None) or {}
        if WORKER_KEY in output:
            self.handed[worker] = output[WORKER_KEY]
        else:
            self.lost[worker] = output.get(WORKER_ERROR_KEY) or (
                f"it ended before handing over its report ({error})" if error else "no report came"
            )

    def _run_report(self, say) -> Report:
        """The run's report: the sanitizer's own, or under xdist every worker's combined."""
        for worker, why in sorted(self.lost.items()):
            say(f"graphsan: worker {worker}: {why}; its findings are not in the summary")
        if not self.handed and not self.lost:
            return self.san.report()
        from graphsan.report.ranks import combine, report_from_json

        reports = []
        for worker, text in sorted(self.handed.items()):
            try:
                reports.append(report_from_json(text, f"worker {worker}"))
            except ValueError as err:
                say(f"graphsan: {err}; its findings are not in the summary")
        return combine(reports) if reports else self.san.report()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.worker:
            return
        san = self.san
        say = terminalreporter.write_line
        finished = self.finished
        if finished is None:  # the session did not finish through pytest_sessionfinish
            finished = (self._run_report(say), [])
        report, said = finished
        for line in said:
            say(line)
        if not san.active and san.disabled_reason and not (report.graphs or report.findings):
            say(f"graphsan: idle ({san.disabled_reason}), policy {san.policy}")
            return
        workers = len(self.handed)
        over = f"{workers} xdist worker(s), " if workers else ""
        nodes = sum(g.get("nodes", 0) for g in report.graphs)
        say(
            f"graphsan: {over}{len(report.graphs)} graph(s), {nodes} node(s) watched, "
            f"{len(report.findings)} finding(s), policy {san.policy}"
        )
        if report.suppressed:
            from graphsan.report.suppressions import summary

            say(f"graphsan: {summary(report.suppressed)}")


PLUGIN_KEY = pytest.StashKey[GraphsanPlugin]()


def plugin_of(config: pytest.Config) -> GraphsanPlugin | None:
    """The session's plugin, or None where it runs without `--graphsan` (or has ended)."""
    return config.stash.get(PLUGIN_KEY, None)


def pytest_configure(config: pytest.Config) -> None:
    plugin = _plugin_for(config)
    if plugin is not None:
        config.stash[PLUGIN_KEY] = plugin
        config.pluginmanager.register(plugin, PLUGIN_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    plugin = plugin_of(config)
    if plugin is None:
        return
    del config.stash[PLUGIN_KEY]
    if config.pluginmanager.is_registered(plugin):  # not where `-p no:graphsan-session` kept it out
        config.pluginmanager.unregister(plugin)
    plugin.close()


def _plugin_for(config: pytest.Config) -> GraphsanPlugin | None:
    """The session's plugin, its sanitizer on, where `--graphsan` is given; None without it.
    Options that make no sense together are one `UsageError` each, before anything starts."""
    policy = config.getoption("graphsan", None)
    if policy is None:
        for dest, option in NEEDS_GRAPHSAN:
            if config.getoption(dest, None) is not None:
                raise pytest.UsageError(
                    f"{option} needs {OPTION}, which turns the sanitizer on; expected "
                    f"{OPTION}[=POLICY] as well"
                )
        return None
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
    report_path = None
    if report is not None:
        from graphsan.command_line import CliError, check_report_file
        from graphsan.report.output import output_path

        try:
            check_report_file(report, "--graphsan-report")
        except CliError as err:
            raise pytest.UsageError(str(err)) from None
        # where it goes, resolved now in the folder pytest started in: a test may change folder
        report_path = output_path(report)
    _set_source_root(config.getoption("graphsan_source_root", None))
    import graphsan

    # a session inside a process that already watches (pytest's own in-process runs) leaves
    # that watch on at its end; otherwise the session's end turns off what it turned on
    owned = not graphsan._enabled
    san = graphsan.enable(policy=policy)
    san.suppressions = entries
    return GraphsanPlugin(
        san,
        report=report,
        report_path=report_path,
        owned=owned,
        worker=hasattr(config, "workerinput"),  # xdist's controller has no workerinput
    )


def _set_source_root(path: str | None) -> None:
    from graphsan.cli.options import set_source_root
    from graphsan.command_line import CliError

    try:
        set_source_root(path)
    except CliError as err:
        message = str(err).replace("--source-root", "--graphsan-source-root")
        raise pytest.UsageError(message) from None

"""pytest plugin: `pytest --graphsan[=policy]` runs a test suite with the sanitizer on.

With "raise" (the default) or "pin", a test during which a replay was stopped fails with the
report, even if the test swallowed the `StaleMemoryError`. With "warn" or "record" the findings
are attached to the test's report as a section and the test's outcome is left alone. The
terminal summary counts graphs and findings.

The plugin loads with every pytest run of the environment, so it imports nothing heavy (torch,
the sanitizer) unless `--graphsan` is given.
"""

from __future__ import annotations

import copy
import os

import pytest

from graphsan.policies import POLICIES, Policy

OPTION = "--graphsan"


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
        help="with --graphsan: write the run's JSON report here",
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


def pytest_configure(config: pytest.Config) -> None:
    policy = config.getoption("graphsan", None)
    if policy is None:
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
    report = config.getoption("graphsan_report", None)
    if report is not None:
        from graphsan.command_line import CliError, check_output_file

        try:
            check_output_file(report, "--graphsan-report")
        except CliError as err:
            raise pytest.UsageError(str(err)) from None
    import graphsan

    config._graphsan = graphsan.enable(policy=policy)
    config._graphsan.suppressions = entries


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


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    san = getattr(config, "_graphsan", None)
    if san is None:
        return
    path = config.getoption("graphsan_report", None)
    if path is not None:  # idle too: the report says why
        san.report().save(path)
        terminalreporter.write_line(f"graphsan: report written to {path}")
    if not san.active and san.disabled_reason:
        terminalreporter.write_line(f"graphsan: idle ({san.disabled_reason}), policy {san.policy}")
        return
    nodes = sum(g.walk.nodes for g in san.graph_stats.values())
    terminalreporter.write_line(
        f"graphsan: {len(san.graph_stats)} graph(s), {nodes} node(s) watched, "
        f"{len(san.findings)} finding(s), policy {san.policy}"
    )
    suppressed = getattr(san, "suppressed", [])
    if suppressed:
        from graphsan.report.suppressions import summary

        terminalreporter.write_line(f"graphsan: {summary(suppressed)}")

"""pytest plugin: `pytest --graphsan[=policy]` runs a test suite with the sanitizer on.

With "raise" (the default) or "pin", a test during which a replay was stopped fails with the
report, even if the test swallowed the `StaleMemoryError`. With "warn" or "record" the findings
are attached to the test's report as a section and the test's outcome is left alone. The
terminal summary counts graphs and findings.
"""

from __future__ import annotations

import pytest

POLICIES = ("raise", "warn", "record", "pin")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphsan", "CUDA graph memory sanitizer")
    group.addoption(
        "--graphsan",
        nargs="?",
        const="raise",
        default=None,
        metavar="POLICY",
        help=f"watch every CUDA graph for stale memory; POLICY one of {', '.join(POLICIES)} "
        "(default raise)",
    )


def pytest_configure(config: pytest.Config) -> None:
    policy = config.getoption("graphsan", None)
    if policy is None:
        return
    if policy not in POLICIES:
        raise pytest.UsageError(
            f"--graphsan: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}"
        )
    import graphsan

    config._graphsan = graphsan.enable(policy=policy)


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
    if san.policy in ("raise", "pin") and outcome.excinfo is None:
        pytest.fail(f"graphsan: {len(new)} stale graph reference(s)\n\n{text}", pytrace=False)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    san = getattr(config, "_graphsan", None)
    if san is None:
        return
    if not san.active and san.disabled_reason:
        terminalreporter.write_line(f"graphsan: idle ({san.disabled_reason})")
        return
    nodes = sum(g.get("nodes", 0) for g in san.graph_stats.values())
    terminalreporter.write_line(
        f"graphsan: {len(san.graph_stats)} graph(s), {nodes} node(s) watched, "
        f"{len(san.findings)} finding(s), policy {san.policy}"
    )

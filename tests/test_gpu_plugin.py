"""GPU: `pytest --graphsan` over a small suite that captures real graphs (run through pytester in
a subprocess of its own): the summary line, each test's graphsan section, and a stale replay
failing its test under the default policy even when the test swallows the error."""

from __future__ import annotations

import importlib.metadata

import pytest

pytestmark = pytest.mark.gpu
pytest_plugins = ["pytester"]

SUITE = """
import pytest
import torch

import graphsan


def _graph(x):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x * 2
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = x * 2
    return g, y


def test_correct():
    x = torch.randn(1 << 16, device="cuda")
    g, y = _graph(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


def test_stale_swallowed():
    x = torch.randn(1 << 16, device="cuda")
    g, y = _graph(x)
    del x
    keep = [torch.ones(1 << 16, device="cuda") for _ in range(4)]
    try:
        g.replay()
        torch.cuda.synchronize()
    except graphsan.StaleMemoryError:
        pass  # the test swallows it: the plugin still fails it under raise


def test_no_graph():
    assert torch.ones(3, device="cuda").sum().item() == 3
"""


def _plugin_args() -> list[str]:
    """`-p graphsan.cli.pytest_plugin` where graphsan is not installed (PYTHONPATH only), so its
    entry point is not registered; nothing where it is (the plugin would load twice)."""
    eps = importlib.metadata.entry_points(group="pytest11")
    return [] if any(ep.name == "graphsan" for ep in eps) else ["-p", "graphsan.cli.pytest_plugin"]


def test_plugin_over_a_suite_with_graphs_under_raise(pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(*_plugin_args(), "--graphsan", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_stale_swallowed*",
            "*graphsan: 1 finding(s)*",
            "graphsan: 2 graph(s), * node(s) watched, 1 finding(s), policy raise",
        ]
    )
    assert "AttributeError" not in result.stdout.str() + result.stderr.str()


def test_plugin_over_a_suite_with_graphs_under_record(pytester):
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(
        *_plugin_args(), "--graphsan=record", "-rA", "-p", "no:cacheprovider"
    )
    # record leaves outcomes alone (the stale replay ran: the test passed) and adds a section
    result.assert_outcomes(passed=3)
    out = result.stdout.str()
    assert "Captured graphsan call" in out and "test_stale_swallowed" in out
    result.stdout.fnmatch_lines(
        ["graphsan: 2 graph(s), * node(s) watched, 1 finding(s), policy record"]
    )

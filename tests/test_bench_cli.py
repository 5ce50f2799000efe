"""The CPU side of the cost benches: bad arguments are one line, the dispatch model and the
compiled trace run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_an_unknown_variant_is_named_with_the_known_ones():
    proc = bench("bench_sanitizer.py", "--variants", "record,recrod")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "--variants: unknown recrod" in last and "record-notrace" in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_the_sanitizer_bench_says_it_needs_a_gpu():
    proc = bench("bench_sanitizer.py", "--optimizer", "fused", "--variants", "trace")
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "bench_sanitizer: needs a CUDA GPU (torch.cuda.is_available() is False)"
    )


@pytest.mark.slow
def test_the_dispatch_model_prints_its_rows_and_a_step_estimate():
    proc = bench("bench_trace_dispatch.py", "--batch", "500", "--rounds", "2", "--allocs", "10")
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and "us" not in ln]
    names = [r.split("|")[1].strip() for r in rows]
    assert names[:3] == [
        "dispatch, no callback",
        "dispatch + graphsan free callback",
        "dispatch + graphsan allocation callback, then its free",
    ]
    assert all(float(r.split("|")[2]) > 0 for r in rows)
    assert "a step with 10 eager allocations and their frees" in proc.stdout
    if "the compiled trace is not measured" not in proc.stdout:
        assert names[3:] == [
            "compiled trace: a temporary, site read in C++",
            "compiled trace: a temporary, no sites",
        ]
        assert "the same step through graphsan's compiled trace" in proc.stdout


def test_the_dispatch_model_refuses_a_bad_count():
    proc = bench("bench_trace_dispatch.py", "--batch", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--batch must be positive, got 0")


def test_the_capture_scale_bench_checks_its_repeats_and_says_it_needs_a_gpu():
    proc = bench("bench_capture_scale.py", "--repeats", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--repeats: expected at least 1, got 0")
    if not torch.cuda.is_available():
        proc = bench("bench_capture_scale.py", "--blocks", "10")
        assert proc.returncode == 1
        assert proc.stderr.strip() == (
            "bench_capture_scale: needs a CUDA GPU (torch.cuda.is_available() is False)"
        )


def test_the_capture_scale_bench_takes_the_median_of_its_processes(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_capture_scale as bcs
    finally:
        sys.path.pop(0)
    calls = []

    def fake_run(variant, blocks, graphs, nodes):
        calls.append(variant)
        k = len(calls)
        return {"median_ms": float(k), "stages_ms": {"walk": 10.0 * k}, "findings": 0,
                "disabled": None, "allocator_log": "tracker"}  # fmt: skip

    monkeypatch.setattr(bcs, "run", fake_run)
    rows = bcs.repeated([("a", ("off", 1, 1, 3)), ("b", ("record", 1, 1, 3))], 3)
    assert calls == ["off", "record"] * 3  # interleaved
    assert rows[0] == ("a", {"median_ms": 3.0, "stages_ms": {"walk": 30.0}, "findings": 0,
                             "disabled": None, "allocator_log": "tracker"})  # fmt: skip
    assert rows[1][1]["median_ms"] == 4.0

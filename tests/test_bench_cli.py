"""The CPU side of the cost benches: bad arguments are one line; the dispatch model, the
compiled trace, the allocation callbacks and the analysis stages run against the code as it is
now (they reach into the hot paths, so a change there that a bench does not follow shows here,
not on the next person to measure)."""

from __future__ import annotations

import math
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


ALLOC_CASES = (
    "forward, depth+4 frames",
    "optimizer foreach",
    "worker thread (shallow)",
    "forward, freed segments",
    "forward, alloc_stacks=False",
    "watched frees (their stack taken)",
)

ALLOC_WALKS = (
    "keyed loop, method lookups hoisted",
    "plain loop, interned later",
    "unrolled, interned at once",
    "unrolled, interned later (now)",
    "sys._getframe probe + unrolled",
    "outer part cached by frame id (unsound)",
    "unrolled, 12 frames (less information)",
    "every 16th allocation (less information)",
)


def _rows(out: str) -> dict[str, list[str]]:
    """A markdown table's rows by their first cell."""
    cells = [ln.strip("| ").split(" | ") for ln in out.splitlines() if ln.startswith("| ")]
    return {row[0]: row[1:] for row in cells}


def test_the_allocation_callbacks_bench_runs_every_case_and_walk_against_a_copy():
    """Compared with a copy of today's allocator module (a file, as in a tree without git
    history): the same sites, a row per case with both variants and their ratios, then the
    other walks."""
    copy = os.path.join(ROOT, "src", "graphsan", "cuda", "allocator.py")
    small = ("--rounds", "2", "--batch", "8", "--depth", "4")
    proc = bench("bench_alloc_callbacks.py", *small, "--against", copy, "--ideas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"sites the same as {copy}'s: yes" in proc.stdout
    rows = _rows(proc.stdout)
    for case in ALLOC_CASES:  # two variants' allocation and free, then the two ratios
        row = rows[case]
        assert len(row) == 6 and all(math.isfinite(float(c)) for c in row[:4]), row
        for column, ratio in enumerate(row[4:]):  # allocation, then free: now / before
            before, now = float(row[column]), float(row[2 + column])
            if ratio == "-":  # a cost not above the harness's has no ratio
                assert min(before, now) <= 0, row
            else:
                assert math.isfinite(float(ratio)) and float(ratio) > 0, row
            if min(before, now) > 0:
                assert ratio != "-", row
    for walk in (f"{copy}'s walk, interned at once", *ALLOC_WALKS):  # --ideas: us per allocation
        assert len(rows[walk]) == 1 and math.isfinite(float(rows[walk][0])), (walk, rows.get(walk))
    assert "of 200 allocations from two callers got the wrong site" in proc.stdout


def test_the_allocation_callbacks_bench_names_a_revision_it_cannot_read_in_one_line():
    proc = bench("bench_alloc_callbacks.py", "--against", "no-such-revision")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("--against no-such-revision: cannot read its allocator.py from git")


@pytest.mark.slow
def test_the_analysis_bench_times_every_stage_beside_a_revision():
    proc = bench(
        "bench_analysis.py", "--blocks", "500", "--graphs", "3", "--nodes", "5", "--repeat", "1",
        "--against", "HEAD",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [
        ln.strip("| ").split(" | ") for ln in proc.stdout.splitlines() if ln.startswith("| 500")
    ]
    assert len(rows) == 2, proc.stdout  # the revision's row, then the working tree's
    for row in rows:  # seed ms, four stages, total: "us per node (us per graph)", empty drain
        assert len(row) == 9 and all(float(c.split()[0]) >= 0 for c in row[2:]), row
    assert "per graph: " in proc.stdout

"""bench/bench_alloc_callbacks.py runs against the allocator watch as it is now: it reaches into
the watch's hot path (the callbacks, the sites it records), so a change there that the bench
does not follow shows here rather than on the next person to measure it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_alloc_callbacks.py"
CASES = (
    "forward, depth+4 frames",
    "optimizer foreach",
    "worker thread (shallow)",
    "forward, freed segments",
    "forward, alloc_stacks=False",
    "watched frees (their stack taken)",
)


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, str(BENCH), "--rounds", "2", "--batch", "8", "--depth", "4", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_every_case_and_walk_against_a_copy_of_the_allocator_module():
    """Compared with a copy of today's module (a file, as in a tree without git history): the
    same sites, a row per case with both variants and their ratios, then the other walks."""
    copy = ROOT / "src" / "graphsan" / "cuda" / "allocator.py"
    proc = _bench("--against", str(copy), "--ideas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"sites the same as {copy}'s: yes" in out
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.splitlines()}
    for case in CASES:
        cells = rows[case].strip("| ").split(" | ")
        assert len(cells) == 7, rows[case]  # the case, two variants' alloc and free, two ratios
        assert all(float(c) == float(c) for c in cells[1:])
    assert "| unrolled, interned later (now) |" in out
    assert f"| {copy}'s walk, interned at once |" in out
    assert "of 200 allocations from two callers got the wrong site" in out


def test_a_revision_that_cannot_be_compared_is_one_line():
    proc = _bench("--against", "no-such-revision")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("--against no-such-revision: cannot read its allocator.py from git")

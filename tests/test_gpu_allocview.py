"""The incremental allocator view equals real allocator snapshots (H200), with and without
expandable segments, fed by the compiled trace tracker (built here on first use) and by the
memory-history fallback; the program runs in a subprocess (tests/gpu/view_vs_snapshot.py)."""

from __future__ import annotations

import pytest

from tests.gpu_programs import run_script

pytestmark = pytest.mark.gpu


# (seed, expandable segments, event source, blocks per chunk: None for the default)
RUNS = [(seed, expandable, "tracker", None) for seed in (0, 1) for expandable in (False, True)]
RUNS += [(0, expandable, "snapshot", None) for expandable in (False, True)]
RUNS += [(1, expandable, "snapshot", 3) for expandable in (False, True)]


@pytest.mark.parametrize(
    ("seed", "expandable", "log", "chunk"),
    RUNS,
    ids=[
        f"{log}-{'expandable' if e else 'segments'}-{s}" + (f"-chunks{c}" if c else "")
        for s, e, log, c in RUNS
    ],
)
def test_the_view_follows_the_real_allocator(seed, expandable, log, chunk):
    env = {"GRAPHSAN_TRACELOG": "1" if log == "tracker" else "0"}
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    argv = [str(seed)] + ([str(chunk)] if chunk else [])
    res = run_script("view_vs_snapshot.py", *argv, env=env)
    assert res["disabled"] is None, res
    if log == "tracker":
        # built, loaded and attached; memory history (a cost on every allocation) stays off
        assert res["log"] == "tracker" and res["history"] is not True, res
    else:
        assert res["log"] == "snapshot (GRAPHSAN_TRACELOG=0)" and res["history"] is not False, res
    assert res["checks"] == 40 and res["mismatches"] == 0, res
    assert res["events"] > 100, res  # the view followed the log, it was not reseeded each time
    # once; the snapshot log's view once more after the startup probe's own captures
    assert res["seeds"] == (1 if log == "tracker" else 2), res

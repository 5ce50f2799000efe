"""graphsan leaves no trace in the allocator: its start-up probe's pool is given back before the
program's first capture, so the program's snapshot holds the pools it made and no other, and
memory_reserved() matches a run without graphsan within one segment."""

from __future__ import annotations

import pytest

from tests.gpu_programs import prefetch, run_program

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _both_runs_side_by_side():
    prefetch([("probe_memory", "off", None), ("probe_memory", "record", None)])


def test_the_snapshot_holds_the_programs_pools_and_nothing_of_graphsans():
    rc, off, log_off = run_program("probe_memory", policy="off")
    assert rc == 0, log_off[-3000:]
    rc, on, log = run_program("probe_memory", policy="record")
    assert rc == 0, log[-3000:]
    assert on["probe_memory"] == "released", on["probe_memory"]
    for run in (off, on):
        graph_pool = run["graph_pool"]
        assert set(run["segments_by_pool"]) == {"(0, 0)", graph_pool}, run["segments_by_pool"]
        assert run["segments_by_pool"][graph_pool] == 2, "one segment per capturing stream"
    assert on["segments_by_pool"]["(0, 0)"] == off["segments_by_pool"]["(0, 0)"]
    assert abs(on["reserved"] - off["reserved"]) <= on["largest_segment"]

"""Which pool the allocator view gives a segment made while a capture ends (CPU, faked log).

A captured backward allocates on the autograd engine's worker thread, whose log entries do not
carry the capture's tag (the allocator's user metadata); seen on the H200 with
`make_graphed_callables`, where the view put the graph pool's segments in the default pool and
every training step raised a false finding."""

from __future__ import annotations

import pytest
import torch

from graphsan.core.allocview import AllocatorView
from graphsan.core.records import DEFAULT_POOL
from graphsan.core.tracker import Tracker
from graphsan.cuda import allocator, allocator_log
from graphsan.cuda.context import Context

STREAM, OTHER, POOL = 0x5000, 0x6000, (0, 7)
WARM, SEG, FORK = 0x7F00_0000_0000, 0x7F00_1000_0000, 0x7F00_2000_0000
MB2 = 2 << 20


def _seg(address: int, pool, blocks=()) -> dict:
    return {
        "address": address,
        "total_size": MB2,
        "segment_pool_id": pool,
        "blocks": [{"address": a, "size": s, "state": "active_allocated"} for a, s in blocks],
    }


def _entry(action: str, addr: int, size: int, stream: int, tag: str = "") -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "user_metadata": tag}


@pytest.fixture
def watch(monkeypatch):
    """An AllocatorWatch over a faked allocator: `log` is what the next drain reads, `pools`
    what a pool-filtered snapshot answers."""
    fake = {"log": [], "pools": {}}

    def snapshot(pool=(0, 0), traces=False):
        if traces:
            entries, fake["log"] = fake["log"], []
            return {"segments": [], "device_traces": [entries]}
        return {"segments": fake["pools"].get(tuple(pool), [])}

    monkeypatch.setattr(allocator_log, "_snapshot", snapshot)
    monkeypatch.setattr(allocator_log, "_empty_pool_id", lambda: (0, 99))
    monkeypatch.setattr(
        allocator_log.AllocatorLog, "record_history", lambda self, clear=False: None
    )
    monkeypatch.setattr(allocator_log, "_metadata", lambda: "")
    monkeypatch.setattr(allocator_log, "_set_metadata", lambda text: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = allocator.AllocatorWatch(Tracker(), Context(), on_error=lambda err: None)
    w.ledger.views[0] = AllocatorView()
    w.ledger.views[0].seed({"segments": []}, 0)
    return w, fake


@pytest.mark.parametrize("tagged", [True, False], ids=["tagged", "worker-thread"])
def test_a_capture_segment_belongs_to_the_graph_pool_tagged_or_not(watch, tagged):
    w, fake = watch
    tag = w.capture_started(1, STREAM, None)
    capture_tag = tag if tagged else ""
    fake["log"] = [
        # warm-up before the capture, on the same stream: the default pool's
        _entry("segment_alloc", WARM, MB2, STREAM),
        _entry("alloc", WARM, 4096, STREAM),
        # the capture's own (a captured backward: untagged when made by the worker thread)
        _entry("segment_alloc", SEG, MB2, STREAM, capture_tag),
        _entry("alloc", SEG, 8192, STREAM, capture_tag),
        # a stream the capture forked to
        _entry("segment_alloc", FORK, MB2, OTHER, capture_tag),
        _entry("alloc", FORK, 512, OTHER, capture_tag),
    ]
    fake["pools"][POOL] = [_seg(SEG, POOL, [(SEG, 8192)]), _seg(FORK, POOL, [(FORK, 512)])]
    carves = w.capture_ended(tag, POOL)
    view = w.ledger.views[0]
    assert tuple(view.segment_at(WARM).pool) == DEFAULT_POOL
    assert tuple(view.segment_at(SEG).pool) == POOL
    assert tuple(view.segment_at(FORK).pool) == POOL
    assert sorted(a for a, _, _ in carves) == [SEG, FORK]  # what the graph's replays write


def test_an_untagged_segment_absent_from_the_pool_stays_in_the_default_pool(watch):
    w, fake = watch
    tag = w.capture_started(1, STREAM, None)
    fake["log"] = [_entry("segment_alloc", WARM, MB2, OTHER), _entry("alloc", WARM, 512, OTHER)]
    fake["pools"][POOL] = []
    assert w.capture_ended(tag, POOL) == []
    assert tuple(w.ledger.views[0].segment_at(WARM).pool) == DEFAULT_POOL


def test_without_a_capture_an_untagged_segment_is_the_default_pools(watch):
    w, fake = watch
    fake["log"] = [_entry("segment_alloc", SEG, MB2, STREAM), _entry("alloc", SEG, 512, STREAM)]
    fake["pools"][POOL] = [_seg(SEG, POOL)]  # never asked: no capture is ending
    w.sync()
    assert tuple(w.ledger.views[0].segment_at(SEG).pool) == DEFAULT_POOL


def test_untagged_mapped_pages_of_the_pool_reseed_the_view(watch, monkeypatch):
    """Expandable segments: pages mapped by the worker thread were joined to a default-pool run
    before their pool was known; only a snapshot gives the runs."""
    w, fake = watch
    seeded = []
    real = allocator_log._snapshot

    def snapshot(pool=(0, 0), traces=False):
        if not traces and tuple(pool) == (0, 0):
            seeded.append(True)
            return {"segments": [_seg(WARM, DEFAULT_POOL), _seg(WARM + MB2, POOL)]}
        return real(pool, traces)

    monkeypatch.setattr(allocator_log, "_snapshot", snapshot)
    tag = w.capture_started(1, STREAM, None)
    fake["log"] = [
        _entry("segment_map", WARM, MB2, STREAM),
        _entry("segment_map", WARM + MB2, MB2, STREAM),  # the capture's, untagged
        _entry("alloc", WARM + MB2, 4096, STREAM),
    ]
    fake["pools"][POOL] = [_seg(WARM + MB2, POOL, [(WARM + MB2, 4096)])]
    w.capture_ended(tag, POOL)
    assert seeded
    assert tuple(w.ledger.views[0].segment_at(WARM + MB2).pool) == POOL


def test_the_first_capture_keeps_its_carves_before_any_view_exists(watch):
    """The snapshot path: no view yet when the first capture ends; the drain makes one."""
    w, fake = watch
    w.ledger.views.clear()
    tag = w.capture_started(1, STREAM, None)
    fake["log"] = [
        _entry("segment_alloc", SEG, MB2, STREAM, tag),
        _entry("alloc", SEG, 8192, STREAM, tag),
    ]
    fake["pools"][POOL] = [_seg(SEG, POOL, [(SEG, 8192)])]
    fake["pools"][(0, 0)] = fake["pools"][POOL]  # the full snapshot that seeds the view
    assert [a for a, _, _ in w.capture_ended(tag, POOL)] == [SEG]
    assert tuple(w.ledger.views[0].segment_at(SEG).pool) == POOL

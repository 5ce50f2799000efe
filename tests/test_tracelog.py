"""The allocator tracker's records (graphsan.cuda.tracelog) without a GPU: converted to trace
entries, they keep the allocator view equal to the model allocator's snapshot at every step
(tests/test_allocview.py's model), with the pools the records name and the user metadata
(capture tags) they carry; the watch's sync drains them, reseeds on an overflow and keeps a
capture's tagged allocations, and the untagged ones of a captured backward.

The compiled library itself: tests/test_tracelog_compiled.py; its build and the fallback:
tests/test_tracelog_build.py.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from graphsan.core.allocview import AllocatorView
from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import DEFAULT_POOL
from graphsan.core.tracker import Tracker
from graphsan.cuda import allocator_log, tracelib
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.context import Context
from tests.test_allocview import STREAM_POOL, ModelAllocator, random_event, same_answers


def _raise(err):
    raise err


def new_watch() -> AllocatorWatch:
    return AllocatorWatch(Tracker(), Context(), _raise)


def pool_of_entry(e: dict) -> tuple[int, int]:
    return STREAM_POOL.get(e["stream"], DEFAULT_POOL)


def pack(log: list[dict]) -> tuple[bytes, list[str]]:
    """The model's log as tracelog.cpp would record it: the kept actions only, tags interned."""
    raw, tags = [], []
    for e in log:
        if e["action"] not in tracelib.ACTIONS:
            continue
        meta = e.get("user_metadata", "")
        if meta and meta not in tags:
            tags.append(meta)
        pool = pool_of_entry(e)
        raw.append(
            tracelib.RECORD.pack(
                e["addr"],
                e["size"],
                e["stream"],
                1_700_000_000_000_000,
                pool[0],
                pool[1],
                tracelib.ACTIONS.index(e["action"]),
                0,
                tags.index(meta) if meta else -1,
                0,
            )
        )
    return b"".join(raw), tags


def converted(log: list[dict]) -> list[dict]:
    raw, tags = pack(log)
    return tracelib.entries_from_records(raw, tags).get(0, [])


def drive(seed: int, expandable: bool, to_entries) -> None:
    """A random run of the model allocator; the view follows `to_entries(log)` and must equal
    the snapshot after every drain. Stretches of the run are tagged like captures."""
    rng = random.Random(seed * 7919 + expandable)
    model = ModelAllocator(rng, expandable)
    live: list[tuple[int, int]] = []
    for _ in range(rng.randrange(0, 12)):
        stream = rng.choice(list(STREAM_POOL))
        live.append((model.malloc(rng.choice([100, 4096, 70_000, 3 << 20]), stream), stream))
    view = AllocatorView()
    view.seed(model.snapshot())
    model.log.clear()
    watch = new_watch()
    tag = ""
    for i in range(300):
        if rng.random() < 0.05:
            tag = "" if tag else f"graphsan capture {i}"
        before = len(model.log)
        random_event(model, live, rng)
        for e in model.log[before:]:
            e["user_metadata"] = tag
        if rng.random() < 0.3:
            entries = to_entries(model.log)
            kept = [e for e in model.log if e["action"] in tracelib.ACTIONS]
            assert [
                (e["action"], e["addr"], e["size"], e["stream"], e["user_metadata"]) for e in kept
            ] == [
                (e["action"], e["addr"], e["size"], e["stream"], e["user_metadata"])
                for e in entries
            ]
            model.log.clear()
            unsure: list = []
            # the watch's own pool lookup: with no capture or route known, only the records'
            # pools put the segments of streams 22 and 33 where the snapshot has them
            view.apply(entries, functools.partial(watch.ledger._pool_of, unsure=unsure))
            assert unsure == []
            same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("seed", range(4))
def test_converted_records_keep_the_view_equal_to_a_snapshot(seed, expandable):
    drive(seed, expandable, converted)


def test_records_become_snapshot_shaped_entries_per_device():
    tags = ["graphsan capture 3"]
    raw = tracelib.RECORD.pack(0x7000, 4096, 11, 5, 0, 0, 0, 1, 0, 0)
    raw += tracelib.RECORD.pack(0x8000, 2 << 20, 22, 6, 1, 0, 2, 0, -1, 0)
    out = tracelib.entries_from_records(raw, tags)
    assert out == {
        1: [
            {
                "action": "alloc",
                "addr": 0x7000,
                "size": 4096,
                "stream": 11,
                "time_us": 5,
                "user_metadata": "graphsan capture 3",
                "pool": (0, 0),
            }
        ],
        0: [
            {
                "action": "segment_alloc",
                "addr": 0x8000,
                "size": 2 << 20,
                "stream": 22,
                "time_us": 6,
                "user_metadata": "",
                "pool": (1, 0),
            }
        ],
    }


# -- the watch's drain --------------------------------------------------------------------------
class FakeLog:
    """What AllocatorWatch.sync needs of a TraceLog: drains of the model's log, in order."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[dict], bool]] = []

    def drain_raw(self):
        log, overflow = self.batches.pop(0) if self.batches else ([], False)
        return (*pack(log), overflow)


def test_sync_drains_the_tracker_reseeds_on_overflow_and_keeps_capture_allocations(monkeypatch):
    rng = random.Random(3)
    model = ModelAllocator(rng, expandable=False)
    model.malloc(4096, 11)
    seeds = []

    def snapshot(pool=(0, 0), traces=False):
        assert pool == (0, 0) and not traces, "the tracker path takes only plain snapshots"
        seeds.append(1)
        return model.snapshot()

    monkeypatch.setattr(allocator_log, "_snapshot", snapshot)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    watch = new_watch()
    log = watch.tracelog = FakeLog()
    model.log.clear()
    view = watch.view(0)  # the seed
    assert len(seeds) == 1

    def drained(overflow=False):
        log.batches.append((list(model.log), overflow))
        model.log.clear()

    live = [model.malloc(n, s) for n, s in [(512, 11), (3 << 20, 22), (100, 33)]]
    drained()
    assert watch.view(0) is view and len(seeds) == 1, "the events were applied, no snapshot"
    assert watch.ledger.drains == 1
    same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)

    def capture(gid: int, overflow: bool) -> list[int]:
        tag = watch.capture_started(gid, 22, None)
        start = len(model.log)
        carved = [model.malloc(n, 22) for n in (1000, 5 << 20)]
        for e in model.log[start:]:
            e["user_metadata"] = tag
        model.free(live.pop(0), 11)  # untagged, not the capture's
        drained(overflow)
        carves = watch.capture_ended(tag, (1, 0))
        assert [(a, n) for a, n, _ in carves] == [(carved[0], 1000), (carved[1], 5 << 20)]
        same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)
        return carved

    capture(7, overflow=False)
    assert len(seeds) == 1
    live.append(model.malloc(512, 11))
    capture(8, overflow=True)  # the tracker dropped events: the view is reseeded
    assert len(seeds) == 2

    for _ in range(allocator_log.RESEED_ENTRIES // 2 + 1):  # alloc + free_completed each
        model.free(model.malloc(512, 11), 11)
    drained()
    watch.sync()
    assert len(seeds) == 3, "past RESEED_ENTRIES events a snapshot is cheaper"
    same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)


def test_sync_waits_while_the_current_stream_captures(monkeypatch):
    watch = new_watch()
    log = watch.tracelog = FakeLog()
    log.batches.append(([], False))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    watch.sync()
    assert len(log.batches) == 1 and watch.ledger.drains == 0


def _model_watch(monkeypatch) -> tuple[ModelAllocator, AllocatorWatch, FakeLog]:
    model = ModelAllocator(random.Random(3), expandable=False)
    monkeypatch.setattr(
        allocator_log, "_snapshot", lambda pool=(0, 0), traces=False: model.snapshot()
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = new_watch()
    log = w.tracelog = FakeLog()
    return model, w, log


@pytest.mark.parametrize("lost", [False, True], ids=["drained", "buffer-full"])
def test_untagged_allocations_of_a_captured_backward_are_carves_even_when_the_view_reseeds(
    monkeypatch, lost
):
    """The autograd worker thread allocates for a captured backward without the capture's tag;
    a full buffer (or a batch big enough to reseed) must not drop those carves."""
    model, w, log = _model_watch(monkeypatch)
    model.malloc(4096, 11)
    model.log.clear()
    w.view(0)
    tag = w.capture_started(7, 22, None)
    carved = [model.malloc(n, 22) for n in (1000, 5 << 20)]  # untagged
    log.batches.append((list(model.log), lost))
    model.log.clear()
    carves = w.capture_ended(tag, STREAM_POOL[22])
    assert [(a, n) for a, n, _ in carves] == [(carved[0], 1000), (carved[1], 5 << 20)]


def test_the_first_capture_of_a_process_keeps_its_carves(monkeypatch):
    """No view exists before the first capture ends: the drain makes it, and the capture's
    allocations still reach the replay order."""
    model, w, log = _model_watch(monkeypatch)
    model.log.clear()
    tag = w.capture_started(7, 22, None)
    a = model.malloc(1000, 22)
    for e in model.log:
        e["user_metadata"] = tag
    log.batches.append((list(model.log), False))
    model.log.clear()
    assert [(x, n) for x, n, _ in w.capture_ended(tag, STREAM_POOL[22])] == [(a, 1000)]
    assert 0 in w.ledger.views

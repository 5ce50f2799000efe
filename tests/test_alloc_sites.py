"""Allocation sites as the GPU-trace callbacks record them, without a GPU: the callbacks are fired
through torch's own callback registry from Python stacks of random shape.

- The site of every allocation is the call path the previous walk recorded (a loop over 24
  frames, interned by code ids at once), kept here as the reference: same code objects, same
  instruction offsets, on deep and shallow stacks, on other threads, through generators.
- Sites are interned once the block outlives `INTERN_BATCH` more allocations (or a capture made
  it): one tuple per call path; a free or reallocation that happens while the interning runs is
  never overwritten with the older site.
- The free and allocation callbacks still reach the tracker: a watched free, and an allocation
  into a segment holding freed watched memory.
"""

from __future__ import annotations

import _thread
import random
import sys
import threading

import pytest
from torch._utils import CallbackRegistry

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import FreeEvent, GraphInfo, Reference
from graphsan.core.tracker import Tracker
from graphsan.cuda import allocator, sites
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.context import Context

SEG = 0x7F00_0000_0000


def _raise(err):
    raise err


def old_site(frame, interned: dict) -> tuple:
    """The walk before the unrolled one (24 frames keyed by code ids), the reference."""
    key = []
    f = frame
    for _ in range(24):
        if f is None:
            break
        key.append(id(f.f_code))
        key.append(f.f_lasti)
        f = f.f_back
    key = tuple(key)
    site = interned.get(key)
    if site is None:
        codes = []
        f = frame
        for _ in range(24):
            if f is None:
                break
            codes.append(f.f_code)
            codes.append(f.f_lasti)
            f = f.f_back
        site = interned[key] = tuple(codes)
    return site


class Recorder:
    """A watch fed by the registry, and the reference site of each allocation beside it."""

    def __init__(self) -> None:
        self.watch = AllocatorWatch(Tracker(), Context(), _raise)
        self.watch._active = True  # the callbacks without torch's GPU trace
        self.expected: dict[int, tuple] = {}
        self._interned: dict = {}
        self.allocs = CallbackRegistry("allocation")
        self.allocs.add_callback(self.watch._on_alloc)
        self.allocs.add_callback(self._reference)

    def _reference(self, ptr: int) -> None:
        # called from the same fire_callbacks frame as the watch's callback
        self.expected[ptr] = old_site(sys._getframe(1), self._interned)


# Four functions calling each other along a plan, from different lines, one through a generator.
def _a(plan, i, fire, ptr):
    if i == len(plan):
        return fire(ptr)
    return FUNCS[plan[i]](plan, i + 1, fire, ptr)


def _b(plan, i, fire, ptr):
    if i == len(plan):
        out = fire(ptr)
        return out
    if plan[i] % 2:
        return FUNCS[plan[i]](plan, i + 1, fire, ptr)
    return FUNCS[plan[i]](plan, i + 1, fire, ptr)


def _c(plan, i, fire, ptr):
    def gen():
        yield _a(plan, i, fire, ptr)

    return next(gen())


def _d(plan, i, fire, ptr):
    for _ in range(1):
        result = _b(plan, i, fire, ptr)
    return result


FUNCS = [_a, _b, _c, _d]


def _e(fire, ptr):
    return fire(ptr)


def _f(fire, ptr):
    return fire(ptr)


def random_plans(rng: random.Random, n: int) -> list[list[int]]:
    """Call plans from 0 to 40 deep (the walk stops at 24 frames), some repeated."""
    plans = [[rng.randrange(4) for _ in range(rng.randint(0, 40))] for _ in range(n // 2)]
    return plans + [rng.choice(plans) for _ in range(n - len(plans))]


def assert_same_site(got: tuple, want: tuple) -> None:
    assert len(got) == len(want)
    assert all(a is b for a, b in zip(got[0::2], want[0::2], strict=True))  # the code objects
    assert got[1::2] == want[1::2]


def run_plans(rec: Recorder, plans: list[list[int]], where: str) -> None:
    """Each plan's allocation, on this thread or on a new one (the autograd engine's worker
    thread allocates with no Python frame above torch's callback registry; a bare thread is
    close: one)."""
    done = threading.Event()

    def run():
        try:
            for ptr, plan in enumerate(plans, start=SEG):
                if plan:
                    _a(plan, 0, rec.allocs.fire_callbacks, ptr)
                else:
                    rec.allocs.fire_callbacks(ptr)
        finally:
            done.set()

    if where == "this thread":
        run()
    elif where == "bare thread":
        _thread.start_new_thread(run, ())
    else:
        threading.Thread(target=run).start()
    assert done.wait(60)


@pytest.mark.parametrize("where", ["this thread", "bare thread", "threading.Thread"])
def test_sites_are_the_reference_walks_on_random_stacks(where):
    rec = Recorder()
    plans = random_plans(random.Random(1234), 400) + [[]]
    run_plans(rec, plans, where)
    assert len(rec.expected) == len(plans) and set(rec.watch.sites.by_address) == set(rec.expected)
    for ptr, want in rec.expected.items():
        assert_same_site(rec.watch.sites.by_address[ptr], want)
    depths = {len(site) // 2 for site in rec.expected.values()}
    assert max(depths) == sites.SITE_DEPTH
    if where == "bare thread":  # stacks of every size, from two frames up to the cut
        assert min(depths) == 2 and len(depths) > sites.SITE_DEPTH // 2


def sites_of_caller(watch: AllocatorWatch) -> tuple:
    frame = sys._getframe(1)  # stopped at this call meanwhile
    return watch.sites.of_frame(frame), old_site(frame, {}), watch.sites.of_frame(frame)


def test_an_interned_site_is_the_reference_walk():
    site, want, again = sites_of_caller(AllocatorWatch(Tracker(), Context(), _raise))
    assert_same_site(site, want)
    assert again is site


def test_live_sites_are_interned_one_tuple_per_call_path(monkeypatch):
    monkeypatch.setattr(allocator, "INTERN_BATCH", 8)
    rec = Recorder()
    frees = CallbackRegistry("free")
    frees.add_callback(rec.watch._on_free)
    plans = [[0, 1], [2, 3, 1], [0, 1]]  # the first and last are one call path
    fire = rec.allocs.fire_callbacks
    kept = []
    for n in range(84):
        ptr, kind = SEG + n, n % 6
        if kind < 3:
            _a(plans[kind], 0, fire, ptr)
        elif kind == 3:  # the same offsets, other code objects
            (_e if n % 4 < 2 else _f)(fire, ptr)
        elif kind == 4:  # the same code objects as this, other offsets
            _e(fire, ptr)
        else:
            fire(ptr)
        if n % 7:
            frees.fire_callbacks(ptr)  # a temporary
        else:
            kept.append(ptr)
    assert set(rec.watch.sites.by_address) == set(kept)
    assert len(rec.watch.sites.fresh) < 8
    rec.watch.sites.intern_fresh()
    # the reference interns by call path too: one tuple of ours for each of its tuples
    ours: dict[int, tuple] = {}
    for ptr in kept:
        site = rec.watch.sites.by_address[ptr]
        assert_same_site(site, rec.expected[ptr])
        assert ours.setdefault(id(rec.expected[ptr]), site) is site
    # at least the six paths above, and some repeated: CPython 3.11 records a frame's `next(...)`
    # call (in `_c`) at another instruction offset once it has specialized that call, so the
    # reference may see one path twice, depending on how often earlier tests ran `_c`
    assert len(ours) == len({id(s) for s in ours.values()})
    assert 6 <= len(ours) < len(kept)
    again = rec.watch.sites.intern(tuple(rec.expected[kept[0]]))  # the same path, interned later
    assert again is rec.watch.sites.by_address[kept[0]]


def test_a_reallocation_while_interning_keeps_the_newer_site():
    rec = Recorder()
    watch = rec.watch
    _a([0, 1], 0, rec.allocs.fire_callbacks, SEG)  # the old allocation at SEG
    _a([2], 0, rec.allocs.fire_callbacks, SEG + 64)
    intern, calls = watch.sites.intern, []

    def intern_while_another_thread_reallocates(site):
        out = intern(site)
        calls.append(site)
        if len(calls) == 1:  # SEG's site is interned first
            watch._on_free(SEG)
            _b([3, 3], 0, rec.allocs.fire_callbacks, SEG)  # the new allocation at SEG
        return out

    watch.sites.intern = intern_while_another_thread_reallocates
    old = watch.sites.by_address[SEG]
    watch.sites.intern_fresh()
    assert watch.sites.by_address[SEG] is not old
    assert_same_site(watch.sites.by_address[SEG], rec.expected[SEG])  # the reallocation's path
    assert_same_site(watch.sites.by_address[SEG + 64], rec.expected[SEG + 64])


def test_a_free_while_interning_leaves_no_site():
    rec = Recorder()
    watch = rec.watch
    _a([1], 0, rec.allocs.fire_callbacks, SEG)
    intern = watch.sites.intern

    def intern_while_another_thread_frees(site):
        out = intern(site)
        watch._on_free(SEG)
        return out

    watch.sites.intern = intern_while_another_thread_frees
    watch.sites.intern_fresh()
    assert SEG not in watch.sites.by_address


def test_a_site_names_the_allocating_line():
    rec = Recorder()
    line = sys._getframe().f_lineno + 1
    rec.allocs.fire_callbacks(SEG)
    frames = rec.watch.ledger.frames_of(SEG)
    # the file by its location: from the project root, whatever the folder it sits in
    assert frames[-1] == (
        "tests/test_alloc_sites.py",
        line,
        "test_a_site_names_the_allocating_line",
    )
    rec.watch.sites.intern_fresh()
    assert rec.watch.ledger.frames_of(SEG) == frames


def test_stop_forgets_the_sites():
    rec = Recorder()
    rec.allocs.fire_callbacks(SEG)
    assert rec.watch.sites.by_address and rec.watch.sites.fresh
    rec.watch.stop()
    assert (
        not rec.watch.sites.by_address
        and not rec.watch.sites.fresh
        and not rec.watch.sites._interned
    )


def test_callbacks_reach_the_tracker():
    rec = Recorder()
    watch, tracker = rec.watch, rec.watch.tracker
    frees = CallbackRegistry("free")
    frees.add_callback(watch._on_free)
    snap = {
        "segments": [
            {
                "address": SEG,
                "total_size": 8192,
                "segment_pool_id": (0, 0),
                "blocks": [
                    {"address": SEG, "size": 4096, "state": "active_allocated"},
                    {"address": SEG + 4096, "size": 4096, "state": "inactive"},
                ],
            }
        ]
    }
    info = GraphInfo(1, "g1", [("train.py", 5, "capture")], (1, 0), 0)
    state = tracker.add_graph(info, [Reference(0, "k", 1, 8, SEG)], MemoryMap.from_snapshot(snap))
    watch.free_event = lambda: FreeEvent([("train.py", 9, "step")], "train", 1, None, None)
    frees.fire_callbacks(SEG + (1 << 30))  # unwatched, nothing freed yet: nothing to do
    assert not state.dirty and not tracker.freed_segments
    frees.fire_callbacks(SEG)  # the watched block
    assert state.dirty and tracker.freed_segments and SEG not in tracker.live
    state.dirty = False
    rec.allocs.fire_callbacks(SEG + (1 << 30))  # elsewhere
    assert not state.dirty
    rec.allocs.fire_callbacks(SEG + 4096)  # into the segment holding the freed block
    assert state.dirty

"""The compiled allocator tracker (graphsan.cuda.tracelog) without a GPU.

- Its records, converted to trace entries, keep the allocator view equal to the model allocator's
  snapshot at every step (tests/test_allocview.py's model), with the pools the records name and
  the user metadata (capture tags) they carry; the watch's sync drains them, reseeds on an
  overflow and keeps a capture's tagged allocations.
- The real tracelog.cpp, compiled here against the installed torch's headers (where a compiler
  and CUDA headers exist), records the events it is fed and drains them in the same shape.
- The build: a cache keyed by the torch build and the source, a temporary file renamed into
  place, and every failure (off by GRAPHSAN_TRACELOG, no compiler, no headers, a failed build, a
  library that does not load) turned into one line for the fallback.
"""

from __future__ import annotations

import functools
import os
import random
import stat
import sys
import types

import pytest
import torch

from graphsan.context import Context
from graphsan.core.allocview import AllocatorView
from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import DEFAULT_POOL
from graphsan.core.tracker import Tracker, WatchedBlock
from graphsan.cuda import allocator, allocator_log, tracebuild, tracelib, tracelog
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.gputrace import GpuTrace
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
            view.apply(entries, functools.partial(watch._pool_of, unsure=unsure))
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
    log = watch.log = FakeLog()
    model.log.clear()
    view = watch.view(0)  # the seed
    assert len(seeds) == 1

    def drained(overflow=False):
        log.batches.append((list(model.log), overflow))
        model.log.clear()

    live = [model.malloc(n, s) for n, s in [(512, 11), (3 << 20, 22), (100, 33)]]
    drained()
    assert watch.view(0) is view and len(seeds) == 1, "the events were applied, no snapshot"
    assert watch.drains == 1
    same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)

    def capture(gid: int, overflow: bool) -> list[int]:
        tag = watch.capture_started(gid, 22)
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
    log = watch.log = FakeLog()
    log.batches.append(([], False))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    watch.sync()
    assert len(log.batches) == 1 and watch.drains == 0


# -- the compiled tracker -----------------------------------------------------------------------
# The tests of the compiled library (`compiled`, `traced`) share one xdist worker (`--dist
# loadgroup`, pyproject.toml), so that the module's build runs once, not once a worker.
BUILT_ONCE = pytest.mark.xdist_group("test_tracelog-compiled")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """tracelog.cpp built against this torch (linked to libc10 only, not attached)."""
    try:
        return tracelog.build_unattached(str(tmp_path_factory.mktemp("tracelog")))
    except tracelog.BuildError as err:
        if "needs a C++ compiler" in str(err):
            pytest.skip(str(err))
        raise


def feed_all(log: tracelib.TraceLog, entries: list[dict]) -> list[dict]:
    for e in entries:
        log.feed(
            e["action"], e["addr"], e["size"], e["stream"], pool_of_entry(e), e["user_metadata"]
        )
    per_device, overflow = log.drain()
    assert not overflow
    return per_device.get(0, [])


@BUILT_ONCE
@pytest.mark.slow
@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_the_compiled_tracker_keeps_the_view_equal_to_a_snapshot(compiled, expandable):
    compiled.set_cap(1 << 18)
    compiled.enable(True)
    try:
        drive(5, expandable, functools.partial(feed_all, compiled))
    finally:
        compiled.enable(False)


@BUILT_ONCE
@pytest.mark.slow
def test_the_compiled_tracker_drops_past_its_cap_and_says_so(compiled):
    compiled.enable(True)
    try:
        compiled.set_cap(3)
        for i in range(5):
            compiled.feed("alloc", 0x1000 * (i + 1), 512, 7, (0, 0), "graphsan capture 1")
        compiled.feed("free_requested", 0x1000, 512, 7)  # not kept: no change to the blocks
        per_device, overflow = compiled.drain()
        assert overflow and [e["addr"] for e in per_device[0]] == [0x1000, 0x2000, 0x3000]
        assert {e["user_metadata"] for e in per_device[0]} == {"graphsan capture 1"}
        assert compiled.drain() == ({}, False)
        compiled.set_cap(1 << 18)
        compiled.feed("segment_map", 0x200000, 2 << 20, 9, (0, 4), "", device=1)
        compiled.feed("oom", 0, 0, 9)
        compiled.feed("snapshot", 0, 0, 0)
        (entry,) = compiled.drain()[0][1]
        assert entry["action"] == "segment_map" and entry["pool"] == (0, 4)
        assert entry["user_metadata"] == "" and entry["time_us"] > 0
        compiled.enable(False)
        compiled.feed("alloc", 0x5000, 512, 7)
        assert compiled.drain() == ({}, False), "off: nothing is kept"
        with pytest.raises(ValueError, match="unknown allocator action"):
            compiled.feed("malloc", 0, 0, 0)
    finally:
        compiled.set_cap(1 << 18)
        compiled.enable(False)


@BUILT_ONCE
@pytest.mark.slow
def test_the_compiled_tracker_names_why_it_cannot_attach(compiled):
    import ctypes

    if torch.cuda.is_available():
        pytest.skip("libc10_cuda is loaded here: this library would attach to the allocator")
    err = ctypes.create_string_buffer(512)
    rc = compiled.lib.gs_tracelog_attach(b"/nonexistent/libc10_cuda.so", err, len(err))
    assert rc != 0 and err.value == b"libc10_cuda is not loaded in this process"


# -- building -----------------------------------------------------------------------------------
FAKE_CXX = """#!{python}
import os, sys
args = sys.argv[1:]
out = args[args.index("-o") + 1]
with open(os.environ["FAKE_CXX_CALLS"], "a") as fh:
    fh.write(out + "\\n")
mode = os.environ.get("FAKE_CXX_MODE", "ok")
bad = os.environ.get("FAKE_CXX_BAD", "gputable.cpp")  # the GPU trace's file the headers do not fit
if mode == "no-trace" and any(a.endswith(bad) for a in args):
    sys.stderr.write(f"{{bad}}:130:3: error: no member named trace_gpu_event_record\\n")
    sys.exit(1)
if mode == "fail":
    sys.stderr.write("In file included from tracelog.cpp:9:\\n")
    sys.stderr.write("tracelog.cpp:9:10: fatal error: c10/cuda/CUDACachingAllocator.h: no such file\\n")
    sys.stderr.write("compilation terminated.\\n")
    sys.exit(1)
if mode == "race":  # another process finished the same library meanwhile
    with open(os.environ["FAKE_CXX_TARGET"], "w") as fh:
        fh.write("the other process's library")
with open(out, "w") as fh:
    fh.write("fake library")
"""


@pytest.fixture
def fake_cxx(tmp_path, monkeypatch):
    path = tmp_path / "fake-c++"
    path.write_text(FAKE_CXX.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "calls"
    calls.write_text("")
    monkeypatch.setenv("CXX", str(path))
    monkeypatch.setenv("FAKE_CXX_CALLS", str(calls))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tracebuild, "cuda_include_dirs", lambda: ["/cuda/include"])
    # the build's include dirs, without importing torch's extension builder
    stub = types.ModuleType("torch.utils.cpp_extension")
    stub.include_paths = lambda: ["/torch/include"]
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", stub)
    return lambda: calls.read_text().split()


def test_build_writes_a_temporary_file_next_to_the_target_then_renames_it(tmp_path, fake_cxx):
    target = tmp_path / "out" / "tracelog-x.so"
    tracebuild.build(str(target), os.environ["CXX"], ["/i"], "/torch/lib", ["c10"])
    (written,) = fake_cxx()
    assert written != str(target) and os.path.dirname(written) == str(target.parent)
    assert target.read_text() == "fake library"
    assert sorted(os.listdir(target.parent)) == ["tracelog-x.so"], "no temporary file is left"


def test_two_builds_at_once_leave_one_whole_library(tmp_path, fake_cxx, monkeypatch):
    target = tmp_path / "tracelog-x.so"
    monkeypatch.setenv("FAKE_CXX_MODE", "race")
    monkeypatch.setenv("FAKE_CXX_TARGET", str(target))
    tracebuild.build(str(target), os.environ["CXX"], [], "/torch/lib", [])
    assert target.read_text() == "fake library"
    assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []


def test_a_failed_build_is_one_line_and_leaves_nothing(tmp_path, fake_cxx, monkeypatch):
    monkeypatch.setenv("FAKE_CXX_MODE", "fail")
    target = tmp_path / "lib" / "tracelog-x.so"
    with pytest.raises(tracelog.BuildError) as err:
        tracebuild.build(str(target), os.environ["CXX"], [], "/torch/lib", [])
    assert str(err.value) == (
        "fake-c++ failed: tracelog.cpp:9:10: fatal error: "
        "c10/cuda/CUDACachingAllocator.h: no such file"
    )
    assert os.listdir(target.parent) == []


def test_the_cache_is_keyed_by_the_torch_build_and_the_source(tmp_path, fake_cxx):
    name = tracebuild.library_name(b"source", "2.11.0+cu130 abc abi1")
    assert name.startswith("tracelog-2.11.0+cu130-") and name.endswith(".so")
    assert tracebuild.library_name(b"source", "2.11.0+cu130 abc abi1") == name
    assert tracebuild.library_name(b"source2", "2.11.0+cu130 abc abi1") != name
    assert tracebuild.library_name(b"source", "2.11.0+cu130 abd abi1") != name
    assert tracebuild.library_name(b"source", "2.11.0+cu130 abc abi0") != name

    # obtain builds into $XDG_CACHE_HOME/graphsan once per key; the fake library does not load
    for _ in range(2):
        with pytest.raises(tracelog.BuildError, match=r"^cannot load tracelog-2\.11\.0.*\.so: "):
            tracebuild.obtain("2.11.0+cu130 abc abi1", "/torch/lib", 1)
    (built,) = fake_cxx()
    assert os.path.dirname(built) == str(tmp_path / "cache" / "graphsan")
    with pytest.raises(tracelog.BuildError, match="cannot load"):
        tracebuild.obtain("2.13.0+cu130 def abi1", "/torch/lib", 1)
    assert len(fake_cxx()) == 2
    cached = sorted(os.listdir(tmp_path / "cache" / "graphsan"))
    assert len([f for f in cached if f.endswith(".so")]) == 2
    assert len(cached) == 4, "each failure is remembered beside its library (.failed)"


@pytest.mark.parametrize("bad", tracebuild.TRACE_FILES)
def test_a_build_without_the_gpu_trace_keeps_the_tracker_and_says_why(
    tmp_path, fake_cxx, monkeypatch, bad
):
    monkeypatch.setenv("FAKE_CXX_MODE", "no-trace")
    monkeypatch.setenv("FAKE_CXX_BAD", bad)
    loaded = []
    monkeypatch.setattr(
        tracelib, "load", lambda path, without_trace=None: loaded.append((path, without_trace))
    )
    for _ in range(2):  # the second process finds the partial library and its reason cached
        tracebuild.obtain("2.11.0+cu130 abc abi1", "/torch/lib", 1)
    full, partial = fake_cxx()
    assert partial.endswith(".tmp") and "-notrace.so" in partial and "-notrace" not in full
    why = f"fake-c++ failed: {bad}:130:3: error: no member named trace_gpu_event_record"
    assert [w for _, w in loaded] == [why, why]
    assert loaded[0][0] == loaded[1][0] and loaded[0][0].endswith("-notrace.so")


def test_before_python_3_11_the_library_is_the_tracker_alone(tmp_path, fake_cxx, monkeypatch):
    monkeypatch.setattr(tracebuild.sys, "version_info", (3, 10, 14))
    loaded = []
    monkeypatch.setattr(
        tracelib, "load", lambda path, without_trace=None: loaded.append((path, without_trace))
    )
    tracebuild.obtain("2.11.0+cu130 abc abi1", "/torch/lib", 1)
    (built,) = fake_cxx()  # one compile: the tracker and the walk, without the GPU trace
    assert "-notrace.so" in built
    assert loaded[0][1] == "the GPU trace reads frames with PyFrame_GetLasti (Python 3.11)"


def test_the_prebuild_names_the_library_or_says_why(tmp_path, fake_cxx, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert tracelog.main([]) == 1
    assert capsys.readouterr().err == "graphsan tracelog: error: torch is not built with CUDA\n"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lib = tmp_path / "torch-lib"
    lib.mkdir()
    monkeypatch.setattr(tracelog, "torch_lib_dir", lambda: str(lib))
    assert tracelog.main([]) == 1
    assert capsys.readouterr().err == f"graphsan tracelog: error: no libc10_cuda.so in {lib}\n"
    (lib / "libc10_cuda.so").write_text("")
    monkeypatch.setattr(
        tracelib,
        "load",
        lambda path, without_trace=None: tracelib.TraceLog(
            None, without_trace or object.__new__(GpuTrace), path
        ),
    )
    assert tracelog.main([]) == 0
    (built,) = fake_cxx()  # built into the cache, as enable() would find it
    line = capsys.readouterr().out
    assert line.startswith("graphsan tracelog: ") and line.endswith(", with the GPU trace\n")
    assert os.path.dirname(line.split()[2].rstrip(",")) == str(tmp_path / "cache" / "graphsan")


def test_no_compiler_or_no_cuda_headers_is_a_reason(tmp_path, fake_cxx, monkeypatch):
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(tracelog.BuildError, match=r"^no C\+\+ compiler \(\$CXX, c\+\+ or g\+\+\)$"):
        tracebuild.obtain("2.11.0 abc abi1", "/torch/lib", 1)
    monkeypatch.setenv("CXX", str(tmp_path / "fake-c++"))
    monkeypatch.setattr(tracebuild, "cuda_include_dirs", lambda: [])
    with pytest.raises(tracelog.BuildError, match=r"^no CUDA headers"):
        tracebuild.obtain("2.11.0 abc abi1", "/torch/lib", 1)
    assert fake_cxx() == []


@pytest.mark.parametrize(
    ("setting", "reason"),
    [
        ("0", "GRAPHSAN_TRACELOG=0"),
        ("yes", "GRAPHSAN_TRACELOG='yes': expected 0 (off) or 1 (on, waiting for the build)"),
        ("1", "torch is not built with CUDA"),
        ("", "torch is not built with CUDA"),  # unset: on
    ],
)
def test_open_log_falls_back_with_one_line(monkeypatch, setting, reason):
    monkeypatch.setattr(tracelog, "_opened", [])
    monkeypatch.setenv("GRAPHSAN_TRACELOG", setting)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert tracelog.open_log() == (None, reason)
    monkeypatch.setenv("GRAPHSAN_TRACELOG", "1" if setting == "0" else "0")
    assert tracelog.open_log() == (None, reason), "decided once per process"


def test_an_opened_tracker_has_no_reason_so_nothing_is_announced(monkeypatch, capsys):
    """(On the H200 every run with the tracker once said "events come from snapshots (tracker)".)"""
    monkeypatch.setattr(tracelog, "_opened", [])
    monkeypatch.setattr(allocator, "_SAID", [])
    log = FakeLog()
    monkeypatch.setattr(tracelog, "_open", lambda: log)
    watch = new_watch()
    watch.log, watch.log_reason = tracelog.open_log()
    assert (watch.log, watch.log_reason) == (log, None)
    allocator._say_fallback(watch.log_reason)
    assert capsys.readouterr().err == "" and watch.allocator_log == "tracker"


def test_an_unexpected_error_is_a_reason_too(monkeypatch):
    monkeypatch.setattr(tracelog, "_opened", [])

    def broken():
        raise RuntimeError("CUDA driver initialization failed\nmore detail")

    monkeypatch.setattr(tracelog, "_open", broken)
    assert tracelog.open_log() == (None, "RuntimeError: CUDA driver initialization failed")


def test_the_watch_says_where_its_events_come_from_once(monkeypatch, capsys):
    monkeypatch.setattr(allocator, "_SAID", [])
    watch = new_watch()
    assert watch.allocator_log is None
    watch.log_reason = "no C++ compiler ($CXX, c++ or g++)"
    assert watch.allocator_log == "snapshot (no C++ compiler ($CXX, c++ or g++))"
    allocator._say_fallback("GRAPHSAN_TRACELOG=0")
    assert capsys.readouterr().err == "", "a fallback the user asked for is not announced"
    allocator._say_fallback(watch.log_reason)
    allocator._say_fallback("another reason")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler" in err
    watch.log = FakeLog()
    assert watch.allocator_log == "tracker"


FAKE_PYTHON = """#!{python}
import json, os, sys
with open(os.environ["FAKE_PYTHON_CALLS"], "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "pythonpath": os.environ.get("PYTHONPATH"),
                         "session": os.getsid(0) == os.getpid()}}) + "\\n")
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    """sys.executable as a script that writes down how it was started (the background builder)."""
    import json
    import time

    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    calls = tmp_path / "python-calls"
    monkeypatch.setenv("FAKE_PYTHON_CALLS", str(calls))
    monkeypatch.setattr(sys, "executable", str(path))
    monkeypatch.setattr(tracebuild, "_BACKGROUND", [])

    def started(expected: int) -> list[dict]:
        deadline = time.monotonic() + 30  # the starts are detached: wait for their lines
        while time.monotonic() < deadline:
            lines = calls.read_text().splitlines() if calls.exists() else []
            if len(lines) >= expected:
                break
            time.sleep(0.02)
        return [json.loads(x) for x in lines]

    return started


def test_a_cold_cache_starts_one_background_build_and_the_run_reads_snapshots(
    tmp_path, fake_cxx, fake_python, monkeypatch, capsys
):
    key = "2.11.0+cu130 abc abi1 py3.11"
    for _ in range(2):  # the second run (or rank) finds the first one's build under way
        with pytest.raises(tracelog.BuildError) as err:
            tracebuild.obtain(key, "/torch/lib", 1, wait=False)
        assert str(err.value) == tracebuild.BUILDING
    assert fake_cxx() == [], "the run itself compiles nothing"
    (started,) = fake_python(1)
    marker = started["argv"][-1]
    assert started["argv"] == ["-m", "graphsan.cuda.tracelog", "--marker", marker]
    assert os.path.isfile(marker) and marker.endswith(".so.building")
    assert os.path.dirname(marker) == str(tmp_path / "cache" / "graphsan")
    assert started["session"], "a Ctrl-C for the run does not reach the build"
    src = os.path.dirname(os.path.dirname(os.path.dirname(tracelog.__file__)))
    assert started["pythonpath"].split(os.pathsep)[0] == src
    allocator._say_fallback(tracebuild.BUILDING)
    assert capsys.readouterr().err == "", "a build under way fixes itself: it is not announced"

    old = os.path.getmtime(marker) - tracebuild.BUILD_TIMEOUT_S - 120
    os.utime(marker, (old, old))  # its builder died without removing it
    with pytest.raises(tracelog.BuildError, match="being built"):
        tracebuild.obtain(key, "/torch/lib", 1, wait=False)
    assert len(fake_python(2)) == 2

    # the builder's turn (what the background process runs), then a run finds the library
    loaded = []
    monkeypatch.setattr(
        tracelib, "load", lambda path, without_trace=None: loaded.append(path) or "the log"
    )
    assert tracelog.main(["--marker", marker]) == 1  # torch here is the CPU build
    assert not os.path.exists(marker), "the builder removes its marker, failed or not"
    tracebuild.obtain(key, "/torch/lib", 1)
    assert tracebuild.obtain(key, "/torch/lib", 1, wait=False) == "the log"
    assert len(fake_cxx()) == 1 and len(fake_python(2)) == 2 and len(set(loaded)) == 1


def test_a_failed_build_is_remembered_and_said_instead_of_compiling_again(
    tmp_path, fake_cxx, fake_python, monkeypatch
):
    monkeypatch.setenv("FAKE_CXX_MODE", "fail")
    key = "2.11.0+cu130 abc abi1 py3.11"
    with pytest.raises(tracelog.BuildError, match="^fake-c\\+\\+ failed: "):
        tracebuild.obtain(key, "/torch/lib", 1)
    for _ in range(2):
        with pytest.raises(tracelog.BuildError) as err:
            tracebuild.obtain(key, "/torch/lib", 1, wait=False)
        assert str(err.value) == (
            "the compiled tracker's build failed: fake-c++ failed: tracelog.cpp:9:10: fatal "
            "error: c10/cuda/CUDACachingAllocator.h: no such file "
            "(python -m graphsan.cuda.tracelog tries again)"
        )
    assert tracebuild._BACKGROUND == [] and len(fake_cxx()) == 1
    monkeypatch.setenv("FAKE_CXX_MODE", "ok")
    monkeypatch.setattr(tracelib, "load", lambda path, without_trace=None: "the log")
    assert tracebuild.obtain(key, "/torch/lib", 1) == "the log"  # what the prebuild runs
    cached = os.listdir(tmp_path / "cache" / "graphsan")
    assert [f for f in cached if f.endswith(".failed")] == [], "a good build forgets the failure"


@pytest.mark.skipif(bool(torch.version.cuda), reason="with CUDA torch the process would compile")
def test_the_background_builder_runs_as_a_module_and_removes_its_marker(tmp_path):
    import subprocess

    marker = tmp_path / "tracelog-x.so.building"
    marker.write_text("")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(tracelog.__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "graphsan.cuda.tracelog", "--marker", str(marker)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == "graphsan tracelog: error: torch is not built with CUDA\n"
    assert not marker.exists()


def _model_watch(monkeypatch) -> tuple[ModelAllocator, AllocatorWatch, FakeLog]:
    model = ModelAllocator(random.Random(3), expandable=False)
    monkeypatch.setattr(
        allocator_log, "_snapshot", lambda pool=(0, 0), traces=False: model.snapshot()
    )
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    w = new_watch()
    log = w.log = FakeLog()
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
    tag = w.capture_started(7, 22)
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
    tag = w.capture_started(7, 22)
    a = model.malloc(1000, 22)
    for e in model.log:
        e["user_metadata"] = tag
    log.batches.append((list(model.log), False))
    model.log.clear()
    assert [(x, n) for x, n, _ in w.capture_ended(tag, STREAM_POOL[22])] == [(a, 1000)]
    assert 0 in w.views


# -- the compiled GPU trace ---------------------------------------------------------------------
@pytest.fixture
def traced(compiled, monkeypatch):
    """An AllocatorWatch whose frees and allocations come through the compiled library, installed
    as PyTorch's GPU-trace interpreter (given back afterwards)."""
    if isinstance(compiled.gpu_trace, str):
        pytest.skip(compiled.gpu_trace)
    watch = AllocatorWatch(Tracker(), Context(), _raise, alloc_stacks=True)
    watch.log = compiled
    watch._active = True
    monkeypatch.setattr(
        watch, "_activate_torch_trace", lambda: pytest.fail("fell back to PyTorch's trace")
    )
    watch._start_trace()
    assert watch.trace is compiled.gpu_trace and compiled.gpu_trace.current()
    yield watch
    watch.stop()
    assert not compiled.gpu_trace.current()


def _raise(err: BaseException) -> None:
    raise err


def allocate_in_user_code(trace: GpuTrace, addr: int) -> None:
    trace.fire("alloc", addr)  # the allocator's trace entry, as a CUDA allocation here would make


def free_in_user_code(trace: GpuTrace, addr: int) -> None:
    trace.fire("free", addr)


@BUILT_ONCE
def test_the_trace_records_each_allocations_site_in_cpp(traced):
    trace = traced.trace
    allocate_in_user_code(trace, 0x7000_0000)
    frames = traced._frames_of(0x7000_0000)
    assert frames[-1][2] == "allocate_in_user_code"
    assert frames[-1][0] == __file__ and frames[-2][2].startswith("test_the_trace_records")
    assert traced.sites.by_address == {}  # nothing went through the Python allocation callback
    for addr in (0x7000_1000, 0x7000_2000):  # one call path: one interned tuple
        allocate_in_user_code(trace, addr)
    assert traced._site_at(0x7000_1000) is traced._site_at(0x7000_2000)
    assert traced._site_at(0x7000_1000) != traced._site_at(0x7000_0000)  # another line
    free_in_user_code(trace, 0x7000_0000)
    assert traced._site_at(0x7000_0000) is None


@BUILT_ONCE
def test_the_trace_calls_python_only_for_watched_frees_and_names_the_freeing_code(traced):
    trace, tracker = traced.trace, traced.tracker
    before = trace.python_calls()
    for i in range(50):  # ordinary temporaries: allocated and freed without Python
        allocate_in_user_code(trace, 0x7100_0000 + 512 * i)
        free_in_user_code(trace, 0x7100_0000 + 512 * i)
    trace.fire("event_record", 0x1234)  # the other trace entries do nothing
    assert trace.python_calls() == before
    wb = WatchedBlock(0x7200_0000, 512, DEFAULT_POOL, (0x7200_0000, 1 << 20), [], {1})
    tracker.graphs[1] = types.SimpleNamespace(dirty=False)
    tracker.live[wb.address] = wb
    tracker.mirrored([wb.address])  # what add_graph tells the adapter
    assert trace.watched_count() >= 1
    free_in_user_code(trace, wb.address)
    assert trace.python_calls() == before + 1
    assert wb.freed is not None and tracker.graphs[1].dirty
    assert any(f[2] == "free_in_user_code" for f in wb.freed.stack)
    # its segment now holds freed watched memory: an allocation there is judged (the owner of
    # the memory changed), one elsewhere is not
    tracker.graphs[1].dirty = False
    allocate_in_user_code(trace, 0x7300_0000)
    assert not tracker.graphs[1].dirty and trace.python_calls() == before + 1
    allocate_in_user_code(trace, 0x7200_0200)
    assert tracker.graphs[1].dirty and trace.python_calls() == before + 2


@BUILT_ONCE
def test_the_trace_falls_back_with_one_warning_when_replaced(traced):
    from torch.cuda import _gpu_trace

    # registered all along (silent under graphsan's interpreter), so they carry on at once
    assert traced._on_free in _gpu_trace.MemoryDeallocationCallbacks.callback_list
    assert traced._on_alloc in _gpu_trace.MemoryAllocationCallbacks.callback_list
    traced.trace.uninstall()  # as torch._C._activate_gpu_trace() would replace it
    with pytest.warns(UserWarning, match="switched on after graphsan started"):
        traced.check_trace()
    assert traced.trace is None
    assert traced.allocator_log.startswith("tracker, GPU trace: PyTorch's (")
    traced.check_trace()  # once only: no second warning


@BUILT_ONCE
def test_a_stopped_trace_forgets_its_sites_and_callbacks(compiled, traced):
    trace = compiled.gpu_trace
    allocate_in_user_code(trace, 0x7400_0000)
    assert trace.site_of(0x7400_0000) is not None
    traced.stop()
    assert trace.site_of(0x7400_0000) is None and trace._sites == {}
    assert not trace.current() and trace.watched_count() == 0


@BUILT_ONCE
def test_the_trace_is_not_taken_from_another_listener(compiled):
    import ctypes

    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    have = ctypes.c_bool.in_dll(c10, "_ZN3c104impl8GPUTrace9haveStateE")
    state = ctypes.c_void_p.in_dll(c10, "_ZN3c104impl8GPUTrace13gpuTraceStateE")
    saved = have.value, state.value
    have.value, state.value = True, 0x10  # some interpreter already listens
    try:
        assert compiled.gpu_trace.install() == (
            "PyTorch's GPU trace is already on (another tool listens to it)"
        )
        assert not compiled.gpu_trace.current()
    finally:
        have.value, state.value = saved


@BUILT_ONCE
def test_the_trace_keeps_count_under_threads(traced):
    """Four threads allocate and free at once (the library runs without the GIL between its
    Python calls): every watched free reaches Python exactly once, and no site outlives its
    block."""
    import threading

    trace, tracker = traced.trace, traced.tracker
    watched = [0x7600_0000 + (i << 20) for i in range(4)]
    tracker.graphs[1] = types.SimpleNamespace(dirty=False)
    for addr in watched:
        tracker.live[addr] = WatchedBlock(addr, 512, DEFAULT_POOL, (addr, 1 << 20), [], {1})
    tracker.mirrored(watched)
    before = trace.python_calls()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            base = 0x7700_0000 + (i << 24)
            for k in range(2000):
                allocate_in_user_code(trace, base + 512 * k)
                if k % 2:
                    free_in_user_code(trace, base + 512 * k)
            free_in_user_code(trace, watched[i])
            for k in range(0, 2000, 2):
                free_in_user_code(trace, base + 512 * k)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert trace.python_calls() == before + 4
    assert all(tracker.live.get(a) is None for a in watched) and tracker.graphs[1].dirty
    assert all(
        trace.site_of(0x7700_0000 + (i << 24) + 512 * k) is None
        for i in range(4)
        for k in (0, 1, 1999)
    )


@BUILT_ONCE
def test_a_block_freed_while_its_capture_is_added_stays_watched(traced):
    """A free can reach Python between the library learning of a block and the block entering
    `Tracker.live`: the address stays watched, so the next free there is judged; an address no
    graph watches any more leaves the set at its first free."""
    trace, tracker = traced.trace, traced.tracker
    tracker.graphs[1] = types.SimpleNamespace(dirty=False)
    a, stale = 0x7800_0000, 0x7900_0000
    tracker.mirrored([a])  # add_graph tells the library first ...
    before = trace.python_calls()
    free_in_user_code(trace, a)  # ... and another thread frees the block meanwhile
    assert trace.python_calls() == before + 1 and a in traced._arriving
    wb = WatchedBlock(a, 512, DEFAULT_POOL, (a, 1 << 20), [], {1})
    tracker.live[a] = wb  # ... before add_graph puts it in live
    allocate_in_user_code(trace, a)
    free_in_user_code(trace, a)  # the next free at the address is judged
    assert wb.freed is not None and tracker.graphs[1].dirty
    assert trace.python_calls() == before + 2
    assert trace.watched_count() == 0  # judged once: the address has left the set (its
    # segment now holds freed watched memory, which the freed ranges cover instead)
    trace.watch([stale])  # left over from a graph since forgotten
    free_in_user_code(trace, stale)
    free_in_user_code(trace, stale)
    assert trace.python_calls() == before + 3 and trace.watched_count() == 0


@BUILT_ONCE
def test_a_second_sanitizer_does_not_take_the_trace_from_the_first(compiled, traced, monkeypatch):
    other = AllocatorWatch(Tracker(), Context(), _raise, alloc_stacks=True)
    other.log = compiled
    other._active = True
    monkeypatch.setattr(
        other, "_activate_torch_trace", lambda: pytest.fail("replaced the first one's trace")
    )
    with pytest.warns(UserWarning, match="another active graphsan sanitizer holds the GPU trace"):
        other._start_trace()
    assert other.trace is None and traced.trace is compiled.gpu_trace
    assert compiled.gpu_trace.current()

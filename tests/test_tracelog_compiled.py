"""The real tracelog.cpp and its GPU-trace interpreter, compiled here against the installed
torch's headers (where a compiler exists), fed events without a GPU: the tracker records and
drains them in the snapshot's shape, drops past its cap and says so, names why it cannot
attach; as PyTorch's GPU-trace interpreter it keeps each allocation's site in C++ and calls
Python only for watched frees.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from graphsan.core.graph_state import GraphState, WatchedBlock
from graphsan.core.records import DEFAULT_POOL, GraphInfo, ReferenceCounts
from graphsan.core.tracker import Tracker
from graphsan.cuda import tracebuild, tracelib, tracelog
from graphsan.cuda.allocator import AllocatorWatch
from graphsan.cuda.context import Context
from graphsan.cuda.gputrace import GpuTrace
from tests import native
from tests.once import once
from tests.test_tracelog import drive, pool_of_entry

# -- the compiled tracker -----------------------------------------------------------------------
# The tests of the compiled library (`compiled`, `traced`) share one xdist worker (`--dist
# loadgroup`, pyproject.toml), so that the module's build runs once, not once a worker (and
# `once` builds it once where a pytest loses the group: the other workers load that build).
BUILT_ONCE = pytest.mark.xdist_group("test_tracelog-compiled")


@pytest.fixture(scope="module")
def compiled(request):
    """tracelog.cpp built against this torch (linked to libc10 only, not attached)."""

    def build(folder) -> str:
        return tracelog.build_unattached(str(folder), native.COMPILE_FLAGS).path

    try:
        path = once(request, "tracelog", build)
    except tracelog.BuildError as err:
        if "needs a C++ compiler" in str(err):
            pytest.skip(str(err))
        raise
    # loaded as build_unattached loads it, where this Python cannot have the GPU trace
    return tracelib.load(path, tracebuild.why_no_trace())


@BUILT_ONCE
@pytest.mark.skipif(not native.SANITIZE, reason="GRAPHSAN_TEST_SANITIZE=1 builds it sanitized")
def test_the_sanitized_library_is_instrumented(compiled):
    """.ci/sanitizers would pass vacuously on a library built without the sanitizers."""
    with open(compiled.path, "rb") as fh:
        body = fh.read()
    assert b"__asan_report" in body and b"__ubsan_handle" in body


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
    if torch.version.cuda:  # a CUDA build without a GPU: libc10_cuda is loaded, its allocator idle
        assert rc == 3 and err.value == b"the CUDA caching allocator is not initialized"
    else:
        assert rc == 1 and err.value == b"libc10_cuda is not loaded in this process"


@BUILT_ONCE
def test_a_pool_is_released_alone_or_the_library_says_why(compiled):
    """The start-up probe's pool goes back to the driver through the allocator's per-pool
    emptyCache; (0, 0) would release the program's whole cache and is refused."""
    if torch.cuda.is_available():
        pytest.skip("libc10_cuda is loaded here: this would release a real pool")
    assert compiled.release_pool((0, 0), "libc10_cuda.so") == "(0, 0) names every pool: refused"
    why = compiled.release_pool((0, 7), "/nonexistent/libc10_cuda.so")
    if torch.version.cuda:  # a CUDA build without a GPU: libc10_cuda is loaded, its allocator idle
        assert why == "the CUDA caching allocator is not initialized"
    else:
        assert why == "libc10_cuda is not loaded in this process"


# -- the compiled GPU trace ---------------------------------------------------------------------
@pytest.fixture
def traced(compiled, monkeypatch):
    """An AllocatorWatch whose frees and allocations come through the compiled library, installed
    as PyTorch's GPU-trace interpreter (given back afterwards)."""
    if isinstance(compiled.gpu_trace, str):
        pytest.skip(compiled.gpu_trace)
    watch = AllocatorWatch(Tracker(), Context(), _raise, alloc_stacks=True)
    watch.tracelog = compiled
    watch._active = True
    monkeypatch.setattr(
        watch, "_activate_torch_trace", lambda: pytest.fail("fell back to PyTorch's trace")
    )
    watch._start_trace()
    assert watch.trace is compiled.gpu_trace and compiled.gpu_trace.current()
    yield watch
    watch.stop()
    assert not compiled.gpu_trace.current()


def a_graph(gid: int) -> GraphState:
    """A graph's state with nothing watched yet (the test adds its blocks to the tracker)."""
    return GraphState(GraphInfo(gid, f"g{gid}", (), DEFAULT_POOL, 0), {}, {}, ReferenceCounts())


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
    frames = traced.ledger.frames_of(0x7000_0000)
    assert frames[-1][2] == "allocate_in_user_code"
    # the file by its location: from the project root, whatever the folder it sits in
    assert frames[-1][0] == "tests/test_tracelog_compiled.py"
    assert frames[-2][2].startswith("test_the_trace_records")
    assert traced.sites.by_address == {}  # nothing went through the Python allocation callback
    for addr in (0x7000_1000, 0x7000_2000):  # one call path: one interned tuple
        allocate_in_user_code(trace, addr)
    assert traced._site_at(0x7000_1000) is traced._site_at(0x7000_2000)
    assert traced._site_at(0x7000_1000) != traced._site_at(0x7000_0000)  # another line
    free_in_user_code(trace, 0x7000_0000)
    assert traced._site_at(0x7000_0000) is None


@BUILT_ONCE
def test_a_site_read_holds_its_code_objects_when_the_sites_are_cleared(traced):
    """A site is read while another thread may clear every site (a stop of the trace): the
    tuple the library makes holds its own references, and the two never interleave."""
    trace = traced.trace
    ns: dict = {}
    made = "def allocate_here(trace):\n    trace.fire('alloc', 0x7300_0000)\n"
    exec(compile(made, "<made-for-this-test>", "exec"), ns)
    ns["allocate_here"](trace)
    site = trace.site_of(0x7300_0000)
    (code,) = [c for c in site[0::2] if c.co_name == "allocate_here"]
    ns.clear()  # the site's tuple and the library hold the function's code now
    before = sys.getrefcount(code)
    trace.enable(False)
    trace.clear_sites()
    assert sys.getrefcount(code) == before - 1, "the library let go of its own reference"
    assert code.co_filename == "<made-for-this-test>" and code in site
    assert trace.site_of(0x7300_0000) is None
    assert trace.pylib.gs_trace_site_tuple(0) == (), "no site left to read"


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
    tracker.graphs[1] = a_graph(1)
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
    assert traced.event_source.startswith("tracker, GPU trace: PyTorch's (")
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
    tracker.graphs[1] = a_graph(1)
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
    tracker.graphs[1] = a_graph(1)
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
    other.tracelog = compiled
    other._active = True
    monkeypatch.setattr(
        other, "_activate_torch_trace", lambda: pytest.fail("replaced the first one's trace")
    )
    with pytest.warns(UserWarning, match="another active graphsan sanitizer holds the GPU trace"):
        other._start_trace()
    assert other.trace is None and traced.trace is compiled.gpu_trace
    assert compiled.gpu_trace.current()

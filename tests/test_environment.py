"""CPU: graphsan never raises because of the environment. `enable()` (and with it `watch()`,
`graphsan run` and the pytest plugin, which call it) goes on, in one line, past an allocator
backend without history or block map (cudaMallocAsync), snapshots refused, a driver symbol
missing, no C++ compiler and a read-only cache folder; under a backend without block map it
keeps watching through the driver."""

from __future__ import annotations

import errno
import os
import sys

import pytest
import torch

from graphsan.core.records import FREED_UNSEEN, AllocArgs, KernelArgs
from graphsan.cuda import allocator, allocator_log, driver, driverwatch, tracebuild, tracelog
from graphsan.report import StaleMemoryError, format_finding
from graphsan.runtime import sanitizer
from tests import fake_cuda

SEG = fake_cuda.SEG


@pytest.fixture
def cuda_here(monkeypatch, attach):
    """A machine where CUDA looks available (CPU torch, faked), with a graph class to capture."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        allocator.AllocatorWatch, "_activate_torch_trace", staticmethod(lambda: None)
    )
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    return state


def started(policy="raise") -> sanitizer.Sanitizer:
    san = sanitizer.Sanitizer(policy)
    san.start()
    return san


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ----------------------------------------------------------------------------- cudaMallocAsync
@pytest.fixture
def async_backend(cuda_here, monkeypatch):
    """The cudaMallocAsync backend: the driver knows one 4 KiB allocation at SEG, id 1."""
    monkeypatch.setattr(driverwatch, "backend", lambda: "cudaMallocAsync")
    known = {SEG: (SEG, 4096, 1)}
    cuda_here["driver"] = known
    monkeypatch.setattr(
        driver,
        "address_range",
        lambda p: next(((b, n) for b, n, _ in known.values() if b <= p < b + n), None),
    )
    monkeypatch.setattr(
        driver,
        "allocation",
        lambda p: next((v for v in known.values() if v[0] <= p < v[0] + v[1]), None),
    )
    return cuda_here


def test_a_backend_without_block_map_watches_through_the_driver(async_backend, capsys):
    san = started()
    try:
        assert san.active and isinstance(san.memory, driverwatch.DriverWatch)
        line = one_line(capsys)
        assert "the cudaMallocAsync allocator backend keeps no block map" in line
        assert san.report().allocator_log.startswith("driver (the cudaMallocAsync")
        g = async_backend["cls"]()
        g.capture_begin()
        g.capture_end()
        (stats,) = san.graph_stats.values()
        assert stats.counts.default == 1 and stats.watched_blocks == 1
        g.replay()  # the driver still has the allocation: nothing to say
        assert g.launched == 1 and san.findings == []
        # freed and allocated anew at the same address: a new buffer id
        async_backend["driver"][SEG] = (SEG, 4096, 2)
        with pytest.raises(StaleMemoryError) as err:
            g.replay()
        assert g.launched == 1, "the replay did not launch"
        (f,) = err.value.findings
        assert f.kind == "reowned" and f.free_op == FREED_UNSEEN
        assert "the driver found the allocation gone or replaced" in format_finding(f)
    finally:
        san.stop()


def test_under_the_driver_a_gone_allocation_is_freed_and_graph_memory_is_not_watched(async_backend):
    graph_mem = SEG + (1 << 20)  # what the graph's memory node allocated: the graph's own
    buf = b"".join(a.to_bytes(8, "little") for a in (SEG, graph_mem))
    async_backend["nodes"] = [
        KernelArgs(0, "void k(float*, float*)", buf, [0, 8]),
        AllocArgs(1, graph_mem, 4096),
    ]
    async_backend["driver"][graph_mem] = (graph_mem, 4096, 7)
    san = started("record")
    try:
        g = async_backend["cls"]()
        g.capture_begin()
        g.capture_end()
        (stats,) = san.graph_stats.values()
        assert stats.counts.temporary == 1 and stats.watched_blocks == 1
        del async_backend["driver"][SEG]
        g.replay()
        (f,) = san.findings
        assert f.kind == "freed" and f.block_address == SEG and f.nbytes == 4096
    finally:
        san.stop()


def graph_with_an_output(async_backend, out: torch.Tensor):
    """A graph reading SEG and writing `out`, which its memory node allocated (a capture's
    output under cudaMallocAsync: allocated when the graph first launches)."""
    storage = out.untyped_storage()
    buf = b"".join(a.to_bytes(8, "little") for a in (SEG, storage.data_ptr()))
    async_backend["nodes"] = [
        KernelArgs(0, "void k(float*, float*)", buf, [0, 8]),
        AllocArgs(1, storage.data_ptr(), storage.nbytes()),
    ]
    async_backend["driver"][storage.data_ptr()] = (storage.data_ptr(), storage.nbytes(), 7)
    g = async_backend["cls"]()
    g.capture_begin()
    g.capture_end()
    return g


def test_a_graph_stopped_before_its_first_launch_keeps_its_outputs_alive(async_backend, capsys):
    """Freeing memory a graph never allocated aborts PyTorch under cudaMallocAsync: the output
    the caller holds stays alive until the process exits, and one line says so."""
    san = started()
    san.memory.device_type = "cpu"  # the output stands in for the graph's device memory
    capsys.readouterr()
    try:
        out = torch.empty(256)
        storage = out.untyped_storage()
        g = graph_with_an_output(async_backend, out)
        async_backend["driver"][SEG] = (SEG, 4096, 2)  # its input freed before the first replay
        before = sys.getrefcount(storage)
        with pytest.raises(StaleMemoryError):
            g.replay()
        assert g.launched == 0
        assert sys.getrefcount(storage) == before + 1, "a reference that is never given back"
        line = one_line(capsys)
        assert line.startswith("graphsan: graph #1 ") and "before its first launch" in line
        assert "cudaMallocAsync" in line and "1 output storage(s)" in line
        with pytest.raises(StaleMemoryError):
            g.replay()  # stopped again: nothing more to keep, nothing more said
        assert sys.getrefcount(storage) == before + 1 and capsys.readouterr().err == ""
    finally:
        san.stop()


def test_a_graph_that_launched_once_keeps_nothing_when_stopped_later(async_backend, capsys):
    san = started()
    san.memory.device_type = "cpu"
    capsys.readouterr()
    try:
        out = torch.empty(256)
        storage = out.untyped_storage()
        g = graph_with_an_output(async_backend, out)
        g.replay()  # the graph's memory exists from here on
        before = sys.getrefcount(storage)
        async_backend["driver"][SEG] = (SEG, 4096, 2)
        with pytest.raises(StaleMemoryError):
            g.replay()
        assert g.launched == 1 and sys.getrefcount(storage) == before
        assert capsys.readouterr().err == ""
    finally:
        san.stop()


# ----------------------------------------------------------------------------- refused and missing
def test_snapshots_refused_leave_graphsan_idle_in_one_line(cuda_here, monkeypatch, capsys):
    monkeypatch.setattr(tracelog, "open_log", lambda: (None, "GRAPHSAN_TRACELOG=0"))
    monkeypatch.setattr(
        allocator_log.AllocatorLog, "record_history", lambda self, clear=False: None
    )
    monkeypatch.setattr(
        allocator.AllocatorWatch, "view", lambda self, device, **kw: self.ledger._new_view(device)
    )

    def refused(*args, **kwargs):
        raise RuntimeError("Calling snapshot with backend:X is not meaningful")

    monkeypatch.setattr(allocator_log, "_snapshot", refused)
    san = started()
    assert not san.active
    assert (
        "the allocator cannot be read here (RuntimeError: Calling snapshot" in san.disabled_reason
    )
    assert one_line(capsys).endswith("graphsan stays idle")
    g = cuda_here["cls"]()  # the program's graphs work as without graphsan
    g.capture_begin()
    g.capture_end()
    g.replay()
    assert g.launched == 1


def test_a_driver_symbol_missing_disables_at_the_first_capture_with_one_warning(
    cuda_here, monkeypatch, capsys
):
    monkeypatch.setattr(tracelog, "open_log", lambda: (None, "GRAPHSAN_TRACELOG=0"))
    monkeypatch.setattr(allocator.AllocatorWatch, "start", lambda self: None)

    def walk(graph):
        raise AttributeError("module 'cuda.bindings.driver' has no attribute 'cuGraphGetNodes'")

    monkeypatch.setattr(driver, "walk", walk)
    san = started()
    assert san.active
    g = cuda_here["cls"]()
    g.capture_begin()
    g.capture_end()
    g.replay()
    assert g.launched == 1 and not san.active
    assert "has no attribute 'cuGraphGetNodes'" in san.disabled_reason
    assert capsys.readouterr().err.count("disables itself") == 1


# ----------------------------------------------------------------------------- the compiled tracker
@pytest.fixture
def cuda_torch(monkeypatch, tmp_path):
    """A torch that looks built with CUDA, whose libc10_cuda is in tmp_path."""
    (tmp_path / "libc10_cuda.so").write_text("")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    monkeypatch.setattr(tracelog, "torch_lib_dir", lambda: str(tmp_path))
    monkeypatch.setattr(tracelog, "_opened", [])
    monkeypatch.setenv("GRAPHSAN_TRACELOG", "1")  # wait for a build: the failure shows at once
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_no_compiler_is_a_reason_not_an_error(cuda_torch, monkeypatch):
    monkeypatch.setattr(tracebuild, "find_compiler", lambda: None)
    assert tracelog.open_log() == (None, "no C++ compiler ($CXX, c++ or g++)")


def test_a_read_only_cache_is_a_reason_not_an_error(cuda_torch, monkeypatch, tmp_path):
    monkeypatch.setattr(tracebuild, "find_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(tracebuild, "cuda_include_dirs", lambda: ["/cuda/include"])
    real = os.makedirs

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "cache")):
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", read_only)
    log, why = tracelog.open_log()
    assert (
        log is None and why.startswith("cannot write to ") and why.endswith("Read-only file system")
    )

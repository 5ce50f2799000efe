"""Pinned host memory that a graph's memcpy nodes read or write, judged like device memory: freed
while the graph lives, or handed to another pinned tensor (on CPU, the CUDA side faked)."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from graphsan.core.records import CopyArgs
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError, format_finding
from graphsan.report.json_report import Report
from tests import fake_cuda

SEG = fake_cuda.SEG
HOST = 0x7A00_0000_0000
PIN_SITE = [("loader.py", 12, "pin_batch")]


@pytest.fixture
def env(monkeypatch, attach):
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    state["nodes"] = [CopyArgs(0, "memcpy", [("src", HOST + 64), ("dst", SEG)])]
    return state


@pytest.fixture
def san(env, fake_sanitizer):
    s = fake_sanitizer(env, "raise")
    s.host._active = True  # start() needs CUDA; the registry does not
    return s


def capture(env):
    g = env["cls"]()
    g.capture_begin()
    g.capture_end()
    return g


def pinned_free(san, address=HOST):
    san.host.freed(address, san.host.pinned.blocks[address].token)


def test_a_memcpy_from_freed_pinned_memory_stops_the_replay_and_names_both_sites(env, san):
    san.host.note(HOST, 4096, PIN_SITE)
    g = capture(env)
    state = hooks.graph_state(g)
    assert state.counts.host == 1 and HOST in state.blocks
    g.replay()  # alive: nothing to say
    pinned_free(san)
    with pytest.raises(StaleMemoryError) as err:
        g.replay()
    assert g.launched == 1
    (f,) = err.value.findings
    assert f.kind == "freed" and f.host and f.pool == "pinned host memory"
    assert (f.param, f.address, f.block_address, f.nbytes) == ("src", HOST + 64, HOST, 4096)
    assert f.alloc_stack == tuple(PIN_SITE) and f.free_stack  # this test's frame freed it
    text = format_finding(f)
    assert "pin_memory()" in text and "loader.py:12" in text


def test_pinned_memory_handed_to_another_tensor_is_reowned(env, san, monkeypatch):
    monkeypatch.setattr(san, "policy", "record")
    san.host.note(HOST, 4096, PIN_SITE)
    g = capture(env)
    pinned_free(san)
    san.host.note(HOST, 8192, [("loader.py", 30, "next_batch")])  # the cache hands it out
    g.replay()
    (f,) = san.findings
    assert f.kind == "reowned" and f.host and "loader.py:30" in f.now


def test_a_pinned_batch_refilled_in_place_raises_nothing(env, san):
    san.host.note(HOST, 4096, PIN_SITE)
    g = capture(env)
    other = HOST + (1 << 20)
    san.host.note(other, 4096, PIN_SITE)  # another batch pinned and dropped meanwhile
    pinned_free(san, other)
    for _ in range(3):
        g.replay()
    assert g.launched == 3 and san.findings == []


def test_the_storage_finalizer_reports_the_free_only_when_the_last_alias_dies(env, san):
    t = torch.arange(1024, dtype=torch.float32)  # the registry does not care that it is pinned
    view = t[10:]
    san.host.note_tensor(t)
    address = t.untyped_storage().data_ptr()
    env["nodes"] = [CopyArgs(0, "memcpy", [("src", address), ("dst", SEG)])]
    g = capture(env)
    del t
    gc.collect()
    g.replay()  # the view keeps the storage: no free
    del view
    gc.collect()
    with pytest.raises(StaleMemoryError):
        g.replay()


def test_pinned_memory_not_seen_at_pin_time_is_found_among_live_tensors(env, san, monkeypatch):
    from graphsan.cuda import driver, hooks

    t = torch.zeros(512)
    address = t.data_ptr()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.data_ptr() == address)
    monkeypatch.setattr(driver, "is_host", lambda ptr: True)
    env["nodes"] = [CopyArgs(0, "memcpy", [("dst", address + 8), ("src", SEG)])]
    g = capture(env)
    state = hooks.graph_state(g)
    assert state.counts.host == 1 and state.blocks[address].alloc_stack == []
    del t
    gc.collect()
    with pytest.raises(StaleMemoryError) as err:
        g.replay()
    assert err.value.findings[0].host and err.value.findings[0].param == "dst"


def test_a_host_finding_round_trips_through_the_json_report(env, san, tmp_path):
    san.host.note(HOST, 4096, PIN_SITE)
    g = capture(env)
    pinned_free(san)
    with pytest.raises(StaleMemoryError):
        g.replay()
    path = tmp_path / "r.json"
    san.report().save(str(path))
    back = Report.load(str(path))
    assert back.findings == san.findings and back.findings[0].host
    data = json.loads(path.read_text())
    data["findings"][0]["host"] = "yes"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"findings\[0\]\.host is 'yes'; expected true or false"):
        Report.load(str(path))

"""The pin policy's owner search, holding and accounting, exercised on CPU tensors (the logic is
device-independent; the GPU tests check it on real graphs)."""

from __future__ import annotations

import torch

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import GraphInfo, Reference
from tests.pin_helpers import Holder, capture, fake_san, memmap_for, pinner_for


def test_owners_anywhere_are_found_and_held_after_the_user_drops_them():
    san = fake_san()
    pinner = pinner_for(san)
    obj, box = Holder(), {}
    obj.workspace = torch.randn(4096)
    box["cache"] = [torch.randn(2048)]
    expected = (obj.workspace.clone(), box["cache"][0].clone())
    ptrs = (obj.workspace.data_ptr(), box["cache"][0].data_ptr())
    state = capture(san, pinner, 1, [obj.workspace, box["cache"][0]])
    assert state.dirty  # the first replay flushes
    pinner.flush()
    obj.workspace = None  # eval clears the cache ...
    box.clear()  # ... and a dict forgets its list
    held = {s.data_ptr(): s for _, s, _ in pinner.held[1]}
    assert set(held) == set(ptrs)
    for ptr, want in zip(ptrs, expected, strict=True):
        got = torch.empty(0).set_(held[ptr]).view(want.shape)
        assert torch.equal(got, want)  # the memory is still the graph's
    summary = pinner.summary()
    assert summary["blocks"] == 2 and summary["scans"] == 1
    assert summary["retained_bytes"] == (4096 + 2048) * 4  # only the pin keeps them
    assert summary["unpinnable_blocks"] == 0
    pinner.release(1)
    assert pinner.summary()["blocks"] == 0


def test_memory_without_a_python_owner_is_unpinnable():
    san = fake_san()
    pinner = pinner_for(san)
    t = torch.randn(1024)
    m = memmap_for(t)
    fake = MemoryMap.from_snapshot(
        {
            "segments": [
                {
                    "address": 1 << 40,
                    "total_size": 4096,
                    "segment_pool_id": (0, 0),
                    "blocks": [{"address": 1 << 40, "size": 4096, "state": "active_allocated"}],
                }
            ]
        }
    )
    refs = [Reference(0, "k", 0, 0, t.data_ptr()), Reference(1, "k", 0, 0, 1 << 40)]
    merged = MemoryMap(m.segments + fake.segments)
    state = san.tracker.add_graph(GraphInfo(1, "g1", [], (1, 1), 0), refs, merged)
    pinner.pin(state)
    pinner.flush()
    s = pinner.summary()
    assert s["blocks"] == 1 and s["unpinnable_blocks"] == 1
    assert s["retained_bytes"] == 0  # t is still alive: pinning costs nothing yet


def test_one_scan_serves_every_graph_captured_since_the_last():
    san = fake_san()
    pinner = pinner_for(san)
    keep = [torch.randn(256) for _ in range(6)]
    for gid in range(1, 4):
        capture(san, pinner, gid, keep[2 * gid - 2 : 2 * gid])
    pinner.flush()
    pinner.flush()  # nothing pending: no second scan
    assert pinner.scans == 1 and pinner.summary()["blocks"] == 6


def test_a_growing_resize_of_pinned_memory_gets_a_fresh_storage():
    san = fake_san()
    pinner = pinner_for(san)
    ws = torch.arange(64, dtype=torch.float32)
    old_ptr = ws.untyped_storage().data_ptr()
    capture(san, pinner, 1, [ws])
    pinner.flush()
    assert pinner.redirect_resize(ws, (32,)) is None  # fits: resize_ will not reallocate
    out = pinner.redirect_resize(ws, (1024,))
    assert out is ws and ws.numel() == 1024
    assert ws.untyped_storage().data_ptr() != old_ptr
    assert torch.equal(ws[:64], torch.arange(64, dtype=torch.float32))
    ((_, held, _),) = pinner.held[1]
    assert held.data_ptr() == old_ptr  # the graph's memory is untouched
    assert pinner.summary()["retained_bytes"] == 64 * 4  # the owner moved away: the pin keeps it


def test_an_eval_switch_pins_before_validation_can_free():
    san = fake_san()
    pinner = pinner_for(san)
    model = torch.nn.Linear(4, 4)
    model.cache = torch.randn(512)
    ptr = model.cache.data_ptr()
    capture(san, pinner, 1, [model.cache])
    san.context.start()
    try:
        model.eval()  # no replay yet: the switch itself pins
        assert pinner.scans == 1 and not pinner.pending
        model.cache = None  # validation clears the cache: the memory stays the graph's
        assert [s.data_ptr() for _, s, _ in pinner.held[1]] == [ptr]
        model.train()  # nothing pending: no second scan
        assert pinner.scans == 1
    finally:
        san.context.stop()


def test_inputs_made_just_before_capture_are_pinned_at_capture_end():
    san = fake_san()
    pinner = pinner_for(san)
    x = torch.randn(1000)
    ptr = x.data_ptr()
    young = pinner.young_tensors()
    assert young is not None and any(o is x for o in young)
    m = memmap_for(x)
    state = san.tracker.add_graph(
        GraphInfo(1, "g1", [], (1, 1), 0), [Reference(0, "k", 0, 0, ptr)], m
    )
    pinner.pin(state, young)
    del young
    assert [s.data_ptr() for _, s, _ in pinner.held[1]] == [ptr]  # before any replay or switch
    del x  # "the input is not needed any more": the graph keeps it
    pinner.flush()  # the full scan finds nothing more to do for this block
    s = pinner.summary()
    assert s["blocks"] == 1 and s["unpinnable_blocks"] == 0 and s["retained_bytes"] == 4000


def test_an_input_young_when_the_capture_began_is_pinned_though_promoted_since(
    monkeypatch, attach, fake_sanitizer
):
    """Through the sanitizer's capture hooks: the capture's own work (here a full collection)
    promotes an input made just before it out of the young generations; the tensors listed
    when the capture began still count, so `del x` after the capture frees nothing."""
    import gc
    import weakref

    from graphsan.cuda.owners import no_collection
    from tests import fake_cuda

    env = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    cls = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    san = fake_sanitizer(env, "pin")
    san.pinner.device_type = "cpu"
    # x is young when the capture begins: no automatic collection promotes it first
    with no_collection():
        x = torch.randn(1000)
        env["map"] = memmap_for(x)
        env["nodes"] = [fake_cuda.kernel(0, x.data_ptr())]
        g = cls()
        g.capture_begin()
    gc.collect()  # x is in the oldest generation from here on
    assert not any(o is x for o in san.pinner.young_tensors() or ())
    g.capture_end()
    storage = weakref.ref(x.untyped_storage())
    del x
    assert storage() is not None, "the graph's input must be pinned at capture end"
    assert san.pinner.summary()["blocks"] == 1

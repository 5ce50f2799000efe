"""graphsan on PyTorch's own graph hooks (`graphsan.cuda.hooks.Seams`), against a CPU stand-in
of that API (tests/fake_cuda.py): what is hooked and what stays wrapped, the walk of the graph
torch hands over, a stale replay aborted by the replay-start hook, and `pin` holding through
`retain_object`."""

from __future__ import annotations

import pytest
import torch

from graphsan import sanitizer
from graphsan.core.records import FreeEvent
from graphsan.cuda import driver
from graphsan.cuda.hooks import Seams
from graphsan.report import StaleMemoryError
from tests import fake_cuda

SEG = fake_cuda.SEG


@pytest.fixture
def env(monkeypatch):
    state = fake_cuda.install(monkeypatch, "void scale(float*)", stream=1)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), seams=True)

    def not_mid_capture(stream):
        raise AssertionError("with torch's capture-end hook the walk reads the graph it hands over")

    monkeypatch.setattr(driver, "capturing_graph", not_mid_capture)
    return state


def started(policy: str):
    san = sanitizer.Sanitizer(policy)
    san.active = True  # start() needs CUDA; the hooks do not
    san.hooks.install()
    return san


def captured(env, san):
    g = env["cls"]()
    g.capture_begin()
    g.capture_end()
    return g


def test_this_torch_has_no_graph_hooks_and_graphsan_wraps_every_method():
    seams = Seams.detect()
    assert seams.names() == [] or hasattr(torch.cuda.graphs, "register_graph_capture_end_hook")
    assert seams.replay_start is None or seams.replay_end is not None


def test_with_torch_hooks_replay_is_hooked_not_wrapped_and_uninstall_undoes_both(env):
    cls = env["cls"]
    original = dict(vars(cls))
    san = started("raise")
    assert san.hooks.seams.names() == ["capture-end hook", "replay hooks", "retain_object"]
    assert vars(cls)["replay"] is original["replay"]  # torch's own hooks judge the replay
    assert vars(cls)["capture_begin"] is not original["capture_begin"]  # no hook before it
    assert {k: len(v) for k, v in cls.hooks.items()} == {
        "capture_end": 1,
        "replay_start": 1,
        "replay_end": 1,
    }
    san.hooks.uninstall()
    assert dict(vars(cls)) == original
    assert all(not v for v in cls.hooks.values())


def test_the_walk_reads_the_graph_torch_hands_over_and_a_stale_replay_never_launches(env):
    san = started("raise")
    try:
        g = captured(env, san)
        state = g.__dict__["_graphsan_state"]
        (stats,) = san.report().graphs
        assert stats["references"] == 1
        g.replay()
        assert g.launched == 1 and san.findings == []
        san.tracker.on_free(SEG, lambda: FreeEvent([("train.py", 7, "evaluate")], "eval", 5))
        env["map"] = fake_cuda.one_segment([(8192, "inactive")])
        with pytest.raises(StaleMemoryError) as err:
            g.replay()
        assert g.launched == 1, "the replay-start hook raised: torch must not launch"
        assert err.value.findings[0].kind == "freed" and state.dirty
    finally:
        san.hooks.uninstall()


def test_pin_holds_what_it_pins_through_retain_object_until_the_policy_lets_go(env):
    san = started("pin")
    try:
        owner = torch.empty(1024)  # stands for the graph's input: the pinner finds its storage
        san.pinner.device_type = "cpu"
        env["map"] = fake_cuda.one_segment([(4096, "active_allocated"), (4096, "inactive")])
        g = captured(env, san)
        state = g.__dict__["_graphsan_state"]
        (wb,) = state.blocks.values()
        wb.address = owner.untyped_storage().data_ptr()  # the block is the owner's memory
        san.pinner.flush()
        held = [obj for obj, sync in g.retained.values() if sync]
        assert [s.data_ptr() for s in held] == [owner.untyped_storage().data_ptr()]
        san.policy = "raise"  # the pins are dropped: torch no longer retains them either
        assert g.retained == {}
    finally:
        san.hooks.uninstall()

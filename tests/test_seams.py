"""graphsan on PyTorch's own graph hooks (`graphsan.cuda.hooks.Seams`), against torch 2.14.1's
hooks laid over a CPU stand-in of a graph (tests/torch_hooks.py, tests/fake_cuda.py): what is
hooked and what stays wrapped, the behaviour check that picks the attachment, the walk of the
graph torch hands over, a stale replay aborted by the graph's own replay-start hook while torch's
module-level hooks swallow, and `pin` holding through `retain_object`."""

from __future__ import annotations

import contextlib
import gc
from collections import OrderedDict

import pytest
import torch

from graphsan.core.records import FreeEvent
from graphsan.cuda import driver, hooks
from graphsan.cuda.hooks import Seams
from graphsan.report import StaleMemoryError
from tests import fake_cuda

SEG = fake_cuda.SEG


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("GRAPHSAN_ATTACH", raising=False)
    state = fake_cuda.install(monkeypatch, "void scale(float*)", stream=1)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), "torch hooks")

    def not_mid_capture(stream):
        raise AssertionError("with torch's capture-end hook the walk reads the graph it hands over")

    monkeypatch.setattr(driver, "capturing_graph", not_mid_capture)
    return state


def stale(env, san):
    """The one watched block is freed and its memory handed back."""
    san.tracker.on_free(SEG, lambda: FreeEvent([("train.py", 7, "evaluate")], "eval", 5))
    env["map"] = fake_cuda.one_segment([(8192, "inactive")])


def test_this_torch_is_attached_to_by_its_behaviour():
    """On the installed torch (2.13 or 2.14.1 in CI): hooks exactly where a raising per-graph
    replay-start hook stops the replay."""
    seams = Seams.detect()
    has_hooks = hasattr(torch.cuda.CUDAGraph, "register_replay_start_hook")
    assert seams.hooks == has_hooks
    assert hooks.start_hook_stops_replay(torch.cuda.CUDAGraph, torch.cuda.graphs) == has_hooks
    assert Seams.detect("wrap").hooks is False


def test_with_torch_hooks_replay_and_reset_are_hooked_not_wrapped_and_uninstall_undoes_all(
    env, fake_sanitizer
):
    cls = env["cls"]
    original = dict(vars(cls))
    san = fake_sanitizer(env, "raise")
    assert san.hooks.seams.names() == [
        "capture-end hook",
        "per-graph replay hooks",
        "retain_object",
    ]
    assert vars(cls)["replay"] is original["replay"] and vars(cls)["reset"] is original["reset"]
    assert vars(cls)["capture_begin"] is not original["capture_begin"]  # no hook before it
    model = cls.model
    assert {k: len(v) for k, v in model.globals.items()} == {
        "capture_start": 0,
        "capture_end": 1,  # the walk: swallowing what it raises is what graphsan wants there
        "instantiate": 0,
        "replay_start": 0,  # never: torch swallows what it raises
        "replay_end": 0,
    }
    g = fake_cuda.captured(env)
    assert len(g._replay_start_hooks) == len(g._replay_end_hooks) == 1
    captured_again = fake_cuda.captured(env)
    assert len(captured_again._replay_start_hooks) == 1
    san.hooks.uninstall()
    assert dict(vars(cls)) == original
    assert all(not v for v in model.globals.values())
    assert not g._replay_start_hooks and not g._replay_end_hooks


def test_the_walk_reads_the_graph_torch_hands_over_and_a_stale_replay_never_launches(
    env, fake_sanitizer
):
    san = fake_sanitizer(env, "raise")
    try:
        g = fake_cuda.captured(env)
        state = hooks.graph_state(g)
        (stats,) = san.report().graphs
        assert stats["references"] == 1
        g.replay()
        assert g.launched == 1 and san.findings == []
        stale(env, san)
        with pytest.raises(StaleMemoryError) as err:
            g.replay()
        assert g.launched == 1, "the replay-start hook raised: torch must not launch"
        assert err.value.findings[0].kind == "freed" and state.dirty
        with pytest.raises(StaleMemoryError):
            g.replay()  # stays blocked
        assert g.launched == 1
    finally:
        san.hooks.uninstall()


def test_a_module_level_replay_hook_would_have_stopped_nothing(env):
    """Why graphsan never judges in torch's module-level replay-start hook: torch swallows it."""
    g = fake_cuda.captured(env)
    fired = []

    def judge(graph):
        fired.append(graph)
        raise StaleMemoryError([])

    handle = torch.cuda.graphs.register_graph_replay_start_hook(judge)
    g.replay()
    handle.remove()
    assert fired == [g] and g.launched == 1


def test_a_torch_whose_graph_hooks_swallow_too_is_wrapped_and_still_stopped(
    env, monkeypatch, fake_sanitizer
):
    """A later torch that swallows per-graph hook errors as well: the behaviour check sees it,
    graphsan wraps `replay`, and a stale replay is still stopped before launch."""
    cls = env["cls"]
    swallowing = cls.replay

    def replay(self):
        hooks_now, self._replay_start_hooks = self._replay_start_hooks, OrderedDict()
        for hook in list(hooks_now.values()):
            with contextlib.suppress(Exception):
                hook(self)
        try:
            return swallowing(self)
        finally:
            self._replay_start_hooks = hooks_now

    monkeypatch.setattr(cls, "replay", replay)
    san = fake_sanitizer(env, "raise")
    try:
        assert not san.hooks.seams.hooks and vars(cls)["replay"] is not replay
        monkeypatch.setattr(
            driver, "capturing_graph", lambda stream: "graph"
        )  # wrapped: mid-capture
        g = fake_cuda.captured(env)
        g.replay()
        stale(env, san)
        with pytest.raises(StaleMemoryError):
            g.replay()
        assert g.launched == 1
    finally:
        san.hooks.uninstall()


def test_the_behaviour_check_is_not_tried_where_another_consumer_would_see_it(env):
    """Module-level replay-start hooks of someone else would be handed the stand-in graph."""
    seen = []
    handle = torch.cuda.graphs.register_graph_replay_start_hook(seen.append)
    assert not hooks.start_hook_stops_replay(env["cls"], torch.cuda.graphs)
    handle.remove()
    assert hooks.start_hook_stops_replay(env["cls"], torch.cuda.graphs)
    assert seen == []


def test_attach_wrap_takes_none_of_torchs_hooks(env, monkeypatch, fake_sanitizer):
    monkeypatch.setenv("GRAPHSAN_ATTACH", "wrap")
    cls = env["cls"]
    original = dict(vars(cls))
    san = fake_sanitizer(env, "raise")
    try:
        assert san.hooks.seams.names() == ["retain_object"]
        assert vars(cls)["replay"] is not original["replay"]
        assert not any(cls.model.globals.values())
    finally:
        san.hooks.uninstall()


def test_reset_and_collection_forget_the_graph_through_its_destroy_callback(env, fake_sanitizer):
    san = fake_sanitizer(env, "raise")
    try:
        g = fake_cuda.captured(env)
        gid = hooks.graph_state(g).info.id
        assert gid in san.tracker.graphs
        g.reset()
        assert gid not in san.tracker.graphs
        g.capture_begin()
        g.capture_end()
        gid2 = hooks.graph_state(g).info.id
        assert gid2 != gid and gid2 in san.tracker.graphs
        del g
        gc.collect()
        assert gid2 not in san.tracker.graphs
    finally:
        san.hooks.uninstall()


def test_pin_holds_what_it_pins_through_retain_object_until_the_policy_lets_go(env, fake_sanitizer):
    san = fake_sanitizer(env, "pin")
    try:
        owner = torch.empty(1024)  # stands for the graph's input: the pinner finds its storage
        san.pinner.device_type = "cpu"
        env["map"] = fake_cuda.one_segment([(4096, "active_allocated"), (4096, "inactive")])
        g = fake_cuda.captured(env)
        state = hooks.graph_state(g)
        (wb,) = state.blocks.values()
        wb.address = owner.untyped_storage().data_ptr()  # the block is the owner's memory
        san.pinner.flush()
        held = [obj for obj, sync in fake_cuda.retained(g) if sync]
        assert [s.data_ptr() for s in held] == [owner.untyped_storage().data_ptr()]
        san.policy = "raise"  # the pins are dropped: torch no longer retains them either
        assert fake_cuda.retained(g) == []
    finally:
        san.hooks.uninstall()

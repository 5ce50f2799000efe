"""The Sanitizer's capture -> event -> replay flow and its policies, on CPU: the CUDA-facing
pieces (`_driver`, the allocator view, the current stream) are replaced by fakes, so what is
tested is the orchestration: pending captures, policy decisions, de-duplication, blocking, and
disabling itself on an internal error."""

from __future__ import annotations

import pytest

from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import FreeEvent, Release
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError
from tests import fake_cuda

SEG = fake_cuda.SEG
snapshot = fake_cuda.one_segment


class FakeGraph:
    def pool(self):
        return (1, 3)


@pytest.fixture
def env(monkeypatch):
    return fake_cuda.install(monkeypatch, "void scale(float*)", stream=1)


def captured(env, policy):
    san = fake_cuda.started(env, policy, hooks=False)  # the listener's methods called directly
    g = FakeGraph()
    san.capture_begin(g, None)
    san.after_capture_end(g, san.before_capture_end(g))
    return san, g


def free_block(san, ptr=SEG):
    return san.tracker.on_free(ptr, lambda: FreeEvent([("train.py", 7, "evaluate")], "eval", 5))


def test_capture_registers_the_graph_and_its_reference(env):
    san, g = captured(env, "raise")
    state = hooks.graph_state(g)
    assert state.counts.default == 1 and not state.dirty
    (stats,) = san.report().graphs
    assert stats["nodes"] == 1 and stats["references"] == 1 and stats["pool"] == [1, 3]
    by_stage = stats["analysis_ms_by_stage"]
    assert set(by_stage) == {"walk", "allocator_view", "references", "tracker"}
    assert sum(by_stage.values()) == pytest.approx(stats["analysis_ms"], abs=0.01)
    san.before_replay(g, state)  # nothing freed: nothing happens
    assert san.findings == []


def test_raise_stops_every_later_replay_too(env):
    san, g = captured(env, "raise")
    state = hooks.graph_state(g)
    assert free_block(san)
    env["map"] = snapshot([(8192, "inactive")])
    for _ in range(2):
        with pytest.raises(StaleMemoryError) as err:
            san.before_replay(g, state)
        assert err.value.findings[0].kind == "freed"
        assert state.dirty  # blocked
    assert len(san.findings) == 1  # recorded once


def test_warn_prints_each_finding_once_and_goes_on(env, capsys):
    san, g = captured(env, "warn")
    state = hooks.graph_state(g)
    free_block(san)
    env["map"] = snapshot([(8192, "inactive")])
    san.before_replay(g, state)
    assert "FREED" in capsys.readouterr().err
    state.dirty = True
    san.before_replay(g, state)
    assert capsys.readouterr().err == ""
    env["map"] = snapshot([(2048, "active_allocated"), (6144, "inactive")])
    state.dirty = True
    san.before_replay(g, state)  # the memory got a new owner: a new, worse finding
    assert "REOWNED" in capsys.readouterr().err
    assert [f.kind for f in san.findings] == ["freed", "reowned"]


def test_reset_forgets_the_graph(env):
    san, g = captured(env, "raise")
    san.reset(g)
    assert not free_block(san)
    assert san.tracker.graphs == {}


def test_internal_error_disables_and_says_so(env, monkeypatch, capsys):
    san, g = captured(env, "raise")
    state = hooks.graph_state(g)
    free_block(san)

    def broken(device, sync=True):
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(san.memory, "view", broken)
    san.hooks.uninstall = lambda: None
    san.memory.stop = lambda: None
    san.context.stop = lambda: None
    san.before_replay(g, state)  # must not raise: the user's replay goes on
    assert not san.active and "snapshot failed" in san.disabled_reason
    assert "disables itself" in capsys.readouterr().err


def test_an_unmapped_finding_names_the_empty_cache_call_from_its_project_root(env, tmp_path):
    san, g = captured(env, "raise")
    state = hooks.graph_state(g)
    assert free_block(san)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "train.py").write_text("")
    here = str(tmp_path / "train.py")
    san.memory.last_release = Release(((here, 21, "validate"),), "eval", 5)
    env["map"] = MemoryMap.from_snapshot({"segments": []})  # the segment went back
    with pytest.raises(StaleMemoryError) as err:
        san.before_replay(g, state)
    assert "released by empty_cache() at train.py:21 (phase eval, step 5)" in str(err.value)

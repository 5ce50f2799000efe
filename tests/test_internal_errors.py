"""graphsan never takes the job down: an internal error anywhere (a failing driver call, a
malformed node, a broken callback) disables it with one warning and the program goes on."""

from __future__ import annotations

import pytest

from graphsan.core.records import CopyArgs, KernelArgs
from graphsan.cuda import driver
from tests import fake_cuda

SEG = fake_cuda.SEG


@pytest.fixture
def env(monkeypatch, attach):
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    return state


@pytest.fixture
def san(monkeypatch, env, fake_sanitizer):
    s = fake_sanitizer(env, "raise")
    monkeypatch.setattr(s.memory, "stop", lambda: None)  # start() never ran: nothing to undo
    monkeypatch.setattr(s.context, "stop", lambda: None)
    return s


def capture_and_replay(env, times=2):
    g = env["cls"]()
    g.capture_begin()
    g.capture_end()
    for _ in range(times):
        g.replay()
    return g


def boom(*args, **kwargs):
    raise RuntimeError("injected driver failure")


def test_a_failing_driver_call_disables_with_one_warning(env, san, monkeypatch, capsys):
    monkeypatch.setattr(driver, "walk", boom)
    g = capture_and_replay(env)
    assert g.launched == 2, "the program's replays run"
    assert not san.active and "injected driver failure" in san.disabled_reason
    assert capsys.readouterr().err.count("disables itself") == 1


@pytest.mark.parametrize(
    "node",
    [
        KernelArgs(0, "void k(float*)", b"\x01\x02\x03", [0, 8, 16]),  # buffer shorter than params
        KernelArgs(0, "void k(float*)", None, [0]),  # no bytes at all
        CopyArgs(0, "memcpy", [("src", None)]),  # an address that is not a number
    ],
    ids=["short-buffer", "no-buffer", "bad-address"],
)
def test_a_malformed_node_is_skipped_or_disables_and_the_program_goes_on(env, san, node, capsys):
    env["nodes"] = [node]
    g = capture_and_replay(env)
    assert g.launched == 2
    err = capsys.readouterr().err
    assert err.count("graphsan:") <= 1 and "Traceback" not in err
    assert san.active or "disables itself" in err


def test_a_failing_check_at_replay_disables_and_the_replay_runs(env, san, monkeypatch, capsys):
    g = env["cls"]()
    g.capture_begin()
    g.capture_end()
    san.tracker.on_free(SEG, lambda: fake_cuda_free_event())
    monkeypatch.setattr(san.memory, "view", boom)  # the allocator view cannot be read
    g.replay()
    g.replay()
    assert g.launched == 2 and not san.active
    assert capsys.readouterr().err.count("disables itself") == 1


def test_a_broken_free_callback_never_breaks_the_free(env, san, monkeypatch, capsys):
    g = capture_and_replay(env, times=0)  # kept: a collected graph is forgotten
    san.memory._active = True
    monkeypatch.setattr(san.tracker, "on_free", boom)
    san.memory._on_free(SEG)  # what the allocator's free calls: it must return
    san.memory._on_free(SEG)  # a second error (another thread, a callback in flight) stays quiet
    assert not san.active and g.launched == 0
    assert capsys.readouterr().err.count("disables itself") == 1


def fake_cuda_free_event():
    from graphsan.core.records import FreeEvent

    return FreeEvent([("train.py", 7, "step")], "train", 1)

"""graphsan under threads (on CPU, the CUDA side faked): a `graphsan.label` block names only the
graphs its own thread captures, a phase block that ends removes its own entry whichever thread
opened one since, and threads capturing, replaying and forgetting graphs at once leave the
sanitizer's state whole, under every policy, within a time limit."""

from __future__ import annotations

import threading

import pytest

import graphsan
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError
from tests import fake_cuda


@pytest.fixture
def env(monkeypatch, attach):
    state = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    return state


def test_a_label_names_only_the_graphs_of_its_own_thread(env, fake_sanitizer, monkeypatch):
    san = fake_sanitizer(env, "raise")
    monkeypatch.setattr(graphsan, "_current", san)
    opened, done = threading.Event(), threading.Event()
    theirs = []

    def labelled():
        with graphsan.label("loader"):
            opened.set()
            done.wait(10)
            theirs.append(fake_cuda.captured(env))

    t = threading.Thread(target=labelled)
    t.start()
    assert opened.wait(10)
    # begun on this thread while the other thread's label block is open
    mine = fake_cuda.captured(env)
    done.set()
    t.join(10)
    assert hooks.graph_state(theirs[0]).info.label == "loader"
    assert hooks.graph_state(mine).info.label != "loader"
    with graphsan.label("main"):
        assert hooks.graph_state(fake_cuda.captured(env)).info.label == "main"


def test_a_phase_block_removes_its_own_entry_when_threads_interleave():
    from graphsan.cuda.context import Context

    ctx = Context()
    first, second = ctx.phase("validation"), ctx.phase("prefetch")
    first.__enter__()  # thread A
    second.__enter__()  # thread B, while A's block is open
    first.__exit__(None, None, None)  # A ends first
    assert ctx.current()[0] == "prefetch"
    second.__exit__(None, None, None)
    assert ctx._explicit == []


@pytest.mark.parametrize("policy", ["raise", "warn", "record", "pin"])
def test_threads_capturing_replaying_and_forgetting_at_once_keep_the_state_whole(
    env, fake_sanitizer, monkeypatch, policy, capsys
):
    """Eight threads, each capturing, replaying and dropping its graphs while the others do; one
    block of the shared segment is freed half way (every graph reads it). Every replay before
    the free is quiet, every one after it is judged stale (raised, or recorded once per graph),
    no internal error, and every thread ends within the limit (a deadlock fails here)."""
    san = fake_sanitizer(env, policy)
    monkeypatch.setattr(san.memory, "stop", lambda: None)
    monkeypatch.setattr(san.context, "stop", lambda: None)
    freed = threading.Event()
    lock = threading.Lock()
    seen = {"quiet_before": 0, "stale_after": 0, "wrong": []}
    barrier = threading.Barrier(9)

    def work(k: int):
        barrier.wait(10)
        for r in range(40):
            g = fake_cuda.captured(env)
            stale_now = freed.is_set()  # the block was freed before this graph was captured
            for _ in range(3):
                try:
                    g.replay()
                    outcome = "ran"
                except StaleMemoryError:
                    outcome = "raised"
                with lock:
                    if not stale_now and not freed.is_set():
                        if outcome != "ran":
                            seen["wrong"].append((k, r, "a replay before the free raised"))
                        else:
                            seen["quiet_before"] += 1
            del g

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(8)]
    for t in threads:
        t.start()
    barrier.wait(10)
    env["map"] = fake_cuda.one_segment([(4096, "inactive"), (4096, "inactive")])
    with lock:
        freed.set()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread is still running: a deadlock"
    assert san.disabled_reason is None, san.disabled_reason
    assert seen["wrong"] == [], seen["wrong"][:5]
    # after the free, graphs captured over the freed block and still replayed are found
    g = fake_cuda.captured(env)
    if policy == "raise" or policy == "pin":  # pin cannot pin memory freed before the capture
        with pytest.raises(StaleMemoryError):
            g.replay()
    else:
        g.replay()
        assert san.findings, "a replay over freed memory after the threads ended is found"
    assert len({f.graph.id for f in san.findings}) == len(san.findings) or policy == "raise"

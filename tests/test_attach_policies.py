"""Every policy through both attachments (tests/fake_cuda.py: graphsan's wrappers, and torch
2.14.1's hooks, whose module-level hooks swallow what they raise): a freed input, a replay out of
its pool's order and an output overwritten while the caller holds it each end as the policy says,
before the launch where it stops the replay."""

from __future__ import annotations

import pytest

from graphsan.core.records import FreeEvent
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError
from tests import fake_cuda

SEG, SLOT, POOL = fake_cuda.SEG, 4096, (1, 3)
B, C, D, E = (SEG + i * SLOT for i in range(4))
POLICIES = ("raise", "pin", "warn", "record")


@pytest.fixture(params=POLICIES)
def san(request, monkeypatch, attach, fake_sanitizer):
    env = fake_cuda.install(monkeypatch, "void k(float*)", stream=1)
    env["map"] = fake_cuda.one_segment([(SLOT, "active_allocated")] * 4, pool=POOL)
    cls = fake_cuda.graph_class(monkeypatch, POOL, attach)
    s = fake_sanitizer(env, request.param)
    if s.pinner is not None:
        s.pinner.device_type = "cpu"  # nothing here has a Python owner: pin falls back to raise

    def capture(nodes, carves):
        g = cls()
        env["nodes"], env["carves"] = nodes, [(a, SLOT, None) for a in carves]
        g.capture_begin(POOL)
        g.capture_end()
        return g

    s.test_env, s.test_capture = env, capture
    return s


def ends_as_the_policy_says(san, g, kind, capsys):
    launched = g.launched
    if san.policy.stops_replay:
        with pytest.raises(StaleMemoryError) as err:
            g.replay()
        assert g.launched == launched, "a stopped replay must not launch"
        assert [f.kind for f in err.value.findings] == [kind]
    else:
        g.replay()
        g.replay()
        assert g.launched == launched + 2
    assert [f.kind for f in san.findings] == [kind]  # recorded once, however often replayed
    printed = capsys.readouterr().err.count(kind.upper())
    assert printed == (1 if san.policy == "warn" else 0)


def test_a_freed_input(san, capsys):
    env, k = san.test_env, fake_cuda.kernel
    env["map"] = fake_cuda.one_segment([(SLOT, "active_allocated"), (SLOT, "inactive")])
    g = san.test_capture([k(0, SEG)], [])  # an input of the default pool
    g.replay()
    san.tracker.on_free(SEG, lambda: FreeEvent([("eval.py", 3, "validate")], "eval", 2))
    env["map"] = fake_cuda.one_segment([(2 * SLOT, "inactive")])
    ends_as_the_policy_says(san, g, "freed", capsys)


def test_a_replay_out_of_its_pools_order(san, capsys):
    k = fake_cuda.kernel
    g0 = san.test_capture([k(0, B, C, D)], [B, C, D])
    g1 = san.test_capture([k(0, C, E)], [E])
    g2 = san.test_capture([k(0, D), k(1, C)], [C])
    g0.replay(), g1.replay(), g2.replay()
    g0.replay(), g2.replay()
    ends_as_the_policy_says(san, g1, "replay-order", capsys)


def test_an_output_the_caller_holds(san, capsys):
    k = fake_cuda.kernel
    f0 = san.test_capture([k(0, B, C)], [B, C])
    b0 = san.test_capture([k(0, B, D)], [D])
    san.tracker.on_free(C, lambda: FreeEvent([("graph.py", 3, "reuse")], "train", 1))
    f1 = san.test_capture([k(0, C, E)], [C, E])
    for g in (f0, b0, f1):
        g.replay()
    f0.replay()
    ends_as_the_policy_says(san, f1, "live-output", capsys)


def race_pair(san):
    """Graph a carves b and c (its scratch c dies in its capture), graph b carves its output
    from c: their memory overlaps, whatever stream each replays on."""
    k = fake_cuda.kernel
    a = san.test_capture([k(0, B, C)], [B, C])
    san.tracker.on_free(C, lambda: FreeEvent([("graph.py", 3, "scratch")], "train", 1))
    b = san.test_capture([k(0, C, D)], [C, D])
    return a, b


def test_a_replay_that_may_run_beside_another_on_a_second_stream(san, capsys):
    env = san.test_env
    a, b = race_pair(san)
    env["stream"] = (0, 1)
    a.replay()
    env["stream"], env["busy"] = (0, 2), {(0, 1)}  # a's stream still runs it
    ends_as_the_policy_says(san, b, "replay-race", capsys)
    (f,) = san.findings
    assert f.order.written_by == hooks.graph_state(a).info.id and f.order.streams == (2, 1)
    assert (f.block_address, f.nbytes) == (C, SLOT) and "may still run" in f.now


@pytest.mark.parametrize("how", ["same stream", "waited", "done", "host waited"])
def test_a_replay_ordered_after_the_other_is_quiet(san, how):
    env = san.test_env
    order = san.judge.races.ordering
    a, b = race_pair(san)
    env["stream"] = (0, 1)
    a.replay()
    if how == "waited":  # s2.wait_stream(s1): an event recorded on s1, waited for on s2
        order.recorded("e", (0, 1))
        order.waited((0, 2), "e")
    elif how == "host waited":
        order.host_waited_for_all()
    if how != "same stream":
        env["stream"] = (0, 2)
    env["busy"] = set() if how == "done" else {(0, 1)}
    launched = b.launched
    b.replay()
    assert b.launched == launched + 1 and san.findings == []

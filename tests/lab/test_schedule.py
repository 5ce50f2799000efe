"""Microbatch schedules (graphsan.lab.choices): the orders, their checks, the trainer's options,
and an eager 1F1B run on CPU against the sequential one."""

from __future__ import annotations

import pytest

from graphsan.lab.choices import StatePolicy, check_order, schedule_order
from graphsan.lab.train.config import ConfigError, TrainConfig


def test_sequential_and_1f1b_orders():
    assert schedule_order("sequential", 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert schedule_order("1f1b", 4, 2) == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)
    ]  # fmt: skip
    assert schedule_order("1f1b", 2, 5) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert schedule_order("1f1b", 3, 1) == schedule_order("sequential", 3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_every_order_runs_each_forward_once_before_its_backward(n, in_flight):
    for kind in ("sequential", "1f1b"):
        order = schedule_order(kind, n, in_flight)
        assert check_order(order, n) is order
        # never more microbatches holding activations than allowed
        held = peak = 0
        for p, _ in order:
            held += 1 if p == "F" else -1
            peak = max(peak, held)
        assert peak == (1 if kind == "sequential" else min(in_flight, n))


@pytest.mark.parametrize(
    "order",
    [
        [("B", 0), ("F", 0)],
        [("F", 0), ("F", 0), ("B", 0)],
        [("F", 0), ("B", 0), ("F", 2), ("B", 2)],
        [("F", 0)],
        [("X", 0), ("B", 0)],
    ],
)
def test_a_broken_order_is_refused_with_the_pass_named(order):
    with pytest.raises(ValueError, match="expected"):
        check_order(order, 2)


def test_bad_schedule_options_name_the_option():
    with pytest.raises(ConfigError, match="--microbatch-schedule 2f2b: expected one of"):
        TrainConfig(microbatch_schedule="2f2b", device="cpu").validate()
    with pytest.raises(ConfigError, match="--capture-schedule zigzag"):
        TrainConfig(capture_schedule="zigzag", device="cpu").validate()
    with pytest.raises(ConfigError, match="--microbatches-in-flight 0: expected > 0"):
        TrainConfig(microbatches_in_flight=0, device="cpu").validate()
    with pytest.raises(ValueError, match="--state-policy nope: expected one of fixed, te218"):
        StatePolicy.parse("nope")
    assert StatePolicy.parse("te218") is StatePolicy.TE218 == "te218"


def test_eager_1f1b_trains_like_the_sequential_schedule_on_cpu():
    """The same microbatches and gradients in another order: the first loss is the same, later
    ones differ only by the order of gradient accumulation."""
    from graphsan.lab.train import train

    base = dict(
        preset="tiny",
        quiet=True,
        device="cpu",
        train_iters=3,
        seq_length=64,
        micro_batch_size=1,
        global_batch_size=3,
    )
    seq = train(TrainConfig(**base))
    one = train(TrainConfig(microbatch_schedule="1f1b", **base))
    assert seq.losses[0] == one.losses[0]
    for a, b in zip(seq.losses, one.losses, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (seq.losses, one.losses)

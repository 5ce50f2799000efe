"""The policy type and the sanitizer's ownership of the pin policy's objects (no GPU needed)."""

from __future__ import annotations

import pytest

import graphsan
from graphsan.policies import POLICIES, Policy
from graphsan.runtime.sanitizer import Sanitizer


def pin_is_attached(san: Sanitizer) -> bool:
    p = san.pinner
    return (
        p is not None
        and san.memory.resizes_redirected_to == p.redirect_resize
        and p._flush_quietly in san.context.on_phase_change
    )


def test_one_policy_type_names_every_choice():
    assert POLICIES == ("raise", "warn", "record", "pin") == graphsan.POLICIES
    assert Policy("pin") is Policy.PIN and Policy.PIN == "pin" and f"{Policy.PIN}" == "pin"
    assert [p.stops_replay for p in Policy] == [True, False, False, True]
    with pytest.raises(ValueError, match="unknown policy 'block'; expected one of raise, warn"):
        Policy.parse("block")


def test_a_sanitizer_built_with_pin_pins():
    san = Sanitizer("pin")
    assert san.policy is Policy.PIN and pin_is_attached(san)


@pytest.mark.parametrize("other", ["raise", "warn", "record"])
def test_switching_away_from_pin_detaches_the_pinner(other):
    san = Sanitizer("pin")
    pinner = san.pinner
    san.policy = other
    assert san.policy == other and san.pinner is None
    assert san.memory.resizes_redirected_to is None
    assert pinner._flush_quietly not in san.context.on_phase_change
    san.policy = "pin"  # and back: a fresh pinner, attached
    assert pin_is_attached(san) and san.pinner is not pinner


def test_other_policies_have_no_pinner():
    for policy in ("raise", "warn", "record"):
        assert Sanitizer(policy).pinner is None


def test_an_unknown_policy_is_refused_by_the_sanitizer():
    with pytest.raises(ValueError, match="unknown policy"):
        Sanitizer("pinned")
    san = Sanitizer("raise")
    with pytest.raises(ValueError, match="unknown policy"):
        san.policy = "stop"
    assert san.policy is Policy.RAISE

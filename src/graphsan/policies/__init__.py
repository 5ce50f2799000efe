"""What the sanitizer does with a replay's findings: the one `Policy` type and what each policy
does (`act`), with no torch (the CLI and the pytest plugin read it before anything heavy loads).
The pin policy's machinery, which keeps memory alive before a replay is judged, is
`policies.pin`."""

from __future__ import annotations

from collections.abc import Callable

from graphsan.core.choice import Choice
from graphsan.core.records import Finding
from graphsan.report import StaleMemoryError, format_finding


class Policy(Choice):
    """A `str`, so `policy == "raise"` and JSON keep working."""

    RAISE = "raise"  # `StaleMemoryError` from replay(); the graph is not launched
    WARN = "warn"  # each finding printed once; the replay goes on
    RECORD = "record"  # findings only collected
    PIN = "pin"  # keep referenced memory alive; what cannot be pinned raises

    @property
    def stops_replay(self) -> bool:
        """Whether a finding stops the replay (pin falls back to raise for what it could not
        keep alive)."""
        return self in (Policy.RAISE, Policy.PIN)

    @classmethod
    def parse(cls, value: str | Policy, what: str = "policy") -> Policy:
        """The policy named `value`; a ValueError naming the choices otherwise."""
        return super().parse(value, what)

    @classmethod
    def unknown(cls, value: object, what: str) -> str:
        """graphsan's own error, prefixed, with the value quoted (it may come from a variable)."""
        return f"graphsan: unknown {what} {value!r}; expected one of {', '.join(cls.values())}"


POLICIES = Policy.values()


def act(
    policy: Policy, findings: list[Finding], new: list[Finding], say: Callable[[str], None]
) -> None:
    """What `policy` does with a replay's `findings` (`new`: those not reported before): raise
    and pin stop the replay before launch (`StaleMemoryError`; pin's findings are what it could
    not keep alive), warn prints each new finding once and lets the replay go on, record only
    keeps them."""
    if not findings:
        return
    if policy.stops_replay:
        raise StaleMemoryError(findings)
    if policy is Policy.WARN:
        for f in new:
            say(format_finding(f))

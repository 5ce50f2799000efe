"""What the sanitizer does with findings: the one `Policy` type (no torch: the CLI and the pytest
plugin read it before anything heavy loads). The pin policy's machinery is `policies.pin`."""

from __future__ import annotations

from graphsan.core.choice import Choice


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

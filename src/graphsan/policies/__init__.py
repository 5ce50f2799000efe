"""What the sanitizer does with findings: the one `Policy` type (no torch: the CLI and the pytest
plugin read it before anything heavy loads). The pin policy's machinery is `policies.pin`."""

from __future__ import annotations

from enum import Enum


class Policy(str, Enum):
    """A `str`, so `policy == "raise"` and JSON keep working."""

    RAISE = "raise"  # `StaleMemoryError` from replay(); the graph is not launched
    WARN = "warn"  # each finding printed once; the replay goes on
    RECORD = "record"  # findings only collected
    PIN = "pin"  # keep referenced memory alive; what cannot be pinned raises

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def stops_replay(self) -> bool:
        """Whether a finding stops the replay (pin falls back to raise for what it could not
        keep alive)."""
        return self in (Policy.RAISE, Policy.PIN)

    @classmethod
    def parse(cls, value: str | Policy, what: str = "policy") -> Policy:
        """The policy named `value`; a ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"graphsan: unknown {what} {value!r}; expected one of {', '.join(POLICIES)}"
            ) from None


POLICIES = tuple(p.value for p in Policy)

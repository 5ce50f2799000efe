"""`Choice`: the base of graphsan's named choices (finding kinds, policies, the lab's state
policies and schedules), each a `str` so comparisons with plain strings and JSON keep working."""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A `str` enum that prints as its bare value and parses with one error naming the choices."""

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every choice's value, in definition order."""
        return tuple(c.value for c in cls)

    @classmethod
    def parse(cls, value: str | Choice, what: str):
        """The choice named `value`; a ValueError whose message is `unknown(value, what)`."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(cls.unknown(value, what)) from None

    @classmethod
    def unknown(cls, value: object, what: str) -> str:
        """The error for a value that names no choice, e.g. "--preset huge: expected one of
        tiny, small, super"."""
        return f"{what} {value}: expected one of {', '.join(cls.values())}"

"""Attributes graphsan sets on other code's objects (torch's classes and modules), and their
restoration: one helper for every wrapper graphsan installs, so each `stop()` undoes exactly
what its `start()` did (pure: nothing here knows torch)."""

from __future__ import annotations

_ABSENT = object()  # the attribute was not the owner's own (inherited, or not there at all)


class Patches:
    """`set` replaces an attribute and remembers what the owner itself held; `restore` puts
    every one back in reverse order (an inherited attribute is deleted again, so the base's
    shows through). `restore` is idempotent, and patches set after it are restored next time."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def set(self, owner: object, name: str, value: object) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _ABSENT)))
        setattr(owner, name, value)

    def restore(self) -> None:
        while self._saved:
            owner, name, orig = self._saved.pop()
            if orig is _ABSENT:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, orig)

    def __bool__(self) -> bool:
        return bool(self._saved)

    def __len__(self) -> int:
        return len(self._saved)

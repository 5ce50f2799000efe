"""A memory watch for the replay judge's tests, without torch (`core.memory_source.MemorySource`):
the test sets what the allocator holds now (`now`), which addresses are unmapped, what device
memory a pointer table holds (`device`), and whether frees are found by asking before every
replay (`judges_every_replay`, as the driver's watch does); the fake records what was asked."""

from __future__ import annotations

from collections.abc import Callable

from graphsan.core.memory_map import MemoryMap


class FakeMemory:
    last_release = None

    def __init__(
        self,
        now: MemoryMap | None = None,
        judges_every_replay: bool = False,
        knows_mapping: bool = True,
        knows_holders: bool = True,
    ) -> None:
        self.now = now if now is not None else MemoryMap.from_snapshot({"segments": []})
        self.judges_every_replay = judges_every_replay
        self.knows_mapping, self.knows_holders = knows_mapping, knows_holders
        self.unmapped: set[int] = set()
        self.device: dict[int, bytes] = {}  # address -> the bytes there
        self.on_prepare: Callable[[object], None] = lambda state: None
        self.asked: list[str] = []
        self.kept: list = []

    def prepare(self, state) -> None:
        self.asked.append("prepare")
        self.on_prepare(state)

    def view(self, device: int) -> MemoryMap:
        self.asked.append("view")
        return self.now

    def held(self, device: int):
        return (lambda: self.now) if self.knows_holders else None

    @property
    def mapped(self):
        if not self.knows_mapping:
            return None
        return lambda ptr: not any(a <= ptr < a + 4096 for a in self.unmapped)

    def read_device(self, spans) -> list[bytes]:
        self.asked.append("read_device")
        return [self.device.get(a, b"")[:n] for a, n in spans]

    def keep_alive(self, own) -> int:
        self.kept += list(own)
        return len(own)

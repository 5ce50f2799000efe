"""Tensors eager code allocated into a graph's pool over memory a capture of that pool carved
(pure: no CUDA, no torch).

A capture's temporaries go back to its pool when the capture frees them, and the graph writes
there again at every replay. Eager code routed into the pool (`torch.cuda.use_mem_pool`, the
allocator's begin-allocate-to-pool calls) can be handed that memory; while it holds the tensor, a
replay of the graph writes over it. `EagerInPools` marks such a tensor on every graph whose carves
it overlaps. A replay of a marked graph asks the allocator (the adapter's half) whether the block
is still allocated: then it is a `live-output` finding; if not, the mark goes. A later capture
that carves the memory proves the tensor went (the allocator hands out only free memory) and
clears the marks there.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from graphsan.core.records import DataPtr, GraphId, PoolId

Key = tuple[int, PoolId]  # (device, pool)


@dataclass(frozen=True)
class EagerTensor:
    """A block eager code allocated into the pool at [start, start + size), over memory `writer`
    carved; `site` is its allocation stack as the adapter recorded it, `phase` and `step` the
    training phase and step it was allocated in."""

    writer: GraphId
    start: DataPtr
    size: int
    site: object = None
    phase: str | None = None
    step: int | None = None

    @property
    def end(self) -> DataPtr:
        return self.start + self.size

    @property
    def when(self) -> str:
        """ " in phase P, step S" as far as known, or ""."""
        parts = [f"phase {self.phase}"] if self.phase else []
        parts += [f"step {self.step}"] if self.step is not None else []
        return f" in {', '.join(parts)}" if parts else ""


class EagerInPools:
    """Per (device, pool), the ranges its graphs carved; per graph, the eager tensors in them."""

    def __init__(self) -> None:
        # (start, end, graph) sorted per pool, and the longest range (how far back to look)
        self._carves: dict[Key, list[tuple[DataPtr, DataPtr, GraphId]]] = {}
        self._longest: dict[Key, int] = {}
        self._of: dict[GraphId, tuple[Key, list[tuple[DataPtr, DataPtr]]]] = {}
        self.marks: dict[GraphId, dict[DataPtr, EagerTensor]] = {}

    def add_capture(
        self, gid: GraphId, device: int, pool: PoolId, carved: list[tuple[DataPtr, int, object]]
    ) -> None:
        """`gid` carved `carved` ((address, size, site)) in its own pool `pool`."""
        ranges = [(a, a + n) for a, n, _ in carved if n > 0]
        if not ranges:
            return
        key = (device, pool)
        if self.marks:
            for start, end in ranges:
                self._clear(key, start, end)
        lst = self._carves.setdefault(key, [])
        for start, end in ranges:
            bisect.insort(lst, (start, end, gid))
        self._longest[key] = max(self._longest.get(key, 0), max(e - s for s, e in ranges))
        self._of[gid] = (key, ranges)

    def allocated(
        self,
        device: int,
        pool: PoolId,
        start: DataPtr,
        size: int,
        site: object = None,
        phase: str | None = None,
        step: int | None = None,
    ) -> list[GraphId]:
        """Eager code was handed [start, start + size) of `pool`: each graph that carved memory
        there gets the tensor marked (a newer tensor at the same address replaces the older).
        Returns those graphs, whose next replay must ask."""
        key = (device, pool)
        lst = self._carves.get(key)
        if not lst or size <= 0:
            return []
        gids = list(
            dict.fromkeys(g for _, _, g in self._overlapping(key, lst, start, start + size))
        )
        for gid in gids:
            mark = EagerTensor(gid, start, size, site, phase, step)
            self.marks.setdefault(gid, {})[start] = mark
        return gids

    def marked(self, gid: GraphId) -> list[EagerTensor]:
        """The eager tensors marked in `gid`'s carves."""
        marks = self.marks.get(gid)
        return list(marks.values()) if marks else []

    def gone(self, tensor: EagerTensor) -> None:
        """The allocator no longer holds `tensor`'s block: its mark goes."""
        marks = self.marks.get(tensor.writer)
        if marks is not None and marks.get(tensor.start) == tensor:
            del marks[tensor.start]
            if not marks:
                del self.marks[tensor.writer]

    def forget(self, gid: GraphId) -> None:
        """The graph is gone: its carves and marks go."""
        self.marks.pop(gid, None)
        entry = self._of.pop(gid, None)
        if entry is None:
            return
        key, ranges = entry
        lst = self._carves[key]
        for start, end in ranges:
            i = bisect.bisect_left(lst, (start, end, gid))
            if i < len(lst) and lst[i] == (start, end, gid):
                del lst[i]
        if not lst:
            del self._carves[key], self._longest[key]

    def _overlapping(self, key: Key, lst: list, start: DataPtr, end: DataPtr):
        i = bisect.bisect_left(lst, (start - self._longest[key],))
        while i < len(lst) and lst[i][0] < end:
            if lst[i][1] > start:
                yield lst[i]
            i += 1

    def _clear(self, key: Key, start: DataPtr, end: DataPtr) -> None:
        """A capture of the pool carved [start, end): the eager tensors there went back."""
        for gid, marks in list(self.marks.items()):
            if self._of.get(gid, (None,))[0] != key:
                continue
            for t in [t for t in marks.values() if t.start < end and t.end > start]:
                self.gone(t)

"""Allocation sites: where each live block was allocated, recorded by the GPU-trace allocation
callback as raw (code, instruction offset) pairs and turned into frames only for the blocks a
graph references.

Every allocation pays for the walk, so it is written out frame by frame (`walk`). A new site
stays a plain tuple until `INTERN_BATCH` allocations later; only those still alive then are
interned, one tuple per call path, so temporaries never pay for the interning. (The allocator's
own stacks need torch's symbolizer, whose first use in a process costs seconds.)
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from graphsan.core.records import Frame
from graphsan.cuda.context import user_frames

# Frames kept per allocation stack (innermost first while walking; user frames are picked later):
# the innermost 24 reach the user's code through torch's call wrappers.
SITE_DEPTH = 24
Site = tuple  # (code, instruction offset, code, instruction offset, ...), innermost first
INTERN_BATCH = 1024


def _unrolled_walk(depth: int) -> Callable[[FrameType], Site]:
    """A function of a frame giving the call path from it outwards: (code, instruction offset)
    of at most `depth` frames, innermost first. Written out frame by frame, without a loop or a
    list, because every allocation runs it and those were a large part of a loop's cost."""

    def pairs(n: int) -> str:
        return ", ".join(f"f{i}.f_code, f{i}.f_lasti" for i in range(n))

    src = ["def walk(frame):", "    f0 = frame"]
    for i in range(1, depth):
        src += [
            f"    f{i} = f{i - 1}.f_back",
            f"    if f{i} is None:",
            f"        return ({pairs(i)},)",
        ]
    src.append(f"    return ({pairs(depth)},)")
    namespace: dict[str, Any] = {}
    exec("\n".join(src), namespace)
    return namespace["walk"]


walk = _unrolled_walk(SITE_DEPTH)


def _line(code: CodeType, lasti: int) -> int:
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line or 0
    return code.co_firstlineno


def site_frames(site: Site | None) -> list[Frame]:
    """A recorded allocation stack as frames, outermost first, user frames only."""
    if not site:
        return []
    frames = [
        (code.co_filename, _line(code, lasti), code.co_name)
        for code, lasti in zip(site[0::2], site[1::2], strict=True)
    ]
    frames.reverse()
    return user_frames(frames)


class AllocSites:
    """The allocation site of each live block. The allocation callback writes `by_address` and
    `fresh` itself (the hot path: no call into this class per allocation)."""

    def __init__(self) -> None:
        self.by_address: dict[int, Site] = {}  # live block address -> its allocation stack
        self.fresh: list[int] = []  # addresses whose site may not be interned yet
        self._interned: dict[tuple, Site] = {}  # code ids and offsets -> the site

    def of_frame(self, frame: FrameType) -> Site:
        """This call path as an interned tuple."""
        return self.intern(walk(frame))

    def intern(self, site: Site) -> Site:
        """The one tuple kept for this call path. The key is built from code ids (hashing a code
        object hashes its contents); the kept tuple holds the code objects, which keeps the ids
        valid."""
        return self._interned.setdefault((*map(id, site[0::2]), *site[1::2]), site)

    def intern_fresh(self) -> None:
        """Intern the sites of the latest allocations still alive. Another thread may free or
        reallocate an address meanwhile: a site is only put back where no newer one was stored."""
        fresh, self.fresh = self.fresh, []
        sites = self.by_address
        for ptr in fresh:
            raw = sites.get(ptr)
            if raw is None:
                continue
            site = self.intern(raw)
            if sites.get(ptr) is raw:  # the entry is never absent, so readers never miss it
                sites[ptr] = site

    def at(self, address: int) -> Site | None:
        """The interned site of the live block at `address`, if one was recorded."""
        site = self.by_address.get(address)
        return self.intern(site) if site is not None else None

    def clear(self) -> None:
        self.by_address.clear()
        self.fresh.clear()
        self._interned.clear()

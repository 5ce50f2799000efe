"""The site walks `bench/bench_alloc_callbacks.py --ideas` times beside graphsan's own: a plain
loop, the keyed loop with hoisted lookups, a probe before an unchecked unrolled walk, an outer
part cached by frame identity (unsound: `outer_cache_mistakes` counts its wrong sites), a sampled
walk, and `WalkOnly`, the allocation callback that records a site with any of them."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable

from graphsan.core.tracker import Tracker
from graphsan.cuda import sites


def walk_loop(frame, interned=None):
    """The path as a plain loop builds it (interned later, as now)."""
    path = []
    f = frame
    for _ in range(sites.SITE_DEPTH):
        if f is None:
            break
        path.append(f.f_code)
        path.append(f.f_lasti)
        f = f.f_back
    return tuple(path)


def keyed_loop_aliases(frame, interned):
    """The keyed walk with its method lookups hoisted out of the loop."""
    key = []
    append = key.append
    f = frame
    for _ in range(sites.SITE_DEPTH):
        if f is None:
            break
        append(id(f.f_code))
        append(f.f_lasti)
        f = f.f_back
    key = tuple(key)
    site = interned.get(key)
    if site is None:
        site = interned[key] = walk_loop(frame)
    return site


def probe_then_unrolled(frame, interned):
    """The unrolled walk without its per-frame end checks, after `sys._getframe` says the stack
    is deep enough (its frame count includes this function and the callback's)."""
    try:
        sys._getframe(sites.SITE_DEPTH + 1)
    except ValueError:
        return walk_loop(frame)
    return _UNCHECKED(frame)


def _unchecked(depth: int):
    src = ["def walk(frame):", "    f0 = frame"]
    src += [f"    f{i} = f{i - 1}.f_back" for i in range(1, depth)]
    src.append("    return (" + ", ".join(f"f{i}.f_code, f{i}.f_lasti" for i in range(depth)) + ")")
    namespace: dict = {}
    exec("\n".join(src), namespace)
    return namespace["walk"]


_UNCHECKED = _unchecked(sites.SITE_DEPTH)


class OuterCache:
    """Cache the outer part of the path by the identity of the frame `inner` frames down,
    checked by its code and offset: cheaper, but not sound (a dead frame's address is reused by
    the next frame object, whose callers may differ; a generator's caller changes)."""

    def __init__(self, inner: int = 6) -> None:
        self.inner = inner
        self.cache: dict[int, tuple] = {}

    def __call__(self, frame, interned):
        path = []
        f = frame
        for _ in range(self.inner):
            if f is None:
                return tuple(path)
            path += (f.f_code, f.f_lasti)
            f = f.f_back
        if f is None:
            return tuple(path)
        hit = self.cache.get(id(f))
        if hit is not None and hit[0] is f.f_code and hit[1] == f.f_lasti:
            rest = hit[2]
        else:
            rest = walk_loop(f)[: 2 * (sites.SITE_DEPTH - self.inner)]
            self.cache[id(f)] = (f.f_code, f.f_lasti, rest)
        return tuple(path) + rest


def _shared(fire, ptr, n=6):  # the frame the outer-part cache keys by, reached from two callers
    if n:
        return _shared(fire, ptr, n - 1)
    return fire(ptr)


def _caller_one(fire, ptr):
    return _shared(fire, ptr)


def _caller_two(fire, ptr):
    return _caller_two_inner(fire, ptr)


def _caller_two_inner(fire, ptr):
    return _shared(fire, ptr)


def outer_cache_mistakes(calls: int = 200) -> int:
    """Allocations from two callers of one function, in random order: how many sites the
    outer-part cache gets wrong."""
    cache, wrong, rng = OuterCache(), 0, random.Random(0)
    for i in range(calls):
        got, want = [], []

        def fire(ptr, got=got, want=want):
            got.append(cache(sys._getframe(1), None))
            want.append(walk_loop(sys._getframe(1)))

        rng.choice((_caller_one, _caller_two))(fire, i)
        wrong += got != want
    return wrong


class Sampled:
    """Every n-th allocation gets a site (trades information: the others have none)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0

    def __call__(self, frame, interned):
        self.count += 1
        if self.count % self.n:
            return None
        return sites.walk(frame)


class WalkOnly:
    """An allocation callback that only records the site with `walk`."""

    def __init__(self, walk: Callable) -> None:
        self.walk = walk
        self.tracker = Tracker()
        self.sites: dict[int, tuple] = {}
        self.interned: dict = {}

    def _on_alloc(self, ptr: int) -> None:
        self.sites[ptr] = self.walk(sys._getframe(1), self.interned)

    def _on_free(self, ptr: int) -> None:
        self.sites.pop(ptr, None)

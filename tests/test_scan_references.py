"""`core.scan.references` confirms candidate words against the allocator's map in one vectorized
pass; here it must find exactly what the candidate-by-candidate algorithm it replaced finds, on
random parameter buffers over random allocator states (the incremental view and a snapshot)."""

from __future__ import annotations

import bisect
import random
import struct

import pytest

from graphsan.core.allocview import AllocatorView
from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import CopyArgs, KernelArgs, Reference
from graphsan.core.scan import FOREIGN_HI, FOREIGN_LO, references
from tests.test_allocview import STREAM_POOL, ModelAllocator, pool_of


def references_one_by_one(nodes, memmap, foreign=None) -> list[Reference]:
    """The algorithm before vectorization: every aligned word in the map's range (or, with
    `foreign`, where device memory can be mapped) is a candidate, looked up with `locate`;
    a candidate outside the map is asked of `foreign` once per value."""
    lo, hi = memmap.bounds()
    out, is_foreign = [], {}
    for node in nodes:
        if isinstance(node, CopyArgs):
            out += [Reference(node.index, node.kind, side, 0, a) for side, a in node.addresses]
            continue
        seen = set()
        for off in range(0, len(node.buffer) // 8 * 8, 8):
            (value,) = struct.unpack_from("<Q", node.buffer, off)
            in_range = lo <= value < hi
            if not in_range and not (foreign is not None and FOREIGN_LO <= value < FOREIGN_HI):
                continue
            if value in seen:
                continue
            if memmap.locate(value) is None:
                if foreign is None or in_range:
                    continue
                known = is_foreign.get(value)
                if known is None:
                    known = is_foreign[value] = foreign(value)
                if not known:
                    continue
            seen.add(value)
            if node.offsets:
                p = max(bisect.bisect_right(node.offsets, off) - 1, 0)
                out.append(Reference(node.index, node.name, p, off - node.offsets[p], value))
            else:
                out.append(Reference(node.index, node.name, 0, off, value))
    return out


def allocator_state(rng: random.Random, expandable: bool) -> tuple[AllocatorView, MemoryMap]:
    model = ModelAllocator(rng, expandable)
    view = AllocatorView()
    view.seed(model.snapshot())
    live = []
    for _ in range(rng.randrange(0, 60)):
        if live and rng.random() < 0.3:
            addr, stream = live.pop(rng.randrange(len(live)))
            model.free(addr, stream)
        else:
            stream = rng.choice(list(STREAM_POOL))
            size = rng.choice([8, 512, 4096, 70_000, 3 << 20])
            live.append((model.malloc(size, stream), stream))
        if rng.random() < 0.05:
            model.empty_cache()
    view.apply(model.log, pool_of)
    return view, MemoryMap.from_snapshot(model.snapshot())


def interesting_words(snap: MemoryMap, rng: random.Random) -> list[int]:
    """Addresses inside blocks and gaps, at and around every edge, and what is not an address."""
    words = [0, 1, 7, 1 << 63, (1 << 64) - 1, 0x1_0000_0001, 0x4000_0000_0040]
    words += [FOREIGN_LO - 1, FOREIGN_LO, FOREIGN_HI - 1, FOREIGN_HI]
    words += [struct.unpack("<Q", struct.pack("<ff", 1, 0))[0]]  # two floats
    for seg in snap.segments:
        for edge in [seg.address, seg.address + seg.size] + [b.address for b in seg.blocks]:
            words += [edge - 1, edge, edge + 1, edge + 8]
        words += [b.address + rng.randrange(max(b.size, 1)) for b in seg.blocks]
    lo, hi = snap.bounds()
    words += [rng.randrange(lo, hi) for _ in range(10)] if hi > lo else []
    return [w % (1 << 64) for w in words if w >= 0]


def random_nodes(words: list[int], rng: random.Random) -> list[KernelArgs | CopyArgs]:
    nodes = []
    for index in range(rng.randrange(0, 12)):
        if rng.random() < 0.15:
            nodes.append(CopyArgs(index, "memcpy", [("src", rng.choice(words)), ("dst", 8)]))
            continue
        n = rng.randrange(0, 14)
        buf = b"".join(struct.pack("<Q", rng.choice(words)) for _ in range(n))
        buf += bytes(rng.randrange(0, 8))  # a tail shorter than a word
        slots = range(0, max(len(buf), 1), 4)
        offsets = sorted(rng.sample(slots, min(rng.randrange(0, 4), len(slots))))
        if offsets and rng.random() < 0.5:
            offsets[0] = min(offsets[0] + 4, max(len(buf) - 1, 0))  # first parameter after 0
        nodes.append(KernelArgs(index, f"k{index}", buf, offsets))
    return nodes


def asker(log: list[int], confirmed: set[int]):
    """A driver query that notes what it was asked."""

    def foreign(value: int) -> bool:
        log.append(value)
        return value in confirmed

    return foreign


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("seed", range(8))
def test_vectorized_references_equal_the_one_by_one_algorithm(seed, expandable):
    rng = random.Random(seed * 31 + expandable)
    for _ in range(6):
        view, snap = allocator_state(rng, expandable)
        words = interesting_words(snap, rng)
        confirmed = {w for w in words if rng.random() < 0.5}
        for _ in range(10):
            nodes = random_nodes(words, rng)
            for memmap in (view, snap):
                assert references(nodes, memmap) == references_one_by_one(nodes, memmap)
                asked_new, asked_old = [], []
                got = references(nodes, memmap, foreign=asker(asked_new, confirmed))
                want = references_one_by_one(nodes, memmap, foreign=asker(asked_old, confirmed))
                assert got == want
                assert asked_new == asked_old, "the driver is asked the same, in the same order"


def test_an_empty_map_confirms_only_what_the_driver_confirms():
    buf = struct.pack("<QQQ", 0x7F00_0000_0000, 0x5_0000_0000, 0x6_0000_0000)
    nodes = [KernelArgs(0, "k", buf, [0])]
    got = references(nodes, AllocatorView(), foreign=lambda v: v == 0x5_0000_0000)
    assert [(r.offset, r.address) for r in got] == [(8, 0x5_0000_0000)]
    assert references(nodes, AllocatorView()) == []

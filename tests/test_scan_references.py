"""`core.scan`: the words of packed kernel parameter buffers (aligned and unaligned, 32-bit halves,
foreign memory, a size after a pointer, planted pointers in random bytes), and `references`,
which confirms candidate words against the allocator's map in one vectorized pass: it must find
exactly what a word-by-word scan and the candidate-by-candidate algorithm it replaced find, on
random parameter buffers over random allocator states (the incremental view and a snapshot)."""

from __future__ import annotations

import bisect
import random
import struct

import pytest

from graphsan.core.allocview import AllocatorView
from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import DEFAULT_POOL, CopyArgs, KernelArgs, Reference
from graphsan.core.scan import FOREIGN_HI, FOREIGN_LO, references, scan_words
from tests.test_allocview import STREAM_POOL, ModelAllocator, pool_of
from tests.test_analysis import POOL, SEG, A, B, P, capture_map, snapshot


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


# ------------------------------------------------------------ words in packed parameter buffers
def test_scan_finds_aligned_and_unaligned_words():
    buf = bytearray(64)
    struct.pack_into("<Q", buf, 8, A)
    struct.pack_into("<Q", buf, 21, B)  # unaligned, as in packed launch buffers
    assert scan_words(bytes(buf), SEG, SEG + (1 << 20)) == [(8, A), (21, B)]


def test_two_32bit_scalars_that_look_like_a_pointer_are_rejected():
    lo, hi = struct.unpack("<II", struct.pack("<Q", SEG + (1 << 40)))  # no block there
    buf = struct.pack("<IIQ", lo, hi, A)
    m = capture_map()
    got = references([KernelArgs(0, "k", buf, [0, 4, 8])], m)
    assert [(r.param, r.offset, r.address) for r in got] == [(2, 0, A)]


def test_references_map_offsets_to_parameters_and_read_copies():
    buf = bytearray(48)
    struct.pack_into("<Q", buf, 16 + 8, P + 8)  # inside a struct parameter at byte 8
    nodes = [
        KernelArgs(0, "sm90_gemm", bytes(buf), [0, 8, 16]),
        CopyArgs(1, "memcpy", [("src", A), ("dst", B)]),
    ]
    got = references(nodes, capture_map())
    assert got[0] == Reference(0, "sm90_gemm", 2, 8, P + 8)
    assert [(r.kernel, r.param, r.address) for r in got[1:]] == [
        ("memcpy", "src", A),
        ("memcpy", "dst", B),
    ]


def test_foreign_memory_is_confirmed_by_the_driver_only_when_aligned():
    foreign = 0x10_0000_0000
    buf = struct.pack("<QQ", foreign, foreign + 1) + b"\0" + struct.pack("<Q", foreign)
    got = references([KernelArgs(0, "k", buf, [])], capture_map(), foreign=lambda v: v == foreign)
    assert [(r.offset, r.address) for r in got] == [(0, foreign)]


def test_a_size_after_a_pointer_is_not_read_as_an_unaligned_address():
    # Seen on the H200: a pointer's zero high bytes and the low bytes of the int64 after it,
    # read at an unaligned offset, looked like an address inside a large block.
    low = A >> 16  # an int64 that, after the pointer's two zero high bytes, reads as A
    buf = struct.pack("<QQ", P, low)
    assert scan_words(buf, SEG, SEG + (1 << 20)) != []  # the window exists
    m = capture_map()
    got = references([KernelArgs(0, "k", buf, [0, 8])], m)
    assert [(r.param, r.offset, r.address) for r in got] == [(0, 0, P)]
    assert A in {
        r.address for r in references([KernelArgs(0, "k", buf, [0, 8])], m, unaligned=True)
    }


@pytest.mark.parametrize("unaligned", [False, True])
def test_random_buffers_find_exactly_the_planted_pointers(unaligned):
    rng = random.Random(1234)
    m = capture_map()
    for _ in range(200):
        n = rng.randint(8, 256)
        buf = bytearray(rng.getrandbits(8) for _ in range(n))
        for i in range(n):
            if buf[i] == 0x7F:  # no accidental high bytes of our segment range
                buf[i] = 0x11
        planted = {}
        for _ in range(rng.randint(0, 3)):
            off = rng.randint(0, n - 8)
            if not unaligned:
                off -= off % 8
            if any(abs(off - o) < 8 for o in planted):
                continue
            addr = rng.choice([A, B + 100, P + 4000])
            if addr in planted.values():
                continue  # one reference per address and node: the first offset
            struct.pack_into("<Q", buf, off, addr)
            planted[off] = addr
        node = KernelArgs(0, "k", bytes(buf), [])
        got = {(r.offset, r.address) for r in references([node], m, unaligned=unaligned)}
        assert got == set(planted.items())


@pytest.mark.parametrize("n", [0, 3, 7])
def test_short_buffers_have_no_words(n):
    assert scan_words(b"\x01" * n, 0, 1 << 64) == []


def test_the_vectorized_scan_finds_what_a_word_by_word_scan_finds():
    rng = random.Random(11)
    memmap = MemoryMap.from_snapshot(
        snapshot(
            (SEG, DEFAULT_POOL, [(0, 4096, "active_allocated"), (4096, 12288, "inactive")]),
            (SEG + (1 << 21), POOL, [(0, 8192, "active_allocated")]),
        )
    )
    inside = [SEG + 8, SEG + 5000, SEG + (1 << 21) + 64]
    foreign_ok = {0x5_0000_0000}
    for _ in range(30):
        nodes = []
        for n in range(rng.randrange(1, 6)):
            words = [
                rng.choice(inside + list(foreign_ok) + [7, 1 << 40, SEG - 8, 0x6_0000_0000])
                for _ in range(rng.randrange(0, 12))
            ]
            buf = b"".join(struct.pack("<Q", w) for w in words) + bytes(rng.randrange(0, 8))
            nodes.append(KernelArgs(n, f"k{n}", buf, [0, 16] if len(buf) > 16 else [0]))
        got = references(nodes, memmap, foreign=lambda v: v in foreign_ok)
        want = []
        for node in nodes:  # the rule, word by word
            seen = set()
            for off in range(0, len(node.buffer) // 8 * 8, 8):
                (v,) = struct.unpack_from("<Q", node.buffer, off)
                if v in seen or not (memmap.locate(v) is not None or v in foreign_ok):
                    continue
                seen.add(v)
                p = 1 if len(node.offsets) > 1 and off >= 16 else 0
                want.append((node.index, p, off - node.offsets[p], v))
        assert [(r.node, r.param, r.offset, r.address) for r in got] == want

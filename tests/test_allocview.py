"""The incremental allocator view against snapshots, on CPU.

A small model of the caching allocator (segments per pool, block splitting and merging, segments
returned by empty_cache, expandable segments that map and unmap 2 MiB pages) produces both the
event log the real allocator writes and the snapshot it would give. After every step of a random
sequence of allocations, frees and empty_cache calls, the view fed with the log must equal a
`MemoryMap` built from the snapshot: the same segments, pools and allocated blocks, and the same
answer for any address (the block there, or the free gap around it).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from graphsan.core import viewsegment
from graphsan.core.allocview import AllocatorView
from graphsan.core.memory_map import KEEP_REQUESTED, MemoryMap, layout
from graphsan.core.records import DEFAULT_POOL
from graphsan.core.viewsegment import ViewError, ViewSegment, block_size

PAGE = 2 << 20
ALIGN = 512
STREAM_POOL = {11: DEFAULT_POOL, 22: (1, 0), 33: (2, 0)}


class ModelAllocator:
    """Just enough of the caching allocator to write its event log and its snapshot."""

    def __init__(self, rng: random.Random, expandable: bool) -> None:
        self.rng = rng
        self.expandable = expandable
        self.next_segment = 0x7F00_0000_0000
        self.segments: list[dict] = []  # fixed segments: address, size, pool, stream, blocks
        self.reserve = 0x7E00_0000_0000  # the default pool's expandable reservation
        self.mapped: set[int] = set()  # page indices mapped in the reservation
        self.exp_blocks: dict[int, int] = {}  # allocated blocks in the reservation
        self.requested: dict[int, int] = {}  # what each live block was allocated for
        self.log: list[dict] = []

    def _entry(self, action: str, addr: int, size: int, stream: int) -> None:
        self.log.append({"action": action, "addr": addr, "size": size, "stream": stream})

    # -- allocation ----------------------------------------------------------------------------
    def malloc(self, nbytes: int, stream: int) -> int:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        pool = STREAM_POOL[stream]
        if self.expandable and pool == DEFAULT_POOL:
            return self._malloc_expandable(nbytes, size, stream)
        for seg in self.segments:
            if seg["pool"] != pool:
                continue
            for blk in seg["blocks"]:
                if not blk[2] and blk[1] >= size:
                    return self._split(seg, blk, nbytes, size, stream)
        seg_size = max(PAGE, -(-size // PAGE) * PAGE)
        addr = self.next_segment
        self.next_segment += seg_size + PAGE * self.rng.choice([0, 1, 3])
        seg = {"address": addr, "size": seg_size, "pool": pool, "blocks": [[addr, seg_size, False]]}
        self.segments.append(seg)
        self.segments.sort(key=lambda s: s["address"])
        self._entry("segment_alloc", addr, seg_size, stream)
        return self._split(seg, seg["blocks"][0], nbytes, size, stream)

    def _split(self, seg: dict, blk: list, nbytes: int, size: int, stream: int) -> int:
        """The allocator splits a free block only when the rest is worth keeping: 512 B in the
        small pool, more than 1 MiB in the large one; else the block keeps it all. The log
        records the requested size."""
        i = seg["blocks"].index(blk)
        rest = blk[1] - size
        if rest >= ALIGN if nbytes <= (1 << 20) else rest > (1 << 20):
            seg["blocks"].insert(i + 1, [blk[0] + size, rest, False])
            blk[1] = size
        blk[2] = True
        self.requested[blk[0]] = nbytes
        self._entry("alloc", blk[0], nbytes, stream)
        return blk[0]

    def _malloc_expandable(self, nbytes: int, size: int, stream: int) -> int:
        for lo, hi in self._free_ranges():
            if lo + size <= hi:
                return self._take(lo, nbytes, size if hi - lo - size >= ALIGN else hi - lo, stream)
        pages = -(-size // PAGE)
        p = 0
        while any(q in self.mapped for q in range(p, p + pages)):
            p += 1
        for q in range(p, p + pages):
            self.mapped.add(q)
        addr = self.reserve + p * PAGE
        self._entry("segment_map", addr, pages * PAGE, stream)
        lo, hi = next((lo, hi) for lo, hi in self._free_ranges() if lo <= addr < hi)
        # the free block may begin before the new pages (the end of a mapped run)
        block = size if hi - lo - size >= ALIGN else hi - lo
        return self._take(lo, nbytes, block, stream)

    def _take(self, addr: int, nbytes: int, block: int, stream: int) -> int:
        self.exp_blocks[addr] = block
        self.requested[addr] = nbytes
        self._entry("alloc", addr, nbytes, stream)
        return addr

    def _runs(self) -> list[tuple[int, int]]:
        """Runs of mapped pages, as addresses."""
        runs, pages = [], sorted(self.mapped)
        for p in pages:
            if runs and runs[-1][1] == self.reserve + p * PAGE:
                runs[-1][1] += PAGE
            else:
                runs.append([self.reserve + p * PAGE, self.reserve + (p + 1) * PAGE])
        return [tuple(r) for r in runs]

    def _free_ranges(self) -> list[tuple[int, int]]:
        out = []
        for lo, hi in self._runs():
            pos = lo
            for a in sorted(a for a in self.exp_blocks if lo <= a < hi):
                if a > pos:
                    out.append((pos, a))
                pos = a + self.exp_blocks[a]
            if hi > pos:
                out.append((pos, hi))
        return out

    # -- free / empty_cache --------------------------------------------------------------------
    def free(self, addr: int, stream: int) -> None:
        nbytes = self.requested.pop(addr)
        if addr in self.exp_blocks:
            self.exp_blocks.pop(addr)
            self._entry("free_requested", addr, nbytes, stream)
            self._entry("free_completed", addr, nbytes, stream)
            return
        for seg in self.segments:
            for blk in seg["blocks"]:
                if blk[0] == addr and blk[2]:
                    self._entry("free_requested", addr, nbytes, stream)
                    self._entry("free_completed", addr, nbytes, stream)
                    blk[2] = False
                    self._merge(seg)
                    return
        raise AssertionError(f"free of unknown {addr:#x}")

    @staticmethod
    def _merge(seg: dict) -> None:
        merged: list[list] = []
        for blk in seg["blocks"]:
            if merged and not merged[-1][2] and not blk[2]:
                merged[-1][1] += blk[1]
            else:
                merged.append(list(blk))
        seg["blocks"] = merged

    def empty_cache(self) -> None:
        for seg in list(self.segments):
            if not any(b[2] for b in seg["blocks"]):
                self.segments.remove(seg)
                self._entry("segment_free", seg["address"], seg["size"], 0)
        busy = set()
        for a, size in self.exp_blocks.items():
            for p in range((a - self.reserve) // PAGE, (a + size - 1 - self.reserve) // PAGE + 1):
                busy.add(p)
        idle = sorted(p for p in self.mapped if p not in busy)
        run: list[int] = []
        for p in idle + [None]:
            if run and (p is None or p != run[-1] + 1):
                self._entry("segment_unmap", self.reserve + run[0] * PAGE, len(run) * PAGE, 0)
                self.mapped -= set(run)
                run = []
            if p is not None:
                run.append(p)

    # -- what a snapshot shows -----------------------------------------------------------------
    def snapshot(self) -> dict:
        segs = []
        for seg in self.segments:
            segs.append(
                {
                    "address": seg["address"],
                    "total_size": seg["size"],
                    "segment_pool_id": seg["pool"],
                    "is_expandable": False,
                    "blocks": [
                        {
                            "address": a,
                            "size": s,
                            "requested_size": self.requested.get(a, s) if used else s,
                            "state": "active_allocated" if used else "inactive",
                        }
                        for a, s, used in seg["blocks"]
                    ],
                }
            )
        for lo, hi in self._runs():
            blocks, pos = [], lo
            for a in sorted(a for a in self.exp_blocks if lo <= a < hi):
                if a > pos:
                    blocks.append({"address": pos, "size": a - pos, "state": "inactive"})
                blocks.append(
                    {
                        "address": a,
                        "size": self.exp_blocks[a],
                        "requested_size": self.requested.get(a, self.exp_blocks[a]),
                        "state": "active_allocated",
                    }
                )
                pos = a + self.exp_blocks[a]
            if hi > pos:
                blocks.append({"address": pos, "size": hi - pos, "state": "inactive"})
            segs.append(
                {
                    "address": lo,
                    "total_size": hi - lo,
                    "segment_pool_id": DEFAULT_POOL,
                    "is_expandable": True,
                    "blocks": blocks,
                }
            )
        return {"segments": sorted(segs, key=lambda s: s["address"])}


def random_event(model: ModelAllocator, live: list[tuple[int, int]], rng: random.Random) -> None:
    """One random allocation (half the time), free of a live block, or empty_cache."""
    r = rng.random()
    if r < 0.5 or not live:
        stream = rng.choice(list(STREAM_POOL))
        size = rng.choice([8, 512, 1000, 4096, 65_536, 1 << 20, 3 << 20, 5 << 20])
        live.append((model.malloc(size, stream), stream))
    elif r < 0.93:
        addr, stream = live.pop(rng.randrange(len(live)))
        model.free(addr, stream)
    else:
        model.empty_cache()


def pool_of(entry, following):
    return STREAM_POOL[entry["stream"]]


def same_answers(view: AllocatorView, snap: MemoryMap, rng: random.Random) -> None:
    assert layout(view) == layout(snap)
    # the block count is kept, not counted: it must agree with the segments and the snapshot
    assert len(view) == sum(len(s) for s in view.segments)
    assert len(view) == sum(1 for s in snap.segments for b in s.blocks if b.allocated)
    assert view.bounds() == snap.bounds()
    lo, hi = snap.bounds()
    probes = [rng.randrange(lo - PAGE, hi + PAGE) for _ in range(40)] if hi else [0]
    probes += [b.address + b.size // 2 for s in snap.segments for b in s.blocks][:40]
    probes += [e + d for s in view.segments for e in (s.address, s.end) for d in (-1, 0)]
    at = np.array(probes, dtype=np.uint64)  # the vectorized question, for many addresses
    assert view.contains(at).tolist() == [view.locate(a) is not None for a in probes]
    assert snap.contains(at).tolist() == [snap.locate(a) is not None for a in probes]
    for addr in probes:
        a, b = view.locate(addr), snap.locate(addr)
        assert (a is None) == (b is None), hex(addr)
        if a is not None:
            assert a[0].address == b[0].address
            assert (a[1].address, a[1].size, a[1].allocated) == (
                b[1].address,
                b[1].size,
                b[1].allocated,
            ), hex(addr)
        end = addr + rng.choice([8, 4096, 3 * PAGE])
        assert view.covers(addr, end) == snap.covers(addr, end)
        assert [s.address for s in view.segments_in(addr, end)] == [
            s.address for s in snap.segments_in(addr, end)
        ]


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("seed", range(6))
def test_the_view_equals_a_snapshot_after_every_event(seed, expandable):
    rng = random.Random(seed * 7919 + expandable)
    model = ModelAllocator(rng, expandable)
    live: list[tuple[int, int]] = []
    for _ in range(rng.randrange(0, 12)):  # memory allocated before the seed
        stream = rng.choice(list(STREAM_POOL))
        live.append((model.malloc(rng.choice([100, 4096, 70_000, 3 << 20]), stream), stream))
    view = AllocatorView()
    view.seed(model.snapshot())
    model.log.clear()
    for _ in range(300):
        random_event(model, live, rng)
        if rng.random() < 0.3:  # the sanitizer drains the log now and then, not after each event
            view.apply(model.log, pool_of)
            model.log.clear()
            same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)
    view.apply(model.log, pool_of)
    same_answers(view, MemoryMap.from_snapshot(model.snapshot()), rng)
    small = {a: n for a, n in model.requested.items() if n <= KEEP_REQUESTED}
    assert view.requested == small, "the requested sizes pointer tables are read up to"


@pytest.mark.parametrize("chunk", [2, 3, 8])
@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
@pytest.mark.parametrize("seed", range(6))
def test_the_view_equals_a_snapshot_with_its_blocks_in_many_chunks(
    seed, expandable, chunk, monkeypatch
):
    """The same, with a segment's blocks split into chunks of a few: inserts that split a
    chunk, frees that empty one, and runs of mapped pages joined and cut chunk by chunk."""
    monkeypatch.setattr(viewsegment, "CHUNK", chunk)
    test_the_view_equals_a_snapshot_after_every_event(seed, expandable)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_a_segment_in_chunks_answers_like_a_sorted_list(chunk, monkeypatch):
    """Carving, freeing and cutting a segment whose blocks sit in chunks of a few, checked
    after every step against a plain dict of its blocks."""
    monkeypatch.setattr(viewsegment, "CHUNK", chunk)
    rng = random.Random(chunk)
    base, size = 0x7F00_0000_0000, 48 * ALIGN
    seg = ViewSegment(base, size, DEFAULT_POOL, expandable=True)
    blocks: dict[int, int] = {}

    def gap_end(addr):  # the end of the free space at addr (addr itself if allocated)
        if any(a <= addr < a + n for a, n in blocks.items()):
            return addr
        return min([a for a in blocks if a > addr] + [base + size])

    for _ in range(800):
        addr = base + ALIGN * rng.randrange(48)
        op = rng.random()
        if op < 0.55:
            want = rng.choice([1, ALIGN, 700, 2 * ALIGN, 3000])
            hi = gap_end(addr)
            if addr + want > hi or hi == addr:
                with pytest.raises(ViewError):
                    seg.carve(addr, want)
            else:
                seg.carve(addr, want)
                blocks[addr] = block_size(want, hi - addr, True)
        elif op < 0.9:
            assert seg.remove(addr) == (blocks.pop(addr, None) is not None)
        else:
            lo, hi = seg.cut(addr)
            assert lo.spans() == sorted((a, n) for a, n in blocks.items() if a < addr)
            assert hi.spans() == sorted((a, n) for a, n in blocks.items() if a >= addr)
            assert len(seg) == 0 and len(lo) + len(hi) == len(blocks)
            seg = lo.join(hi)
            assert len(lo) == len(hi) == 0
        spans = sorted(blocks.items())
        assert seg.spans() == spans and len(seg) == len(spans)
        for probe in [base - 1, base + size] + [base + rng.randrange(size) for _ in range(6)]:
            got = seg.block_at(probe)
            if not base <= probe < base + size:
                assert got is None
                continue
            inside = [(a, n) for a, n in spans if a <= probe < a + n]
            if inside:
                want_block = (*inside[0], True)
            else:
                lo_ = max([a + n for a, n in spans if a + n <= probe] + [base])
                want_block = (lo_, gap_end(probe) - lo_, False)
            assert (got.address, got.size, got.allocated) == want_block, hex(probe)
            end = probe + rng.choice([1, ALIGN, 5 * ALIGN])
            first = next(((a, n) for a, n in spans if a < end and a + n > probe), None)
            blk = seg.allocated_in(probe, end)
            assert (blk and (blk.address, blk.size)) == (first and first), hex(probe)


@pytest.mark.parametrize("seed", range(20))
def test_a_snapshot_map_answers_in_one_pass_what_locate_answers(seed):
    """`MemoryMap.contains` against `locate` on snapshots with gaps between blocks, blocks
    past their segment's end, segments that overlap, blocks that overlap and empty blocks."""
    rng = random.Random(seed)
    segments, addr = [], 0x7F00_0000_0000
    for _ in range(rng.randrange(0, 6)):
        addr += rng.choice([-3, 0, 2, 9]) * ALIGN if segments else 0
        size = rng.randrange(1, 12) * ALIGN
        blocks, pos = [], addr + rng.choice([0, 0, ALIGN])
        for _ in range(rng.randrange(0, 5)):
            n = rng.randrange(0, 4) * ALIGN  # an empty block hides the one before it
            blocks.append({"address": pos, "size": n, "state": "active_allocated"})
            pos += n + rng.choice([-ALIGN, 0, 0, ALIGN])
        segments.append({"address": addr, "total_size": size, "blocks": blocks})
        addr += size
    snap = MemoryMap.from_snapshot({"segments": segments})
    probes = list(range(0x7F00_0000_0000 - ALIGN, addr + 4 * ALIGN, ALIGN // 2))
    probes += [p + d for p in probes for d in (-1, 1)]
    got = snap.contains(np.array(probes, dtype=np.uint64)).tolist()
    assert got == [snap.locate(p) is not None for p in probes]


def test_a_lost_event_is_noticed_so_the_view_can_be_reseeded():
    rng = random.Random(5)
    model = ModelAllocator(rng, expandable=False)
    view = AllocatorView()
    view.seed(model.snapshot())
    a = model.malloc(4096, 11)
    del model.log[-1]  # the alloc entry was lost (overwritten, or raced with a drain)
    model.free(a, 11)
    with pytest.raises(ViewError, match="free of unknown block"):
        view.apply(model.log, pool_of)


def test_allocation_stacks_are_looked_up_only_when_asked():
    asked = []

    def resolve(addr):
        asked.append(addr)
        return [("train.py", 3, "step")]

    model = ModelAllocator(random.Random(1), expandable=False)
    view = AllocatorView(resolve)
    view.seed(model.snapshot())
    addrs = [model.malloc(4096, 11) for _ in range(1000)]
    model.free(addrs[10], 11)
    view.apply(model.log, pool_of)
    assert asked == []
    seg, blk = view.locate(addrs[500] + 8)
    assert blk.frames == [("train.py", 3, "step")] and asked == [addrs[500]]
    free_gap = seg.block_at(addrs[10] + 8)
    assert (free_gap.address, free_gap.size, free_gap.allocated) == (addrs[10], 4096, False)
    assert free_gap.frames == [] and asked == [addrs[500]]

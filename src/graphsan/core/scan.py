"""Finding device addresses in a captured graph's node arguments.

A kernel's parameter block is raw bytes; the words that fall inside the allocator's segments
(or, confirmed by the driver, in other device memory) are the graph's references.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from graphsan.core import argstructs, offset_calc
from graphsan.core.argstructs import NOT_CALIBRATED, Layouts
from graphsan.core.memory_map import KEEP_REQUESTED, MemoryMap
from graphsan.core.records import CopyArgs, KernelArgs, PoolId, Reference


def scan_words(buf: bytes, lo: int, hi: int, unaligned: bool = True) -> list[tuple[int, int]]:
    """(byte offset, value) of every little-endian 64-bit word in `buf` whose value lies in
    [lo, hi): at every byte offset, or (unaligned=False) at 8-byte-aligned ones only. The caller
    confirms each candidate against the allocator's map."""
    n = len(buf)
    if n < 8 or hi <= lo:
        return []
    raw = np.frombuffer(buf, dtype=np.uint8)
    out = []
    for align in range(8) if unaligned else (0,):
        count = (n - align) // 8
        if count <= 0:
            break
        words = raw[align : align + 8 * count].view("<u8")
        for i in np.nonzero((words >= lo) & (words < hi))[0]:
            out.append((align + 8 * int(i), int(words[i])))
    out.sort()
    return out


def references(
    nodes: Iterable[KernelArgs | CopyArgs],
    memmap: MemoryMap,
    foreign: Callable[[int], bool] | None = None,
    unaligned: bool = False,
    layouts: Layouts = NOT_CALIBRATED,
) -> list[Reference]:
    """Every confirmed device address in the nodes' arguments.

    A kernel word counts when it is 8-byte aligned and falls inside a block of the allocator's
    map; words outside it count as foreign memory only when `foreign(value)` (a driver query)
    confirms them. Memcpy and memset addresses are taken as they are.

    Words in the slots of PyTorch's argument structs that a launch does not fill are never
    references (`argstructs.decode`, with the `layouts` confirmed on this torch); in a struct
    whose layout is not confirmed they are scanned, and their references carry its caveat.

    Kernel parameters follow the C++ ABI, so a pointer sits at an 8-byte-aligned offset of the
    parameter buffer (inside structs too) unless a struct is declared packed. Unaligned words
    (`unaligned=True`, for such packed buffers) cost false alarms: a pointer's zero high bytes
    followed by a small integer read, at an odd offset, as an address inside a large block.

    The aligned words of all kernels are found and confirmed against the map in one vectorized
    pass (`memmap.contains`); Python touches only the confirmed ones.
    """
    nodes = list(nodes)
    if unaligned:
        return _references_unaligned(nodes, memmap, foreign, layouts)
    copies = [(i, n) for i, n in enumerate(nodes) if isinstance(n, CopyArgs)]
    out: list[Reference] = []
    c = 0  # copies before the node of the current word are emitted first: node order
    node_at, seen, offsets, index, name = -1, set(), [], 0, ""
    for pos, off, value, caveat in zip(
        *_aligned_hits(nodes, memmap, foreign, layouts), strict=True
    ):
        if pos != node_at:
            node_at, seen = pos, set()
            node = nodes[pos]
            offsets, index, name = node.offsets, node.index, node.name
            while c < len(copies) and copies[c][0] < pos:
                out += _copy_references(copies[c][1])
                c += 1
        if value in seen:
            continue
        seen.add(value)
        if offsets:
            p = bisect.bisect_right(offsets, off) - 1
            if p < 0:
                p = 0
            out.append(Reference(index, name, p, off - offsets[p], value, caveat=caveat))
        else:
            out.append(Reference(index, name, 0, off, value, caveat=caveat))
    for _, copy in copies[c:]:
        out += _copy_references(copy)
    return out


def _copy_references(node: CopyArgs) -> list[Reference]:
    return [Reference(node.index, node.kind, side, 0, a) for side, a in node.addresses]


@dataclass
class _Joined:
    """The kernels' parameter buffers joined into one array of 64-bit words, and where each
    buffer's words start in it."""

    nodes: list[KernelArgs | CopyArgs]
    bufs: list[tuple[int, bytes]]  # (node position, its buffer cut to whole words)
    counts: np.ndarray  # words per buffer
    starts: np.ndarray  # each buffer's first word
    words: np.ndarray

    @classmethod
    def of(cls, nodes: list[KernelArgs | CopyArgs]) -> _Joined:
        """The kernels among `nodes` with at least one word."""
        bufs = [
            (i, n.buffer[: len(n.buffer) // 8 * 8])
            for i, n in enumerate(nodes)
            if isinstance(n, KernelArgs) and len(n.buffer) >= 8
        ]
        counts = np.array([len(b) // 8 for _, b in bufs])
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        words = np.frombuffer(b"".join(b for _, b in bufs), dtype="<u8")
        return cls(nodes, bufs, counts, starts, words)


def _aligned_hits(
    nodes: list[KernelArgs | CopyArgs],
    memmap: MemoryMap,
    foreign: Callable[[int], bool] | None,
    layouts: Layouts = NOT_CALIBRATED,
) -> tuple[list[int], list[int], list[int], list[str | None]]:
    """Node position, offset, value and caveat of each confirmed 8-byte-aligned word, in node
    and offset order: inside the map, or (with `foreign`) confirmed by it; never in a slot the
    launch does not fill."""
    joined = _Joined.of(nodes)
    if not joined.bufs:
        return [], [], [], []
    lo, hi = memmap.bounds()
    starts, words = joined.starts, joined.words
    mask = (words >= lo) & (words < hi)
    if foreign is not None:
        mask |= (words >= FOREIGN_LO) & (words < FOREIGN_HI)
    hits = np.flatnonzero(mask)
    values = words[hits]
    ok = memmap.contains(values)
    if foreign is not None:
        ask = ~ok & ((values < lo) | (values >= hi))
        if ask.any():  # each distinct value once, in the order the words come
            yes = [v for v in dict.fromkeys(values[ask].tolist()) if foreign(v)]
            if yes:
                ok |= ask & np.isin(values, np.array(yes, dtype=np.uint64))
    hits, values = hits[ok], values[ok]
    caveats: list[str | None] = []
    if len(hits):
        drop, caveats = _unread(joined, hits, layouts)
        hits, values = hits[~drop], values[~drop]
        caveats = [c for c, d in zip(caveats, drop.tolist(), strict=True) if not d]
    which = np.searchsorted(starts, hits, side="right") - 1
    positions = np.array([i for i, _ in joined.bufs])
    return (
        positions[which].tolist(),
        (8 * (hits - starts[which])).tolist(),
        values.tolist(),
        caveats,
    )


def _unread(
    joined: _Joined, hits: np.ndarray, layouts: Layouts
) -> tuple[np.ndarray, list[str | None]]:
    """Which hits (indexes of 64-bit words in the kernels' joined buffers) the kernel never
    reads, and the caveat of each: slots of PyTorch's argument structs the launch does not fill
    (`argstructs`), and the certain part of offset calculators found in PyTorch's other kernels
    (`offset_calc`)."""
    nodes, bufs, starts = joined.nodes, joined.bufs, joined.starts
    drop = _in_calculators(joined, hits)
    caveats: list[str | None] = [None] * len(hits)
    which = np.searchsorted(starts, hits, side="right") - 1
    for k in np.unique(which).tolist():
        node = nodes[bufs[k][0]]
        if not argstructs.plan(node.name):
            continue
        decoded = argstructs.decode(node.name, node.buffer, node.offsets, node.grid, layouts)
        if decoded is None:
            continue
        sel = np.flatnonzero(which == k)
        rel = 8 * (hits[sel].astype(np.int64) - starts[k])
        if decoded.dead:
            drop[sel] |= offset_calc.inside(decoded.dead, rel)
        if decoded.unsure:
            for j in sel[offset_calc.inside(decoded.unsure, rel)].tolist():
                caveats[j] = decoded.caveat
    return drop, caveats


def _in_calculators(joined: _Joined, hits: np.ndarray) -> np.ndarray:
    """Which hits (indexes of 64-bit words in the kernels' joined buffers) lie inside an offset
    calculator of a PyTorch kernel (`graphsan.core.offset_calc`)."""
    nodes, bufs, counts = joined.nodes, joined.bufs, joined.counts
    byte_starts = 8 * joined.starts

    def end_of(at: np.ndarray) -> np.ndarray:
        """Where the parameter holding each byte offset ends; -1 outside PyTorch's kernels."""
        out = []
        which = (np.searchsorted(byte_starts, at, side="right") - 1).tolist()
        for a, k in zip(at.tolist(), which, strict=True):
            i, base, size = bufs[k][0], int(byte_starts[k]), 8 * int(counts[k])
            if not offset_calc.is_pytorch_kernel(nodes[i].name):
                out.append(-1)
                continue
            later = [o for o in nodes[i].offsets if o > a - base]
            out.append(base + min(later[0], size) if later else base + size)
        return np.array(out, dtype=np.int64)

    ranges = offset_calc.calculators(joined.words.view("<u4"), end_of)
    return offset_calc.inside(ranges, 8 * hits.astype(np.int64))


def _references_unaligned(
    nodes: list[KernelArgs | CopyArgs],
    memmap: MemoryMap,
    foreign: Callable[[int], bool] | None,
    layouts: Layouts = NOT_CALIBRATED,
) -> list[Reference]:
    """`references` with every byte offset of kernel buffers read (`unaligned=True`)."""
    lo, hi = memmap.bounds()
    out: list[Reference] = []
    is_foreign: dict[int, bool] = {}
    for node in nodes:
        if isinstance(node, CopyArgs):
            out += [Reference(node.index, node.kind, side, 0, a) for side, a in node.addresses]
            continue
        candidates = scan_words(node.buffer, lo, hi, True)
        if foreign is not None:
            candidates += [
                (off, v)
                for off, v in scan_words(node.buffer, FOREIGN_LO, FOREIGN_HI, unaligned=False)
                if not lo <= v < hi
            ]
        caveat_of = {}
        if candidates and offset_calc.is_pytorch_kernel(node.name):
            # words inside PyTorch's offset calculators and unfilled struct slots are no addresses
            at = np.array([o for o, _ in candidates], dtype=np.int64)
            skip = offset_calc.inside(
                offset_calc.calculator_words(node.buffer, [*node.offsets[1:]]), at
            )
            decoded = argstructs.decode(node.name, node.buffer, node.offsets, node.grid, layouts)
            if decoded is not None:
                skip |= offset_calc.inside(decoded.dead, at)
                unsure = offset_calc.inside(decoded.unsure, at)
                caveat_of = {
                    o: decoded.caveat
                    for o, u in zip(at.tolist(), unsure.tolist(), strict=True)
                    if u
                }
            candidates = [c for c, s in zip(candidates, skip.tolist(), strict=True) if not s]
        seen = set()
        for off, value in candidates:
            if value in seen:
                continue
            if memmap.locate(value) is None:
                if foreign is None or off % 8 or lo <= value < hi:
                    continue
                known = is_foreign.get(value)
                if known is None:
                    known = is_foreign[value] = foreign(value)
                if not known:
                    continue
            seen.add(value)
            param, inner = _param_of(node.offsets, off)
            out.append(
                Reference(node.index, node.name, param, inner, value, caveat=caveat_of.get(off))
            )
    return out


FOREIGN_LO, FOREIGN_HI = 1 << 32, 1 << 49  # where device virtual addresses live on x86-64


def _param_of(offsets: list[int], off: int) -> tuple[int, int]:
    if not offsets:
        return 0, off
    i = max(bisect.bisect_right(offsets, off) - 1, 0)
    return i, off - offsets[i]


_UNSEEN = object()
_node = operator.itemgetter(0)  # Reference.node

# What capture end reads of the device buffers kernel arguments point at (pointer tables):
# blocks up to TABLE_BLOCK bytes, TABLE_BUDGET bytes per graph in all.
TABLE_BLOCK = KEEP_REQUESTED
TABLE_BUDGET = 64 << 10


def table_candidates(
    refs: Iterable[Reference],
    memmap: MemoryMap,
    own_pool: PoolId | None,
    max_block: int = TABLE_BLOCK,
    budget: int = TABLE_BUDGET,
) -> list[tuple[int, int, Reference]]:
    """(block address, size, first reference) of the small allocated blocks the graph's kernel
    arguments point at, within `budget` bytes, first referenced first. Blocks of the graph's
    own pool are left out: their content is written by the graph's first replay, so at capture
    end it is whatever the memory held before."""
    out: list[tuple[int, int, Reference]] = []
    seen: set[int] = set()
    located: dict[int, object] = {}  # a graph names the same addresses many times
    spent = 0
    for r in sorted(refs, key=_node):
        if r.through is not None or not isinstance(r.param, int):
            continue  # memcpy/memset sides, and addresses already read from a table
        hit = located.get(r.address, _UNSEEN)
        if hit is _UNSEEN:
            hit = located[r.address] = memmap.locate(r.address)
        if hit is None or hit[1] is None or not hit[1].allocated:
            continue
        seg, blk = hit
        if blk.address in seen or blk.size > max_block or (own_pool and seg.pool == own_pool):
            continue
        seen.add(blk.address)
        if spent + blk.size > budget:
            continue
        spent += blk.size
        out.append((blk.address, blk.size, r))
    return out


def table_references(table: int, data: bytes, via: Reference, memmap: MemoryMap) -> list[Reference]:
    """The 8-byte-aligned words of a table's bytes that point into an allocated block of the
    map, as references of the node argument `via` through the table.

    Data is not a table: the block counts only when at least half of its non-zero words lie
    in the allocator's address range (a pointer table holds pointers, maybe zero padding and a
    few counts), and a value counts only inside a live block. An int64 index or offset never
    reaches the address range; pairs of int32 token ids can (a high id equal to the top half of
    a device address), but never for half of a tensor's words."""
    lo, hi = memmap.bounds()
    n = len(data) // 8
    if n == 0 or hi <= lo:
        return []
    words = np.frombuffer(data[: 8 * n], dtype="<u8")
    inside = (words >= lo) & (words < hi)
    if 2 * int(inside.sum()) < int(np.count_nonzero(words)):
        return []
    out = []
    located: dict[int, object] = {}
    idx = np.flatnonzero(inside)
    idx = idx[memmap.contains(words[idx])]
    for i, value in zip(idx.tolist(), words[idx].tolist(), strict=True):
        hit = located.get(value, _UNSEEN)
        if hit is _UNSEEN:
            hit = located[value] = memmap.locate(value)
        if hit is None or hit[1] is None or not hit[1].allocated or hit[1].address == table:
            continue
        out.append(via._replace(address=value, through=table, slot=8 * i))
    return out

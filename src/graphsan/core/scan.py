"""Finding device addresses in a captured graph's node arguments.

A kernel's parameter block is raw bytes; the words that fall inside the allocator's segments
(or, confirmed by the driver, in other device memory) are the graph's references.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

import numpy as np

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
) -> list[Reference]:
    """Every confirmed device address in the nodes' arguments.

    A kernel word counts when it is 8-byte aligned and falls inside a block of the allocator's
    map; words outside it count as foreign memory only when `foreign(value)` (a driver query)
    confirms them. Memcpy and memset addresses are taken as they are.

    Kernel parameters follow the C++ ABI, so a pointer sits at an 8-byte-aligned offset of the
    parameter buffer (inside structs too) unless a struct is declared packed. Unaligned words
    (`unaligned=True`, for such packed buffers) cost false alarms: a pointer's zero high bytes
    followed by a small integer read, at an odd offset, as an address inside a large block.

    The aligned words of all kernels are compared in one vectorized pass, so a graph of
    thousands of nodes costs one numpy scan plus a lookup per candidate.
    """
    nodes = list(nodes)
    lo, hi = memmap.bounds()
    out: list[Reference] = []
    candidates: dict[int, list[tuple[int, int]]] = {}  # node position -> (offset, value)
    kernels = [(i, n) for i, n in enumerate(nodes) if isinstance(n, KernelArgs)]
    if unaligned:
        for i, n in kernels:
            candidates[i] = scan_words(n.buffer, lo, hi, True)
            if foreign is not None:
                candidates[i] += [
                    (off, v)
                    for off, v in scan_words(n.buffer, FOREIGN_LO, FOREIGN_HI, unaligned=False)
                    if not lo <= v < hi
                ]
    else:
        candidates = _aligned_candidates(kernels, lo, hi, foreign is not None)
    is_foreign: dict[int, bool] = {}
    for i, node in enumerate(nodes):
        if isinstance(node, CopyArgs):
            out += [Reference(node.index, node.kind, side, 0, a) for side, a in node.addresses]
            continue
        seen = set()
        for off, value in candidates.get(i, ()):
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
            out.append(Reference(node.index, node.name, param, inner, value))
    return out


def _aligned_candidates(
    kernels: list[tuple[int, KernelArgs]], lo: int, hi: int, with_foreign: bool
) -> dict[int, list[tuple[int, int]]]:
    """(offset, value) of the 8-byte-aligned words that may be addresses, per node position:
    inside [lo, hi), or (with_foreign) anywhere device memory can be mapped."""
    bufs = [(i, n.buffer[: len(n.buffer) // 8 * 8]) for i, n in kernels if len(n.buffer) >= 8]
    if not bufs:
        return {}
    counts = np.array([len(b) // 8 for _, b in bufs])
    words = np.frombuffer(b"".join(b for _, b in bufs), dtype="<u8")
    mask = (words >= lo) & (words < hi)
    if with_foreign:
        mask |= (words >= FOREIGN_LO) & (words < FOREIGN_HI)
    hits = np.nonzero(mask)[0]
    if not len(hits):
        return {}
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    which = np.searchsorted(starts, hits, side="right") - 1
    out: dict[int, list[tuple[int, int]]] = {}
    for h, w in zip(hits.tolist(), which.tolist(), strict=True):
        out.setdefault(bufs[w][0], []).append((8 * (h - int(starts[w])), int(words[h])))
    return out


FOREIGN_LO, FOREIGN_HI = 1 << 32, 1 << 49  # where device virtual addresses live on x86-64


def _param_of(offsets: list[int], off: int) -> tuple[int, int]:
    if not offsets:
        return 0, off
    i = max(bisect.bisect_right(offsets, off) - 1, 0)
    return i, off - offsets[i]


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
    spent = 0
    for r in sorted(refs, key=lambda r: r.node):
        if r.through is not None or not isinstance(r.param, int):
            continue  # memcpy/memset sides, and addresses already read from a table
        hit = memmap.locate(r.address)
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
    for i in np.nonzero(inside)[0].tolist():
        value = int(words[i])
        hit = memmap.locate(value)
        if hit is None or hit[1] is None or not hit[1].allocated or hit[1].address == table:
            continue
        out.append(via._replace(address=value, through=table, slot=8 * i))
    return out

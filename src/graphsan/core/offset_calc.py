"""Kernel-argument bytes that hold no address: PyTorch's `OffsetCalculator`.

PyTorch's TensorIterator kernels (elementwise, reductions, indexing) take an `OffsetCalculator`
by value: `int dims`, then `MAX_DIMS` (25) `IntDivider`s of three uint32 each (divisor, magic
number, shift), then the strides, `MAX_DIMS` rows of one uint32 per operand. Its constructor
fills only the first `dims` entries of both arrays; the others keep whatever the host stack held
when the kernel was launched, and a launch (or a capture) copies them into the parameter block.
Old device pointers are common there. The kernel stops at `dims` and never reads them, so such a
word is no reference, yet it can fall inside an allocator block and read as one (on the H200 it
gave false "freed" findings, docs/coverage.md).

No byte of a calculator is an address, so the scan leaves its words out. A calculator is known
by what its constructor writes: `dims` from 1 to 25, followed by that many dividers whose magic
number and shift are exactly those computed from the divisor, every divisor above 1
(TensorIterator folds dimensions of size 1 into their neighbours). Random bytes pass that test
with a chance of about 2**-32 per divider; a calculator it misses is scanned as before. The strides array's length
needs the operand count, which the bytes do not carry: it is taken from a calculator that
follows at once (a reduction's input and output calculators) or from the end of the parameter
when nothing pointer-sized follows; otherwise only its first row is left out (at least one
operand).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MAX_DIMS = 25
DIVIDER_WORDS = 3  # divisor, m1, shift
STRIDES_AT = 1 + MAX_DIMS * DIVIDER_WORDS  # uint32 words from `dims` to the strides array
MAX_OPERANDS = 8


def divider_ok(words: np.ndarray) -> np.ndarray:
    """For each position q of a uint32 array: whether words[q:q+3] is an `IntDivider<uint32_t>`
    as its constructor makes it (false for the last two positions)."""
    out = np.zeros(len(words), dtype=bool)
    if len(words) >= DIVIDER_WORDS:
        out[:-2] = dividers_ok(words[:-2], words[1:-1], words[2:])
    return out


def dividers_ok(divisor: np.ndarray, m1: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Whether each (divisor, m1, shift) is what `IntDivider<uint32_t>(divisor)` holds."""
    one = np.uint64(1)
    d, m1, shift = (a.astype(np.uint64) for a in (divisor, m1, shift))
    plausible = (d >= 1) & (d <= 0x7FFFFFFF) & (shift <= 31)
    s = np.where(plausible, shift, np.uint64(0))
    d1 = np.where(plausible, d, one)
    smallest = ((one << s) >= d1) & ((s == 0) | ((one << (np.maximum(s, one) - one)) < d1))
    room = np.where(smallest, (one << s) - d1, np.uint64(0))  # below 2**31: no overflow below
    magic = ((one << np.uint64(32)) * room) // d1 + one
    return plausible & smallest & (m1 == magic)


def calculator_words(data: bytes, param_ends: list[int]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of `data` taken by OffsetCalculators, in order. `data` is one
    kernel's parameter bytes; `param_ends` the byte offsets where its parameters end, the last
    one included. A calculator lies inside one parameter."""
    ends = np.array(sorted({e for e in param_ends if e > 0} | {len(data)}), dtype=np.int64)

    def end_of(at: np.ndarray) -> np.ndarray:
        return ends[np.searchsorted(ends, at, side="right")]

    return calculators(np.frombuffer(data[: len(data) // 4 * 4], dtype="<u4"), end_of)


def calculators(
    words: np.ndarray, end_of: Callable[[np.ndarray], np.ndarray]
) -> list[tuple[int, int]]:
    """`calculator_words` of bytes given as little-endian uint32 words; `end_of(byte offsets)`
    gives the byte offset where the parameter holding each one ends (called only where a
    calculator may be)."""
    n = len(words)
    if n <= STRIDES_AT:
        return []
    # a `dims` value, then a well-formed first divider: rare outside a calculator, so the
    # arithmetic runs on those positions only
    dims = np.flatnonzero((words[: n - STRIDES_AT] - np.uint32(1)) < np.uint32(MAX_DIMS))
    if not len(dims):
        return []
    first = dims[
        (words[dims + 1] >= 2) & dividers_ok(words[dims + 1], words[dims + 2], words[dims + 3])
    ]
    if not len(first):
        return []
    end = np.minimum(np.asarray(end_of(4 * first), dtype=np.int64) // 4, n)
    fits = first + STRIDES_AT + MAX_DIMS <= end  # its arrays end inside the parameter
    first, end = first[fits], end[fits]
    # every divider up to `dims`, all candidates at once
    d = words[first].astype(np.int64)
    slot = np.arange(MAX_DIMS)
    at = first[:, None] + 1 + DIVIDER_WORDS * slot[None, :]
    used = slot[None, :] < d[:, None]
    ok = (words[at] >= 2) & dividers_ok(words[at], words[at + 1], words[at + 2])
    good = (ok | ~used).all(axis=1)
    found = list(zip(first[good].tolist(), d[good].tolist(), end[good].tolist(), strict=True))
    out = []
    for k, (p, _, end) in enumerate(found):
        strides = p + STRIDES_AT
        operands = 0
        if k + 1 < len(found) and found[k + 1][2] == end:
            gap = found[k + 1][0] - strides
            if gap > 0 and gap % MAX_DIMS == 0:
                operands = gap // MAX_DIMS
        if not operands:
            rest = end - strides
            if rest % MAX_DIMS < 2:  # under 8 bytes of padding after it: nothing else follows
                operands = rest // MAX_DIMS
        operands = operands if 1 <= operands <= MAX_OPERANDS else 1
        out.append((4 * p, 4 * (strides + MAX_DIMS * operands)))
    return out


def inside(ranges: list[tuple[int, int]], offsets: np.ndarray, width: int = 8) -> np.ndarray:
    """For each byte offset of a `width`-byte word: whether it overlaps one of `ranges`."""
    if not ranges:
        return np.zeros(len(offsets), dtype=bool)
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = np.array([a for a, _ in merged], dtype=np.int64)
    stops = np.array([b for _, b in merged], dtype=np.int64)
    k = (
        np.searchsorted(starts, offsets + width, side="left") - 1
    )  # the last to start before its end
    return (k >= 0) & (offsets < stops[np.maximum(k, 0)])

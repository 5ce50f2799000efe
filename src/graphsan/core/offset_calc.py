"""Kernel-argument bytes that hold no address: PyTorch's `OffsetCalculator`.

PyTorch's TensorIterator kernels (elementwise, reductions, indexing) take an `OffsetCalculator`
by value: `int dims`, then `MAX_DIMS` (25) `IntDivider`s of three uint32 each (divisor, magic
number, shift), then the strides, `MAX_DIMS` rows of one uint32 per operand. Its constructor
fills only the first `dims` entries of both arrays; the others keep whatever the host stack held
when the kernel was launched, and a launch (or a capture) copies them into the parameter block.
Old device pointers are common there. The kernel stops at `dims` and never reads them, so such a
word is no reference, yet it can fall inside an allocator block and read as one (on the H200 it
gave false "freed" findings, docs/coverage.md).

Leaving out a real pointer would hide a hazard, so the rules lean towards scanning:
- only kernels of PyTorch itself (`at::native::` in the demangled name) are read for calculators;
- a calculator is `dims` from 1 to 25 followed by that many dividers whose magic number and shift
  are exactly those the constructor computes, every divisor above 1 (TensorIterator folds size-1
  dimensions into their neighbours); a single divider with a power-of-two divisor (magic number
  1) is too little evidence and is not taken;
- candidates are taken from the left, none inside one already taken (the used dividers and the
  stack leftovers in the unused ones can themselves look like a calculator);
- what is left out is the part certainly inside the calculator whatever its operand count: `dims`,
  the 25 dividers and the first 25 stride words (404 bytes). The rest of the strides array (its
  length needs the operand count, which the bytes do not carry) is still scanned.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MAX_DIMS = 25
DIVIDER_WORDS = 3  # divisor, m1, shift
STRIDES_AT = 1 + MAX_DIMS * DIVIDER_WORDS  # uint32 words from `dims` to the strides array


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


CERTAIN_BYTES = 4 * (STRIDES_AT + MAX_DIMS)  # dims, the dividers, one stride row per dimension


def calculator_words(data: bytes, param_ends: list[int]) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of `data`, one kernel's parameter bytes, left out as
    OffsetCalculator words; `param_ends` are the byte offsets where its parameters end. The
    caller decides that the kernel is PyTorch's (`is_pytorch_kernel`)."""
    ends = np.array(sorted({e for e in param_ends if e > 0} | {len(data)}), dtype=np.int64)

    def end_of(at: np.ndarray) -> np.ndarray:
        return ends[np.minimum(np.searchsorted(ends, at, side="right"), len(ends) - 1)]

    return calculators(np.frombuffer(data[: len(data) // 4 * 4], dtype="<u4"), end_of)


def is_pytorch_kernel(name: str) -> bool:
    return "at::native::" in name


def calculators(
    words: np.ndarray, end_of: Callable[[np.ndarray], np.ndarray]
) -> list[tuple[int, int]]:
    """`calculator_words` of bytes given as little-endian uint32 words (several kernels' joined
    too): `end_of(byte offsets)` says where the parameter holding each one ends, or -1 where it
    belongs to no PyTorch kernel; it is asked only about well-formed candidates."""
    n = len(words)
    if n < STRIDES_AT + MAX_DIMS:
        return []
    # a `dims` value, then a well-formed first divider: rare outside a calculator, so the
    # arithmetic runs on those positions only
    last = n - STRIDES_AT - MAX_DIMS + 1
    dims = np.flatnonzero((words[:last] - np.uint32(1)) < np.uint32(MAX_DIMS))
    if not len(dims):
        return []
    first = dims[
        (words[dims + 1] >= 2) & dividers_ok(words[dims + 1], words[dims + 2], words[dims + 3])
    ]
    if not len(first):
        return []
    # every divider up to `dims`, all candidates at once
    d = words[first].astype(np.int64)
    slot = np.arange(MAX_DIMS)
    at = first[:, None] + 1 + DIVIDER_WORDS * slot[None, :]
    used = slot[None, :] < d[:, None]
    divisor = words[at]
    ok = (divisor >= 2) & dividers_ok(divisor, words[at + 1], words[at + 2])
    power_of_two = (divisor & (divisor - np.uint32(1))) == 0
    enough = (d >= 2) | ~power_of_two[:, 0]
    good = (ok | ~used).all(axis=1) & enough
    first = first[good]
    if not len(first):
        return []
    # the certain part must lie inside one parameter
    first = first[4 * first + CERTAIN_BYTES <= np.asarray(end_of(4 * first), dtype=np.int64)]
    out: list[tuple[int, int]] = []
    for p in first.tolist():
        start = 4 * p
        if out and start < out[-1][1]:
            continue  # inside one already taken
        out.append((start, start + CERTAIN_BYTES))
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
    # the last range that starts before the word ends: the word overlaps it unless it ended
    k = np.searchsorted(starts, offsets + width, side="left") - 1
    return (k >= 0) & (offsets < stops[np.maximum(k, 0)])

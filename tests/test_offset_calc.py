"""Words inside PyTorch's OffsetCalculator are never references (graphsan.core.offset_calc).

Its constructor fills `dims` entries of two 25-entry arrays and leaves the rest as host stack
bytes, which often hold old device pointers. On the H200 such words at byte offsets 64 and 128
of an elementwise Mul kernel's closure were reported as references to freed memory.
"""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from graphsan.core import offset_calc
from graphsan.core.memory_map import AllocatorView
from graphsan.core.records import KernelArgs
from graphsan.core.scan import references

SEGMENT = 0x7F00_0000_0000
LIVE = SEGMENT + 0x1000  # the tensors the kernel really reads
OLD = SEGMENT + 0x10_0000  # a block the host stack still remembers


def divider(d: int) -> tuple[int, int, int]:
    """IntDivider<uint32_t>(d) as PyTorch's constructor makes it (smallest shift with
    2**shift >= d; m1 = 2**32 * (2**shift - d) // d + 1)."""
    shift = next(s for s in range(32) if (1 << s) >= d)
    return d, (1 << 32) * ((1 << shift) - d) // d + 1, shift


def test_dividers_match_hand_computed_magic_numbers():
    assert divider(3) == (3, 0x55555556, 2)
    assert divider(7) == (7, 613566757, 3)
    assert divider(512) == (512, 1, 9)
    assert divider(1) == (1, 1, 0)
    words = np.array([*divider(3), *divider(1000), *divider(1 << 20)], dtype=np.uint32)
    assert offset_calc.divider_ok(words)[[0, 3, 6]].all()
    bad = words.copy()
    bad[1] += 1  # a magic number one off
    assert not offset_calc.divider_ok(bad)[0]


def calculator(rng: random.Random, dims: int, operands: int, garbage: list[int]) -> bytes:
    """An OffsetCalculator<operands> as launched: `dims` filled entries, the rest host garbage
    (64-bit words from `garbage`, spread over both arrays at 4-byte offsets)."""
    words = [dims]
    for _ in range(dims):
        words += divider(rng.choice([2, 3, 7, 64, 512, 1000, 4096, 12288]))
    words += [None] * (3 * (offset_calc.MAX_DIMS - dims))
    strides = [[rng.randrange(0, 1 << 20) for _ in range(operands)] for _ in range(dims)]
    words += [s for row in strides for s in row]
    words += [None] * (operands * (offset_calc.MAX_DIMS - dims))
    junk = iter(garbage * len(words))
    out, i = [], 0
    while i < len(words):
        if words[i] is None and i + 1 < len(words) and words[i + 1] is None and rng.random() < 0.7:
            value = next(junk)
            out += [value & 0xFFFFFFFF, value >> 32]
            i += 2
            continue
        out.append(words[i] if words[i] is not None else rng.randrange(1 << 32))
        i += 1
    return struct.pack(f"<{len(out)}I", *out)


def view() -> AllocatorView:
    v = AllocatorView()
    v.seed(
        {
            "segments": [
                {
                    "device": 0,
                    "address": SEGMENT,
                    "total_size": 2 << 20,
                    "segment_type": "large",
                    "segment_pool_id": (0, 0),
                    "blocks": [
                        {"address": SEGMENT, "size": 0x1000, "state": "inactive"},
                        {"address": LIVE, "size": 0x8000, "state": "active_allocated"},
                        {"address": LIVE + 0x8000, "size": 0x10_0000 - 0x9000, "state": "inactive"},
                        {"address": OLD, "size": 0x1000, "state": "active_allocated"},
                        {"address": OLD + 0x1000, "size": 0x0F_F000, "state": "inactive"},
                    ],
                }
            ]
        },
        0,
    )
    return v


def elementwise(rng: random.Random, dims: int) -> KernelArgs:
    """An elementwise kernel's (int numel, closure) as PyTorch launches a strided binary op: the
    closure holds three data pointers, the calculator and a small functor."""
    data = struct.pack("<3Q", LIVE, LIVE + 0x2000, LIVE + 0x4000)
    stale = [OLD + 8 * rng.randrange(0x200) for _ in range(4)]
    closure = data + calculator(rng, dims, 3, stale) + b"\0" * 4
    return KernelArgs(
        0, "void at::native::elementwise_kernel<128, 2, ...>", b"\0" * 8 + closure, [0, 8]
    )


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("unaligned", [False, True])
def test_stale_pointers_in_a_calculator_are_not_references(seed, unaligned):
    rng = random.Random(seed)
    node = elementwise(rng, dims=rng.randint(1, 6))
    refs = references([node], view(), unaligned=unaligned)
    assert sorted(r.address for r in refs) == [LIVE, LIVE + 0x2000, LIVE + 0x4000]
    assert {(r.param, r.offset) for r in refs} == {(1, 0), (1, 8), (1, 16)}


def test_the_two_words_the_h200_reported_are_left_out():
    rng = random.Random(7)
    node = elementwise(rng, dims=2)
    buf = bytearray(node.buffer)
    for off in (64, 128):  # inside the closure: sizes_[3] and sizes_[8].m1, unread at dims 2
        struct.pack_into("<Q", buf, 8 + off, OLD + 0x400)
    node = KernelArgs(0, node.name, bytes(buf), node.offsets)
    assert OLD + 0x400 not in {r.address for r in references([node], view())}


def test_without_a_well_formed_calculator_every_word_is_still_read():
    rng = random.Random(3)
    node = elementwise(rng, dims=2)
    buf = bytearray(node.buffer)
    divisor_at = 8 + 24 + 4  # the first divider's divisor
    struct.pack_into(
        "<I", buf, divisor_at + 4, struct.unpack_from("<I", buf, divisor_at + 4)[0] ^ 1
    )
    struct.pack_into("<Q", buf, 8 + 128, OLD + 0x400)
    node = KernelArgs(0, node.name, bytes(buf), node.offsets)
    assert OLD + 0x400 in {r.address for r in references([node], view())}


def test_a_reductions_two_calculators_and_the_pointers_after_them():
    """ReduceOp keeps an input calculator (one operand), an output calculator (two) and then its
    pointers: the first calculator's length comes from the second, and the pointers stay."""
    rng = random.Random(5)
    first = calculator(rng, 2, 1, [OLD + 0x800])
    # the last one's operand count is unknown: past its first stride row it is still read (a
    # limit), so its garbage here points nowhere
    second = calculator(rng, 1, 2, [0x1234_5678_9ABC])
    tail = struct.pack("<4Q", LIVE, LIVE + 0x2000, LIVE + 0x4000, LIVE + 0x6000)
    pad = b"\0" * (-(len(first) + len(second)) % 8)  # the pointers are 8-byte aligned
    buf = first + second + pad + tail
    ranges = offset_calc.calculator_words(buf, [len(buf)])
    assert ranges == [(0, len(first)), (len(first), len(first) + 304 + 100)]
    node = KernelArgs(0, "void at::native::reduce_kernel<512, 1, ...>", buf, [0])
    refs = references([node], view())
    assert sorted(r.address for r in refs) == [LIVE, LIVE + 0x2000, LIVE + 0x4000, LIVE + 0x6000]


def test_a_calculator_ending_its_parameter_has_its_operand_count_from_the_end():
    rng = random.Random(11)
    calc = calculator(rng, 3, 3, [OLD])
    assert offset_calc.calculator_words(calc + b"\0" * 4, [len(calc) + 4]) == [(0, len(calc))]
    # another parameter after it: the end of the calculator's own parameter counts
    two = calc + b"\0" * 4 + struct.pack("<Q", LIVE)
    assert offset_calc.calculator_words(two, [len(calc) + 4, len(two)]) == [(0, len(calc))]
    # pointers after it in the same parameter: only what is certainly its own is left out
    same = calc + struct.pack("<3Q", LIVE, LIVE, LIVE)
    assert offset_calc.calculator_words(same, [len(same)]) == [(0, 304 + 100)]

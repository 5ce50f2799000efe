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
from graphsan.core.allocview import AllocatorView
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
    triples = np.array([divider(3), divider(1000), divider(1 << 20)], dtype=np.uint32)
    assert offset_calc.dividers_ok(triples[:, 0], triples[:, 1], triples[:, 2]).all()
    bad = triples.copy()
    bad[0, 1] += 1  # a magic number one off
    assert not offset_calc.dividers_ok(bad[:, 0], bad[:, 1], bad[:, 2])[0]


def calculator(
    rng: random.Random, dims: int, operands: int, stale: list[int], far: list[int] | None = None
) -> bytes:
    """An OffsetCalculator<operands> as launched: `dims` filled entries, the rest host garbage.
    `stale` 64-bit words go where the scan leaves words out (the unused dividers and the first
    25 stride words); `far` ones (default: random non-addresses) into the strides past those."""
    words = [dims]
    # one dimension of a power-of-two size is too little evidence (see the test below)
    sizes = [3, 7, 48, 51, 100, 1000, 12288] + ([64, 4096] if dims > 1 else [])
    for _ in range(dims):
        words += divider(rng.choice(sizes))
    words += [None] * (3 * (offset_calc.MAX_DIMS - dims))
    words += [rng.randrange(1 << 16) for _ in range(operands * dims)]
    words += [None] * (operands * (offset_calc.MAX_DIMS - dims))
    certain = offset_calc.CERTAIN_BYTES // 4
    near, rest = iter(stale * len(words)), iter((far or [rng.getrandbits(40)]) * len(words))
    out, i = [], 0
    while i < len(words):
        if words[i] is None and i + 1 < len(words) and words[i + 1] is None and rng.random() < 0.7:
            value = next(near) if i + 1 < certain else next(rest)
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
    pointers: both are found, and the pointers stay."""
    rng = random.Random(5)
    first = calculator(rng, 2, 1, [OLD + 0x800])
    second = calculator(rng, 1, 2, [OLD + 0x800])
    tail = struct.pack("<4Q", LIVE, LIVE + 0x2000, LIVE + 0x4000, LIVE + 0x6000)
    pad = b"\0" * (-(len(first) + len(second)) % 8)  # the pointers are 8-byte aligned
    buf = first + second + pad + tail
    certain = offset_calc.CERTAIN_BYTES
    assert offset_calc.calculator_words(buf, []) == [
        (0, certain),
        (len(first), len(first) + certain),
    ]
    node = KernelArgs(0, "void at::native::reduce_kernel<512, 1, ...>", buf, [0])
    refs = references([node], view())
    assert sorted(r.address for r in refs) == [LIVE, LIVE + 0x2000, LIVE + 0x4000, LIVE + 0x6000]


def test_stride_words_past_the_first_row_are_still_read():
    """The operand count is not in the bytes: past 25 stride words a leftover pointer is still
    reported (a known limit, docs/coverage.md), and so is a real pointer right after."""
    rng = random.Random(9)
    calc = calculator(rng, 2, 3, [OLD + 0x300], far=[OLD + 0x700])
    buf = calc + b"\0" * 4 + struct.pack("<Q", LIVE)
    node = KernelArgs(0, "void at::native::elementwise_kernel<128, 2, ...>", buf, [0])
    found = {r.address for r in references([node], view())}
    assert LIVE in found and OLD + 0x700 in found and OLD + 0x300 not in found


def pytorch(buf: bytes, offsets=(0,)) -> KernelArgs:
    return KernelArgs(0, "void at::native::elementwise_kernel<128, 2, ...>", buf, list(offsets))


@pytest.mark.parametrize("unaligned", [False, True])
def test_small_ints_that_look_like_one_power_of_two_divider_are_no_calculator(unaligned):
    """[1, 2, 1, 1] (say a shape (1, 2, 1, 1)) reads as dims 1 with the divider of 2, whose magic
    number is 1: too little evidence to leave 404 bytes out."""
    buf = struct.pack("<4I", 1, 2, 1, 1) + b"\0" * 8 * 40 + struct.pack("<2Q", LIVE, LIVE + 0x2000)
    assert offset_calc.calculator_words(buf, []) == []
    refs = references([pytorch(buf + b"\0" * 80)], view(), unaligned=unaligned)
    assert sorted(r.address for r in refs) == [LIVE, LIVE + 0x2000]


def test_a_candidate_inside_a_calculator_does_not_stretch_it():
    """Leftover dividers of an earlier, larger calculator make a used divider's shift word look
    like `dims` of another calculator starting inside this one: it is not taken, and the pointer
    after the calculator stays."""
    earlier = [divider(d) for d in (7, 3, 5, 6, 9, 10, 11, 12, 13, 14, 15, 17, 18, 19, 20, 21)]
    words = [2, *divider(48), *divider(51)] + [x for t in earlier for x in t]
    words += [0] * (3 * (offset_calc.MAX_DIMS - 2 - len(earlier)))
    words += [4, 4, 4, 204, 200, 200] + [0] * 69
    calc = struct.pack(f"<{len(words)}I", *words)  # OffsetCalculator<3>, 604 bytes
    data = struct.pack("<3Q", LIVE, LIVE + 0x2000, LIVE + 0x4000)
    buf = data + calc + b"\0" * 4 + struct.pack("<Q", LIVE + 0x6000) + b"\0" * 16
    assert offset_calc.calculator_words(buf, []) == [(24, 24 + offset_calc.CERTAIN_BYTES)]
    found = {r.address for r in references([pytorch(buf)], view())}
    assert found == {LIVE, LIVE + 0x2000, LIVE + 0x4000, LIVE + 0x6000}


def test_only_pytorch_kernels_are_read_for_calculators():
    rng = random.Random(2)
    node = elementwise(rng, dims=2)
    theirs = KernelArgs(0, "void my_extension::kernel(int, Closure)", node.buffer, node.offsets)
    assert {r.address for r in references([theirs], view())} - {LIVE, LIVE + 0x2000, LIVE + 0x4000}
    assert {r.address for r in references([node], view())} == {LIVE, LIVE + 0x2000, LIVE + 0x4000}


def test_all_25_dimensions_and_calculators_that_do_not_fit_their_parameter():
    rng = random.Random(4)
    calc = calculator(rng, 25, 1, [OLD])
    assert offset_calc.calculator_words(calc, []) == [(0, offset_calc.CERTAIN_BYTES)]
    # a parameter that ends inside the certain part: not a calculator
    assert offset_calc.calculator_words(calc, [offset_calc.CERTAIN_BYTES - 4]) == []


@pytest.mark.parametrize("seed", range(5))
def test_several_kernels_scanned_together_as_each_alone(seed):
    """The aligned scan joins every kernel's bytes (each cut to a multiple of 8): the calculators
    found, and the references, are those of each kernel scanned on its own."""
    rng = random.Random(seed)
    plain = KernelArgs(0, "void cutlass::Kernel<...>", struct.pack("<QI", OLD, 7) + b"\0", [0, 8])
    nodes = [plain]
    for i in range(1, 4):
        e = elementwise(rng, dims=rng.randint(1, 4))
        cut = rng.choice([0, 4])  # a buffer whose length is not a multiple of 8
        nodes.append(KernelArgs(i, e.name, e.buffer[: len(e.buffer) - cut], e.offsets))
    together = sorted((r.node, r.address) for r in references(nodes, view()))
    alone = sorted((r.node, r.address) for n in nodes for r in references([n], view()))
    assert together == alone
    assert (0, OLD) in together  # the non-PyTorch kernel's word is read as before
    for unaligned in (False, True):
        for n in nodes[1:]:
            got = {r.address for r in references([n], view(), unaligned=unaligned)}
            assert got == {LIVE, LIVE + 0x2000, LIVE + 0x4000}

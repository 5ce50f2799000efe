"""Reading a kernel node's parameter block from its `kernelParams` pointers, on CPU (host memory
stands in for the driver's copy of the node; no driver call is made)."""

from __future__ import annotations

import ctypes
import random
import types

import pytest

pytest.importorskip("cuda.bindings")

from graphsan.cuda import driver  # noqa: E402


def one_by_one(ptrs, layout, size) -> bytes:
    """Each parameter read on its own, zeros elsewhere (the reference)."""
    buf = bytearray(size)
    for (off, sz), ptr in zip(layout, ptrs, strict=True):
        if ptr:
            buf[off : off + sz] = ctypes.string_at(ptr, sz)
    return bytes(buf)


def random_layout(rng: random.Random) -> tuple[tuple[int, int], ...]:
    layout, off = [], 0
    for _ in range(rng.randrange(1, 12)):
        sz = rng.choice([1, 4, 8, 8, 16, 24, 600])
        off += -off % min(sz, 8)  # natural alignment
        layout.append((off, sz))
        off += sz
    return tuple(layout)


@pytest.mark.parametrize("seed", range(40))
def test_one_read_gives_what_reading_each_parameter_gives(seed):
    rng = random.Random(seed)
    layout = random_layout(rng)
    size = max(off + sz for off, sz in layout)
    # the node's copy: an arena of random bytes (the padding too), parameters placed
    # as the ABI lays them out, shuffled, or each in its own buffer pages apart
    arena = ctypes.create_string_buffer(bytes(rng.getrandbits(8) for _ in range(3 * size + 64)))
    keep = [arena]
    base = ctypes.addressof(arena)
    how = rng.choice(["abi", "shuffled", "apart"])
    if how == "abi":
        ptrs = [base + 8 + off for off, _ in layout]
    elif how == "shuffled":
        slots = list(range(len(layout)))
        rng.shuffle(slots)
        ptrs = [base + slot * (size // len(layout) + 600) % (2 * size) for slot in slots]
    else:
        ptrs = []
        for _, sz in layout:
            own = ctypes.create_string_buffer(
                bytes(rng.getrandbits(8) for _ in range(sz)), 3 * 4096
            )
            keep.append(own)
            ptrs.append(ctypes.addressof(own))
    for i in range(len(ptrs)):
        if rng.random() < 0.1:
            ptrs[i] = None  # a null parameter pointer reads as zeros
    got = driver.gather(ptrs, layout, size)
    assert got == one_by_one(ptrs, layout, size)
    assert len(got) == size


def test_an_empty_parameter_far_away_does_not_widen_the_read(monkeypatch):
    layout = ((0, 8), (8, 0), (8, 8))
    arena = ctypes.create_string_buffer(b"\x01" * 16)
    base = ctypes.addressof(arena)
    reads = []
    real = ctypes.string_at
    monkeypatch.setattr(ctypes, "string_at", lambda p, n: reads.append((p, n)) or real(p, n))
    got = driver.gather([base, 0x10, base + 8], layout, 16)  # 0x10: never mapped
    assert got == b"\x01" * 16 and reads == [(base, 16)]


def test_padding_between_parameters_reads_as_zeros():
    layout = ((0, 4), (8, 8))  # an int, 4 bytes of padding, a pointer
    arena = ctypes.create_string_buffer(b"\xff" * 16)
    base = ctypes.addressof(arena)
    assert driver.gather([base, base + 8], layout, 16) == b"\xff" * 4 + bytes(4) + b"\xff" * 8


def test_a_kernel_node_is_read_through_its_function_layout(monkeypatch):
    layout = ((0, 4), (8, 8), (16, 8))
    values = [ctypes.c_int32(7), ctypes.c_uint64(0x7F00_0000_1000), ctypes.c_double(1.5)]
    params = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in values])
    info = driver.FunctionInfo("axpy", layout, 24, (0, 8, 16), ctypes.c_void_p * 3)
    asked = []
    monkeypatch.setattr(
        driver, "function_info", lambda h, is_kernel: asked.append((h, is_kernel)) or info
    )
    node = types.SimpleNamespace(
        func=0x1234,
        kern=0,
        kernelParams=ctypes.addressof(params),
        extra=0,
        gridDimX=40,
        gridDimY=2,
        gridDimZ=1,
    )
    monkeypatch.setattr(driver.drv, "cuGraphKernelNodeGetParams", lambda n: (driver._SUCCESS, node))
    got = driver._read_kernel("node", 5)
    want = bytes(values[0]) + bytes(4) + bytes(values[1]) + bytes(values[2])
    assert (got.index, got.name, got.buffer, got.offsets) == (5, "axpy", want, [0, 8, 16])
    assert got.grid == (40, 2, 1)  # the launch shape: which struct entries the launch fills
    assert asked == [(0x1234, False)]

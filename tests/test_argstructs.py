"""CPU: PyTorch's by-value argument structs read the way the kernel reads them
(`graphsan.core.argstructs`), and their layouts solved from known launches
(`graphsan.core.calibration`).

Two sources of bytes: kernel nodes recorded on an NVIDIA H200 with torch 2.11.0+cu130
(tests/data, 4 KB argument tables), and structs built here from the C++ definitions with both
table families (4 KB: 110/64/48/36/30 tensors, 320 one-byte block indices; 32 KB: 770/448/336/
252/210 tensors, 2240 two-byte indices), their unused slots filled with device addresses, as a
host stack leaves them.
"""

from __future__ import annotations

import base64
import gzip
import json
import random
import struct
from pathlib import Path

import numpy as np
import pytest

from graphsan.core import argstructs as A
from graphsan.core import kernel_names, mta
from graphsan.core.calibration import Probe, solve, solve_closure, solve_mta
from graphsan.core.memory_map import MemoryMap
from graphsan.core.records import KernelArgs
from graphsan.core.scan import references

DATA = Path(__file__).parent / "data" / "h200-torch2.11-argstructs.json.gz"
START = (
    ("FusedOptimizerTensorListMetadata", True),
    ("TensorListMetadata", True),
    ("TensorListScalarListMetadata", False),
)
H200 = A.Layouts(
    mta=A.MtaLayout(1, 320, 65536, START),
    max_dims=25,
    closure=True,
    reduce=True,
    cat=True,
    pointer_list=True,
    tensor_info=True,
)
CHUNK = 65536
BASE = 0x7F0000000000


@pytest.fixture(scope="module")
def h200():
    with gzip.open(DATA, "rt") as fh:
        return json.load(fh)["nodes"]


def memory(blocks: list[tuple[int, int]]) -> MemoryMap:
    """A map of allocated blocks (address, bytes), one segment each."""
    segs = [
        {
            "address": a,
            "total_size": n,
            "blocks": [{"address": a, "size": n, "state": "active_allocated"}],
        }
        for a, n in blocks
    ]
    return MemoryMap.from_snapshot({"segments": segs})


def node_of(rec: dict) -> KernelArgs:
    return KernelArgs(
        0, rec["name"], base64.b64decode(rec["buffer"]), rec["offsets"], tuple(rec["grid"])
    )


def dropped(rec: dict, layouts: A.Layouts = H200) -> tuple[list, list]:
    """The recorded references the decoder drops, and those it keeps."""
    n = node_of(rec)
    d = A.decode(n.name, n.buffer, n.offsets, n.grid, layouts)
    out, kept = [], []
    for param, off, addr in rec["refs"]:
        at = n.offsets[param] + off
        (out if any(a <= at < b for a, b in d.dead) else kept).append((param, off, addr))
    return out, kept


# ----------------------------------------------------------------------------- recorded on the H200
def test_the_transformer_false_alarm_sits_in_an_unused_stride_row(h200):
    """The selftest's one false alarm before decoding: elementwise_kernel param 1 byte 464, a
    stale word in stride row 20 of a one-dimension calculator; the data array stays."""
    out, kept = dropped(h200["closure:transformer"])
    assert [(p, o) for p, o, _ in out] == [(1, 464)]
    assert [(p, o) for p, o, _ in kept] == [(1, 504), (1, 512)]


@pytest.mark.parametrize(
    "key",
    [
        "mta:TensorListMetadata1",
        "mta:TensorListMetadata2",
        "mta:TensorListMetadata3",
        "mta:TensorListScalarListMetadata2",
        "mta:FusedOptimizerTensorListMetadata4",
        "mta:FusedOptimizerTensorListMetadata5",
    ],
)
def test_a_multi_tensor_launch_reads_the_slots_its_blocks_name(h200, key):
    rec = h200[key]
    n = node_of(rec)
    (index, _, type_name), *_ = A.plan(n.name)
    data = n.buffer[n.offsets[index] : n.offsets[index + 1]]
    shape = mta.mta_shape(*mta.mta_kind(type_name), len(data), H200.mta)
    live = set(mta.launch_tensors(data, shape, n.grid[0], CHUNK))
    b2t = np.frombuffer(data, "<u1", n.grid[0], shape.block_to_tensor)
    assert live == set(b2t.tolist()) and len(live) < shape.tensors
    out, kept = dropped(rec)
    assert out  # the stale slots the scan took as references before
    for param, off, _ in kept:
        if param == index:
            slot = off // 8 % shape.tensors if off < shape.numel else (off - shape.extra) // 8
            assert slot in live, (param, off)
    for param, off, _ in out:
        assert param == index and not (off < shape.numel and off // 8 % shape.tensors in live)


def test_a_full_reduction_has_an_output_calculator_of_no_dimension(h200):
    rec = h200["reduce:full"]
    n = node_of(rec)
    assert A.decode(n.name, n.buffer, n.offsets, n.grid, H200).unsure == []
    out, kept = dropped(rec)
    size = len(n.buffer)  # the tail: src, dst[0], dst[1] (one output: unused), buffers
    assert out and all(o < size - 64 or o == size - 48 for _, o, _ in out)
    assert all(size - 64 <= o != size - 48 for _, o, _ in kept)


def test_cat_pointer_list_and_tensor_info_recorded(h200):
    out, kept = dropped(h200["cat"])
    n = node_of(h200["cat"])
    assert out and all(o < 8 * n.grid[1] for p, o, _ in kept if p == 1)
    assert all(o >= 8 * n.grid[1] for _, o, _ in out)
    out, kept = dropped(h200["pointer_list"])  # 400 tensors, 400 blocks: every slot read
    assert out == [] and len(kept) == 401
    out, _ = dropped(h200["tensor_info"])
    assert out


def test_unconfirmed_layouts_keep_every_word_with_a_caveat(h200):
    rec = h200["mta:TensorListMetadata2"]
    n = node_of(rec)
    d = A.decode(n.name, n.buffer, n.offsets, n.grid, A.NOT_CALIBRATED)
    assert d.dead == [] and d.unsure == [(0, n.offsets[1])]
    assert d.caveat.startswith("unconfirmed layout (TensorListMetadata<2>")
    # through the scan: the same words, each reference into the struct carrying the caveat
    addrs = sorted({a for _, _, a in rec["refs"]})
    memmap = memory([(a, 8) for a in addrs])
    refs = references([n], memmap, layouts=A.NOT_CALIBRATED)
    assert len(refs) == len({a for p, _, a in rec["refs"]})
    assert all(r.caveat and "unconfirmed layout" in r.caveat for r in refs if r.param == 0)
    decoded = references([n], memmap, layouts=H200)
    assert len(decoded) < len(refs) and not any(r.caveat for r in decoded)


def test_bytes_that_contradict_the_layout_are_scanned_with_a_caveat(h200):
    rec = dict(h200["mta:TensorListMetadata2"])
    n = node_of(rec)
    shape = mta.mta_shape(*mta.mta_kind(A.plan(n.name)[0][2]), n.offsets[1], H200.mta)
    buf = bytearray(n.buffer)
    buf[shape.block_to_tensor] = 7  # the first block must start at slot 0
    d = A.decode(n.name, bytes(buf), n.offsets, n.grid, H200)
    assert d.unsure and "bytes do not fit it" in d.caveat


# ----------------------------------------------------------------------------- built here
TABLES = {  # (tensors by depth, blocks, index bytes)
    "4KB": ((110, 64, 48, 36, 30), 320, 1),
    "32KB": ((770, 448, 336, 252, 210), 2240, 2),
}
SCALAR_TENSORS = {"4KB": (96, 64, 48, 36, 30), "32KB": (672, 448, 336, 252, 210)}
KERNEL = (
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<{T}, at::native::"
    "(anonymous namespace)::F<float, 2>, float>({T}, at::native::(anonymous namespace)::F<float, 2>, float)"
)


def _up(n, k):
    return -(-n // k) * k


def build_mta(kind, depth, table, tensors_used, numel, rng, scalar=False):
    """A metadata struct as multi_tensor_apply fills it for one launch over `tensors_used`
    tensors, every other byte an address left on the stack; (node, lists, steps)."""
    ts, blocks, width = TABLES[table]
    t = (SCALAR_TENSORS[table] if kind == "TensorListScalarListMetadata" else ts)[depth - 1]
    junk = lambda: BASE + rng.randrange(1 << 30) * 16  # noqa: E731
    lists = [[junk() for _ in range(tensors_used)] for _ in range(depth)]
    steps = [junk() for _ in range(tensors_used)]
    data = bytearray()
    for _ in range(4096):
        data += struct.pack("<Q", junk())
    extra = 4 if kind == "TensorListScalarListMetadata" else 8 if kind.startswith("Fused") else 0
    b2t = _up(8 * (depth + 1) * t, 4 if extra == 4 else 8) + extra * t
    b2c = _up(b2t + width * blocks, 4)
    start = kind != "TensorListScalarListMetadata"
    size = _up(b2c + 4 * blocks + (4 if start else 0), 8)
    data = data[:size]
    for d in range(depth):
        for i, a in enumerate(lists[d]):
            struct.pack_into("<Q", data, 8 * (d * t + i), a)
    for i, n in enumerate(numel):
        struct.pack_into("<q", data, 8 * depth * t + 8 * i, n)
    if kind.startswith("Fused"):
        for i, a in enumerate(steps):
            struct.pack_into("<Q", data, 8 * (depth + 1) * t + 8 * i, a)
    if scalar:
        for i in range(tensors_used):
            struct.pack_into("<f", data, 8 * (depth + 1) * t + 4 * i, 0.5 + i)
    b = 0
    for i, n in enumerate(numel):
        for c in range(-(-n // CHUNK)):
            struct.pack_into("<B" if width == 1 else "<H", data, b2t + width * b, i)
            struct.pack_into("<i", data, b2c + 4 * b, c)
            b += 1
    args = f"float, {depth}" if kind == "TensorListScalarListMetadata" else str(depth)
    type_name = f"at::native::(anonymous namespace)::{kind}<{args}>"
    name = KERNEL.format(T=type_name)
    return KernelArgs(0, name, bytes(data) + bytes(8), [0, size, size + 4], (b, 1, 1)), lists, steps


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize(
    "kind,depth",
    [
        ("TensorListMetadata", 2),
        ("TensorListScalarListMetadata", 1),
        ("FusedOptimizerTensorListMetadata", 4),
    ],
)
def test_the_layout_is_solved_from_a_known_launch(table, kind, depth):
    rng = random.Random(f"{table}{kind}")
    numel = [2 * CHUNK + 5, CHUNK + 1001, 3, 3 * CHUNK + 77]
    node, lists, steps = build_mta(
        kind, depth, table, 4, numel, rng, kind.endswith("ListMetadata") and "Scalar" in kind
    )
    known = {"lists": lists, "numel": numel, "chunk": CHUNK}
    if kind.startswith("Fused"):
        known["steps"] = steps
    if "Scalar" in kind:
        known["scalars"] = [0.5 + i for i in range(4)]
    layout, why = solve_mta(Probe("multi_tensor_apply", node, known))
    _, blocks, width = TABLES[table]
    assert why == "" and (layout.index_bytes, layout.max_blocks, layout.chunk) == (
        width,
        blocks,
        CHUNK,
    )
    assert layout.has_start(kind) is (kind != "TensorListScalarListMetadata")


@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_every_depth_decodes_from_its_size_alone(table, depth):
    """Calibration probes one depth; the tensor count of every other follows from its size."""
    rng = random.Random(depth)
    used = 7
    numel = [rng.randrange(1, 3 * CHUNK) for _ in range(used)]
    node, lists, _ = build_mta("TensorListMetadata", depth, table, used, numel, rng)
    _, blocks, width = TABLES[table]
    layouts = A.Layouts(mta=A.MtaLayout(width, blocks, CHUNK, START))
    d = A.decode(node.name, node.buffer, node.offsets, node.grid, layouts)
    assert d.unsure == []
    live = {a for lst in lists for a in lst}
    words = np.frombuffer(node.buffer[: node.offsets[1]], "<u8")
    for i, w in enumerate(words.tolist()):
        dead = any(a <= 8 * i < b for a, b in d.dead)
        if int(w) in live and not dead:
            live.discard(int(w))
        else:
            assert dead or int(w) < 1 << 32, i  # a stale address must be in a dead range
    assert live == set()  # every address the launch uses is kept


def _divider(d: int) -> tuple[int, int, int]:
    shift = max(d - 1, 0).bit_length()
    return d, ((1 << 32) * ((1 << shift) - d)) // d + 1, shift


def build_closure(dims_sizes, ptrs, rng, max_dims=25, functor=8):
    """A TensorIterator closure: the calculator (dims, dividers, strides [max_dims][nargs]),
    then the data array, then a functor; unused entries hold stale addresses."""
    nargs = len(ptrs)
    calc = A.calculator_bytes(nargs, max_dims)
    data_at = _up(calc, 8)
    size = _up(data_at + 8 * nargs + functor, 8)
    buf = bytearray(
        b"".join(struct.pack("<Q", BASE + rng.randrange(1 << 30) * 16) for _ in range(size // 8))
    )
    struct.pack_into("<I", buf, 0, len(dims_sizes))
    for i, s in enumerate(dims_sizes):
        struct.pack_into("<3I", buf, 4 + 12 * i, *_divider(s))
        for j in range(nargs):
            struct.pack_into("<I", buf, 4 + 12 * max_dims + 4 * (nargs * i + j), 4 * (j + 1))
    for j, p in enumerate(ptrs):
        struct.pack_into("<Q", buf, data_at + 8 * j, p)
    buf[data_at + 8 * nargs :] = bytes(size - data_at - 8 * nargs)  # the functor: a scalar
    lam = (
        "at::native::gpu_kernel_impl_nocast<F>(at::TensorIteratorBase&, F const&)::{lambda(int)#1}"
    )
    name = f"void at::native::elementwise_kernel<128, 2, {lam}>(int, {lam})"
    return KernelArgs(0, name, bytes(8) + bytes(buf), [0, 8], (64, 1, 1))


@pytest.mark.parametrize("dims_sizes", [[1024], [128, 64], [7, 3, 5], [2] * 10])
@pytest.mark.parametrize("nargs", [2, 3, 4])
def test_a_closure_keeps_its_data_array_and_drops_its_unused_entries(dims_sizes, nargs):
    rng = random.Random(nargs * 100 + len(dims_sizes))
    ptrs = [BASE + (1 << 40) + 4096 * i for i in range(nargs)]
    node = build_closure(dims_sizes, ptrs, rng)
    probe = Probe("closure", node, {"data": ptrs, "dims": len(dims_sizes)})
    assert solve_closure(probe) == (25, "")
    memmap = memory([(BASE, 1 << 41)])
    refs = references([node], memmap, layouts=H200)
    assert sorted(r.address for r in refs) == sorted(set(ptrs))


def test_solve_confirms_what_the_probes_show_and_names_what_they_do_not():
    rng = random.Random(5)
    numel = [2 * CHUNK + 5, CHUNK + 1001, 3, 3 * CHUNK + 77]
    node, lists, _ = build_mta("TensorListMetadata", 2, "32KB", 4, numel, rng)
    ptrs = [BASE + (1 << 40), BASE + (1 << 40) + 4096]
    probes = [
        Probe("multi_tensor_apply", node, {"lists": lists, "numel": numel, "chunk": CHUNK}),
        Probe("closure", build_closure([128, 64], ptrs, rng), {"data": ptrs, "dims": 2}),
    ]
    layouts = solve(probes, "2.13.0", {"cat": "the probe failed: RuntimeError: x"})
    assert layouts.mta == A.MtaLayout(2, 2240, CHUNK, (("TensorListMetadata", True),))
    assert layouts.max_dims == 25 and layouts.confirmed("closure")
    assert (
        not layouts.confirmed("cat")
        and layouts.reason("cat") == "the probe failed: RuntimeError: x"
    )
    assert layouts.reason("reduce") == "no reduce launch was probed"
    # a kind that was not probed stays unconfirmed: its structs are scanned, with the caveat
    fused, _, _ = build_mta("FusedOptimizerTensorListMetadata", 4, "32KB", 4, numel, rng)
    d = A.decode(fused.name, fused.buffer, fused.offsets, fused.grid, layouts)
    assert d.unsure and "unconfirmed layout" in d.caveat


def test_a_probe_whose_bytes_do_not_fit_says_why():
    rng = random.Random(9)
    numel = [2 * CHUNK + 5, CHUNK + 1001, 3, 3 * CHUNK + 77]
    node, lists, _ = build_mta("TensorListMetadata", 2, "4KB", 4, numel, rng)
    layout, why = solve_mta(
        Probe("multi_tensor_apply", node, {"lists": lists[::-1], "numel": numel, "chunk": CHUNK})
    )
    assert layout is None and "not where the struct starts" in why
    wrong = KernelArgs(0, node.name, node.buffer, node.offsets, (3, 1, 1))
    layout, why = solve_mta(
        Probe("multi_tensor_apply", wrong, {"lists": lists, "numel": numel, "chunk": CHUNK})
    )
    assert layout is None and "blocks" in why


def test_parameter_types_of_demangled_names():
    assert kernel_names.parameter_types("void k<a, b<c, d> >(int, b<c, d>, float*)") == [
        "int",
        "b<c, d>",
        "float*",
    ]
    lam = "at::native::gpu_kernel_impl_nocast<F<(anonymous namespace)::G> >(at::TensorIteratorBase&, F const&)::{lambda(int)#1}"
    assert kernel_names.parameter_types(
        f"void at::native::elementwise_kernel<128, 2, {lam}>(int, {lam})"
    ) == [
        "int",
        lam,
    ]
    assert kernel_names.parameter_types("nvjet_sm90_tst_32x64") == []
    assert (
        kernel_names.template_args("x::CatArrInputTensorMetadata<float, unsigned int, 128, 4>")[2]
        == "128"
    )


# ----------------------------------------------------------------------------- the H200's probe
PROBES = Path(__file__).parent / "data" / "h200-torch2.11-probes.json.gz"


def h200_probes() -> list[Probe]:
    with gzip.open(PROBES, "rt") as fh:
        data = json.load(fh)
    return [Probe(p["family"], node_of(p), p["known"]) for p in data["probes"]]


def test_the_h200s_probe_confirms_every_family_with_its_4kb_tables():
    layouts = solve(h200_probes(), "2.11.0+cu130")
    assert layouts.summary() == dict.fromkeys(A.FAMILIES, "confirmed")
    assert (layouts.mta.index_bytes, layouts.mta.max_blocks, layouts.mta.chunk) == (1, 320, CHUNK)
    assert dict(layouts.mta.start_field) == dict(START) and layouts.max_dims == 25


def test_a_stale_copy_of_an_operand_before_the_data_array_does_not_mislead_the_probe():
    """Under graphsan the host stack can hold the output's address twice: once stale, in the
    calculator's unused entries, and once in the data array."""
    probes = [p for p in h200_probes() if p.family == "closure"]
    p = probes[0]
    buf = bytearray(p.node.buffer)
    struct.pack_into("<Q", buf, p.node.offsets[1] + 64, p.known["data"][0])
    stale = KernelArgs(0, p.node.name, bytes(buf), p.node.offsets, p.node.grid)
    assert solve_closure(Probe("closure", stale, p.known)) == (25, "")

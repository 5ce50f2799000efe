"""Confirming argument-struct layouts on the running torch (pure: bytes and known values in,
`argstructs.Layouts` out).

`graphsan.cuda.calibrate` captures a few launches whose contents it knows (which tensors, how
many elements, which outputs) and walks them; the solvers here find each family's parameters in
those bytes (where the known addresses sit, how wide a block index is, how many dimensions an
`OffsetCalculator` holds) and check them against what `argstructs` will assume when it decodes
the user's graphs. A family whose probe is missing or does not fit stays unconfirmed, with the
reason.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from graphsan.core import argstructs as A
from graphsan.core.kernel_names import template_args
from graphsan.core.mta import MtaLayout, launch_tensors, mta_kind, mta_shape
from graphsan.core.records import KernelArgs


@dataclass
class Probe:
    """One known launch: the node the capture recorded and what its arguments must hold.

    `known` per family:
      multi_tensor_apply: lists (per depth, the tensors' addresses), numel, chunk, and either
        scalars (float values) or steps (state-step addresses);
      closure: data (the operands' addresses, output first), dims;
      reduce: src, dst (one or two addresses);
      cat: inputs (every input's address, in order);
      pointer_list: addresses;
      tensor_info: data (the first TensorInfo's address), max_dims_at_most (its dims at most).
    """

    family: str
    node: KernelArgs
    known: dict = field(default_factory=dict)


def _words(data: bytes) -> np.ndarray:
    return np.frombuffer(data[: len(data) // 8 * 8], "<u8")


def _find_run(data: bytes, values: list[int], start: int = 0) -> int:
    """Byte offset of the first 8-aligned run of words equal to `values`, at or after `start`,
    or -1. (A run, not a first word: stale copies of one address sit elsewhere in a struct.)"""
    words = _words(data)
    n = len(values)
    for i in np.flatnonzero(words == np.uint64(values[0])).tolist():
        if 8 * i >= start and [int(w) for w in words[i : i + n]] == list(values):
            return 8 * i
    return -1


def _param(node: KernelArgs, index: int) -> bytes:
    offsets = node.offsets
    end = offsets[index + 1] if index + 1 < len(offsets) else len(node.buffer)
    return node.buffer[offsets[index] : end]


def _struct_param(node: KernelArgs, family: str) -> tuple[int, str] | None:
    for index, fam, type_name in A.plan(node.name):
        if fam == family:
            return index, type_name
    return None


# ----------------------------------------------------------------------------- multi_tensor_apply
def solve_mta(probe: Probe) -> tuple[MtaLayout | None, str]:
    """The block-index width, block count and chunk of one probed metadata struct, and whether
    its kind ends with start_tensor_this_launch; (None, why) where the bytes do not show them."""
    found = _struct_param(probe.node, "multi_tensor_apply")
    if found is None:
        return None, f"the probe's kernel has no metadata struct ({probe.node.name[:80]})"
    index, type_name = found
    kind_depth = mta_kind(type_name)
    if kind_depth is None:
        return None, f"cannot size {type_name}"
    kind, depth, scalar_bytes = kind_depth
    data = _param(probe.node, index)
    k = probe.known
    lists, numel, chunk = k["lists"], k["numel"], k["chunk"]
    if len(lists) != depth:
        return None, f"the probe has {len(lists)} lists, the struct {depth}"
    if _find_run(data, lists[0]) != 0:
        return None, "the first tensor's address is not where the struct starts"
    tensors = None
    if depth >= 2:
        at = _find_run(data, lists[1], 8 * len(lists[0]))
        tensors = at // 8 if at > 0 else None
    else:
        hits = np.flatnonzero(_words(data) == np.uint64(numel[0]))
        tensors = int(hits[0]) if len(hits) else None
    if not tensors:
        return None, "the second list's addresses (or the element counts) were not found"
    for d, addrs in enumerate(lists):
        got = [int(w) for w in _words(data)[d * tensors : d * tensors + len(addrs)]]
        if got != list(addrs):
            return None, f"list {d}'s addresses are not in its slots"
    got = [int(w) for w in _words(data)[depth * tensors : depth * tensors + len(numel)]]
    if got != list(numel):
        return None, "the element counts are not after the addresses"
    after = 8 * (depth + 1) * tensors
    if kind == "FusedOptimizerTensorListMetadata":
        steps = [int(w) for w in _words(data)[(depth + 1) * tensors :][: len(k["steps"])]]
        if steps != list(k["steps"]):
            return None, "the step tensors' addresses are not after the element counts"
        after += 8 * tensors
    elif kind == "TensorListScalarListMetadata":
        align = max(min(scalar_bytes, 16), 1)
        after = -(-after // align) * align
        fmt = {4: "<f", 8: "<d"}.get(scalar_bytes)
        if fmt is None:
            return None, f"cannot read {scalar_bytes}-byte scalars"
        vals = [
            struct.unpack_from(fmt, data, after + scalar_bytes * i)[0]
            for i in range(len(k["scalars"]))
        ]
        if any(
            abs(a - b) > 1e-6 * max(1.0, abs(b)) for a, b in zip(vals, k["scalars"], strict=True)
        ):
            return None, "the scalars are not after the element counts"
        after += scalar_bytes * tensors
    blocks = [(t, c) for t, n in enumerate(numel) for c in range(-(-n // chunk))]
    if probe.node.grid[0] != len(blocks):
        return (
            None,
            f"the launch has {probe.node.grid[0]} blocks, {chunk}-element chunks give {len(blocks)}",
        )
    b2t = [t for t, _ in blocks]
    b2c = np.array([c for _, c in blocks], dtype="<i4").tobytes()
    width = None
    for w in (1, 2, 4):
        if (
            after + w * len(b2t) <= len(data)
            and np.frombuffer(data, f"<u{w}", len(b2t), after).tolist() == b2t
        ):
            width = w
            break
    if width is None:
        return None, "block_to_tensor is not after the addresses and counts"
    q = -(-(after + width * len(b2t)) // 4) * 4
    while q + len(b2c) <= len(data) and data[q : q + len(b2c)] != b2c:
        q += 4
    if q + len(b2c) > len(data):
        return None, "block_to_chunk was not found after block_to_tensor"
    size = len(data)
    # the block count whose table pads to where block_to_chunk starts (the round one first),
    # with or without start_tensor_this_launch: the one that gives the struct's size
    for max_blocks in range((q - after) // width, len(b2t) - 1, -1):
        if -(-(after + width * max_blocks) // 4) * 4 != q:
            break
        for start in (True, False):
            layout = MtaLayout(width, max_blocks, chunk, ((kind, start),))
            shape = mta_shape(kind, depth, scalar_bytes, size, layout)
            if shape is None or shape.tensors != tensors or shape.block_to_chunk != q:
                continue
            if launch_tensors(data, shape, len(b2t), chunk) != list(range(len(numel))):
                return None, "the block tables do not name the probe's tensors"
            return layout, ""
    return None, f"no layout gives the struct's {size} bytes"


def merge_mta(solved: list[MtaLayout]) -> tuple[MtaLayout | None, str]:
    """One layout from the kinds probed: they must agree on the tables they share."""
    if not solved:
        return None, "no metadata struct could be probed"
    first = solved[0]
    for other in solved[1:]:
        same = (other.index_bytes, other.max_blocks, other.chunk)
        if same != (first.index_bytes, first.max_blocks, first.chunk):
            return None, "the probed kinds disagree on the block tables"
    kinds = tuple(sorted({kv for s in solved for kv in s.start_field}))
    return MtaLayout(first.index_bytes, first.max_blocks, first.chunk, kinds), ""


# ----------------------------------------------------------------------------- calculators
def solve_closure(probe: Probe) -> tuple[int | None, str]:
    """MAX_DIMS of PyTorch's OffsetCalculator, from a TensorIterator closure whose operands and
    dims are known; (None, why) where the closure does not start with the calculator or its
    data array is not where `argstructs` looks for it."""
    found = _struct_param(probe.node, "closure")
    if found is None:
        return None, f"the probe's kernel is no TensorIterator closure ({probe.node.name[:80]})"
    data = _param(probe.node, found[0])
    ptrs, dims = probe.known["data"], probe.known["dims"]
    at = _find_run(data, ptrs)
    if at < 0:
        found = [8 * int(i) for i in np.flatnonzero(_words(data) == np.uint64(ptrs[0]))]
        return None, (
            f"the operands' addresses were not found together ({len(data)}-byte closure; the "
            f"output's address at bytes {found[:4]})"
        )
    nargs = len(ptrs)
    for max_dims in range(1, 65):
        if -(-A.calculator_bytes(nargs, max_dims) // 8) * 8 == at:
            break
    else:
        return None, "the data array is not where a calculator of any size would end"
    if A.calculator_dims(data, 0, max_dims) != dims:
        return None, f"the calculator at the closure's start does not hold {dims} dimensions"
    if A.closure_nargs(len(data), max_dims) != nargs:
        return None, "the closure's size does not give its operand count"
    return max_dims, ""


def solve_reduce(probe: Probe, max_dims: int) -> tuple[bool, str]:
    """Whether a ReduceOp ends as `argstructs` reads it: src, dst[0], dst[1] at the tail,
    noutputs last, both calculators just before."""
    found = _struct_param(probe.node, "reduce")
    if found is None:
        return False, f"the probe's kernel has no ReduceOp ({probe.node.name[:80]})"
    data = _param(probe.node, found[0])
    tail = len(data) - A.REDUCE_TAIL
    src, dst = probe.known["src"], probe.known["dst"]
    words = struct.unpack_from("<3Q", data, tail)
    if words[0] != src or list(words[1 : 1 + len(dst)]) != list(dst):
        return False, "src and dst are not at the struct's tail"
    if struct.unpack_from("<i", data, len(data) - 4)[0] != len(dst):
        return False, "noutputs is not the struct's last word"
    layouts = A.Layouts(max_dims=max_dims, reduce=True)
    if A._decode_reduce("", data, probe.node.grid, layouts) is None:
        return False, "the calculators are not before the tail"
    return True, ""


# ----------------------------------------------------------------------------- pointer arrays
def solve_cat(probes: list[Probe]) -> tuple[bool, str]:
    """Whether each batched-cat launch reads input[0 .. grid.y-1] (at least one launch short
    of a full batch). `known["inputs"]` is every input of the cat, in order."""
    if not probes:
        return False, "no batched cat launch was probed"
    short = False
    for p in probes:
        found = _struct_param(p.node, "cat")
        if found is None:
            return False, f"the probe's kernel has no cat metadata ({p.node.name[:80]})"
        index, type_name = found
        data, count = _param(p.node, index), p.node.grid[1]
        inputs = list(p.known["inputs"])
        first = int(_words(data)[0]) if len(data) >= 8 else 0
        at = inputs.index(first) if first in inputs else -1
        got = [int(w) for w in _words(data)[:count]]
        if at < 0 or got != inputs[at : at + count]:
            return False, "the batch's inputs are not input[0 .. grid.y-1]"
        batch = int(template_args(type_name[type_name.find("CatArrInputTensorMetadata") :])[2])
        short |= count < batch
    return (True, "") if short else (False, "no probed launch had a short batch")


def solve_pointer_list(probe: Probe) -> tuple[bool, str]:
    found = _struct_param(probe.node, "pointer_list")
    if found is None:
        return False, f"the probe's kernel has no address list ({probe.node.name[:80]})"
    data = _param(probe.node, found[0])
    want = probe.known["addresses"]
    if probe.node.grid[0] != len(want) or [int(w) for w in _words(data)[: len(want)]] != list(want):
        return False, "the list's addresses are not addresses[0 .. grid.x-1]"
    return True, ""


def solve_tensor_info(probe: Probe, max_dims: int) -> tuple[bool, str]:
    found = _struct_param(probe.node, "tensor_info")
    if found is None:
        return False, f"the probe's kernel has no TensorInfo ({probe.node.name[:80]})"
    index, type_name = found
    data = _param(probe.node, index)
    if struct.unpack_from("<Q", data, 0)[0] != probe.known["data"]:
        return False, "the data pointer is not the struct's first word"
    layouts = A.Layouts(max_dims=max_dims, tensor_info=True)
    dead = A._decode_tensor_info(type_name, data, probe.node.grid, layouts)
    wide = 8 if type_name.endswith(("unsigned long>", " long>")) else 4
    dims = struct.unpack_from("<i", data, 8 + 2 * wide * max_dims)[0]
    if dead is None or not 1 <= dims <= probe.known["dims_at_most"]:
        return False, "dims is not after sizes[] and strides[]"
    return True, ""


# ----------------------------------------------------------------------------- all of it
def solve(probes: list[Probe], torch_version: str = "", failed: dict | None = None) -> A.Layouts:
    """The Layouts the probes confirm; `failed` names families whose probe could not run."""
    why = dict(failed or {})
    by = {}
    for p in probes:
        by.setdefault(p.family, []).append(p)
    mtas, reasons = [], []
    for p in by.get("multi_tensor_apply", []):
        layout, reason = solve_mta(p)
        if layout is not None:
            mtas.append(layout)
        else:
            reasons.append(reason)
    mta, reason = merge_mta(mtas)
    if mta is None:
        why.setdefault("multi_tensor_apply", "; ".join(reasons) or reason)
    max_dims = None
    for p in by.get("closure", []):
        md, reason = solve_closure(p)
        if md is None:
            why.setdefault("closure", reason)
            max_dims = None
            break
        if max_dims not in (None, md):
            why.setdefault("closure", "two probes disagree on MAX_DIMS")
            max_dims = None
            break
        max_dims = md
    if "closure" not in by:
        why.setdefault("closure", "no TensorIterator closure was probed")
    closure = max_dims is not None and "closure" not in why

    def each(family: str, solver) -> bool:
        ps = by.get(family, [])
        if not ps:
            why.setdefault(family, f"no {family} launch was probed")
            return False
        for p in ps:
            ok, reason = solver(p)
            if not ok:
                why.setdefault(family, reason)
                return False
        return True

    reduce = tensor_info = False
    if max_dims is not None:
        reduce = each("reduce", lambda p: solve_reduce(p, max_dims))
        tensor_info = each("tensor_info", lambda p: solve_tensor_info(p, max_dims))
    else:
        for family in ("reduce", "tensor_info"):
            why.setdefault(family, "MAX_DIMS is not confirmed (no closure fit)")
    cat, reason = solve_cat(by.get("cat", []))
    if not cat:
        why.setdefault("cat", reason)
    pointer_list = each("pointer_list", solve_pointer_list)
    return A.Layouts(
        mta=mta,
        max_dims=max_dims,
        closure=closure,
        reduce=reduce,
        cat=cat,
        pointer_list=pointer_list,
        tensor_info=tensor_info,
        why=tuple(sorted((f, w) for f, w in why.items() if f in A.FAMILIES)),
        torch=torch_version,
    )

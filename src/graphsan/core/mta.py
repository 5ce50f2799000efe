"""multi_tensor_apply's metadata structs (`TensorListMetadata`, `TensorListScalarListMetadata`,
`FusedOptimizerTensorListMetadata`), read the way the kernel reads them: a launch's blocks
handle the tensors `block_to_tensor[0 .. grid.x-1]` names, so only those address slots are read
and the others hold whatever an earlier launch left there. The sizes inside the structs are not
one release's numbers: `MtaLayout` is what `graphsan.cuda.calibrate` confirmed on the running
torch, and each struct's tensor count is solved from its size (`mta_shape`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

from graphsan.core.kernel_names import template_args

Range = tuple[int, int]  # [start, end) bytes of a struct, or of a node's parameter buffer

MTA_KINDS = (
    "TensorListMetadata",
    "TensorListScalarListMetadata",
    "FusedOptimizerTensorListMetadata",
)
# a parameter type that is one of them
METADATA = re.compile(r"(?:^|::)(" + "|".join(MTA_KINDS) + r")<.*>$")
# the opmath types of scalar lists, and their sizes
SCALAR_BYTES = {
    "float": 4,
    "double": 8,
    "long": 8,
    "int": 4,
    "bool": 1,
    "c10::complex<float>": 8,
    "c10::complex<double>": 16,
}


@dataclass(frozen=True)
class MtaLayout:
    """multi_tensor_apply's metadata as the running torch builds it: the width of a
    `block_to_tensor` entry, the block count of the tables, the elements a block handles, and
    which struct kinds end with `start_tensor_this_launch`. The tensor count of a struct
    follows from its size (`mta_shape`)."""

    index_bytes: int
    max_blocks: int
    chunk: int
    start_field: tuple[tuple[str, bool], ...]  # (kind, has the field) of each confirmed kind

    def has_start(self, kind: str) -> bool | None:
        return dict(self.start_field).get(kind)


@dataclass(frozen=True)
class MtaShape:
    """Where the fields of one metadata struct sit (byte offsets inside the struct)."""

    kind: str
    depth: int
    tensors: int  # address slots per list
    extra: int  # where scalar_vals[] or state_steps_addresses[] start (0: none)
    block_to_tensor: int
    block_to_chunk: int
    index_bytes: int

    def address(self, d: int, t: int) -> int:
        return 8 * (d * self.tensors + t)

    @property
    def numel(self) -> int:
        return 8 * self.depth * self.tensors


def mta_kind(type_name: str) -> tuple[str, int, int] | None:
    """(kind, depth, scalar bytes) of a metadata struct type, None for one this module cannot
    size (a scalar type it does not know)."""
    m = METADATA.search(type_name)
    if m is None:
        return None
    kind = m.group(1)
    args = template_args(type_name[m.start(1) :])
    try:
        if kind == "TensorListScalarListMetadata":
            scalar = SCALAR_BYTES.get(args[0].replace("const ", "").strip())
            return (kind, int(args[1]), scalar) if scalar else None
        return kind, int(args[0]), 0
    except (IndexError, ValueError):
        return None


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


@functools.lru_cache(maxsize=1024)
def mta_shape(kind: str, depth: int, scalar_bytes: int, size: int, m: MtaLayout) -> MtaShape | None:
    """The field offsets of a struct of `size` bytes, its tensor count T solved from the size:
    addresses[depth][T], numel_for_tensor[T] (int64), then scalar_vals[T] (scalar lists) or
    state_steps_addresses[T] (fused optimizers), block_to_tensor[B], block_to_chunk[B] (int32)
    and, for some kinds, start_tensor_this_launch. None where no T gives exactly that size."""
    start = m.has_start(kind)
    if start is None or depth < 1:
        return None
    if kind == "TensorListScalarListMetadata":
        extra_bytes, extra_align = scalar_bytes, max(min(scalar_bytes, 16), 1)
    elif kind == "FusedOptimizerTensorListMetadata":
        extra_bytes, extra_align = 8, 8
    else:
        extra_bytes, extra_align = 0, 1
    align = max(8, extra_align)
    tail = m.index_bytes * m.max_blocks + 4 * m.max_blocks + (4 if start else 0)
    guess = (size - tail) // (8 * depth + 8 + extra_bytes)
    for tensors in range(max(guess - 2, 1), guess + 3):
        extra = _up(8 * (depth + 1) * tensors, extra_align) if extra_bytes else 0
        b2t = extra + extra_bytes * tensors if extra_bytes else 8 * (depth + 1) * tensors
        b2c = _up(b2t + m.index_bytes * m.max_blocks, 4)
        end = b2c + 4 * m.max_blocks + (4 if start else 0)
        if _up(end, align) == size:
            return MtaShape(kind, depth, tensors, extra, b2t, b2c, m.index_bytes)
    return None


def mta_unread(type_name: str, data: bytes, blocks: int, m: MtaLayout | None) -> list[Range] | None:
    """The byte ranges of one metadata struct that a launch of `blocks` blocks never reads;
    None where the struct cannot be sized or its block tables contradict the layout."""
    k = mta_kind(type_name)
    if m is None or k is None:
        return None
    shape = mta_shape(*k, len(data), m)
    if shape is None or not 1 <= blocks <= m.max_blocks:
        return None
    live = launch_tensors(data, shape, blocks, m.chunk)
    if live is None:
        return None
    keep = [
        (shape.address(d, t), shape.address(d, t) + 8) for d in range(shape.depth) for t in live
    ]
    if shape.kind == "FusedOptimizerTensorListMetadata":  # the step tensors' addresses
        keep += [(shape.extra + 8 * t, shape.extra + 8 * t + 8) for t in live]
    return complement(sorted(keep), len(data))


def launch_tensors(data: bytes, shape: MtaShape, blocks: int, chunk: int) -> list[int] | None:
    """The tensor slots the launch's blocks handle, or None where the block tables contradict
    the layout (the first block on slot 0, each next block on the same slot and the next chunk,
    or on the next slot and chunk 0; every slot's element count covers its chunks)."""
    dtype = {1: "<u1", 2: "<u2", 4: "<u4"}.get(shape.index_bytes)
    if dtype is None:
        return None
    b2t_end = shape.block_to_tensor + shape.index_bytes * blocks
    b2c_end = shape.block_to_chunk + 4 * blocks
    if b2t_end > len(data) or b2c_end > len(data):
        return None
    b2t = np.frombuffer(data, dtype, blocks, shape.block_to_tensor).astype(np.int64)
    b2c = np.frombuffer(data, "<i4", blocks, shape.block_to_chunk).astype(np.int64)
    if b2t[0] != 0 or b2t[-1] >= shape.tensors or (b2c < 0).any():
        return None
    step = np.diff(b2t)
    same = step == 0
    if not ((step == 0) | (step == 1)).all():
        return None
    if not (np.where(same, b2c[1:] == b2c[:-1] + 1, b2c[1:] == 0)).all():
        return None
    slots = np.unique(b2t)
    numel = np.frombuffer(data, "<i8", shape.tensors, shape.numel)[slots]
    last = np.zeros(len(slots), dtype=np.int64)
    np.maximum.at(last, np.searchsorted(slots, b2t), b2c)
    if (numel <= last * chunk).any():
        return None
    return slots.tolist()


def complement(keep: list[Range], size: int) -> list[Range]:
    """[0, size) minus the sorted, disjoint ranges in `keep`."""
    out, at = [], 0
    for a, b in keep:
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < size:
        out.append((at, size))
    return out

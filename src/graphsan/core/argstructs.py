"""PyTorch's by-value kernel argument structs, read the way the kernel reads them.

A kernel's argument struct is filled only as far as the launch needs; the rest is whatever the
host stack held, often device addresses from earlier launches, into memory that may be free
now. Such a word is no reference. This module says, for one kernel node, which byte ranges of
its arguments the kernel never reads (`decode`), from the parameter types in the demangled
kernel name and the node's grid:

- multi_tensor_apply's metadata (`TensorListMetadata`, `TensorListScalarListMetadata`,
  `FusedOptimizerTensorListMetadata`): only the address slots of the tensors that this launch's
  blocks handle (`block_to_tensor[0 .. grid.x-1]`) are read;
- TensorIterator closures (`elementwise_kernel` of `gpu_kernel_impl*`): the `OffsetCalculator`
  first, its first `dims` dividers and stride rows used, then the data-pointer array;
- `ReduceOp` (`reduce_kernel`): both calculators as far as their `dims`, and `dst[1]` only with
  two outputs;
- `CatArrInputTensorMetadata` (batched `torch.cat`): `input[0 .. grid.y-1]`;
- `TensorListAddresses` (`_foreach_norm`'s cleanup): `addresses[0 .. grid.x-1]`;
- `TensorInfo` (indexing, dropout): `sizes` and `strides` as far as `dims`.

The sizes inside these structs change between PyTorch releases and builds (4 KB or 32 KB
kernel-argument tables, one- or two-byte block indices), so nothing here is one release's
numbers: each family's parameters come from a `Layouts` record that `graphsan.cuda.calibrate`
confirms on the running torch, against launches whose contents it knows. A family the record
does not confirm is scanned as before, word by word, and its references carry the caveat
"unconfirmed layout". A launch whose bytes contradict its confirmed layout is treated the same.

multi_tensor_apply's metadata, the largest family, is read in `core.mta`; the demangled names
are cut into parameter types in `core.kernel_names`.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, field

from graphsan.core.kernel_names import parameter_tuple, template_args
from graphsan.core.mta import METADATA, MtaLayout, Range, mta_unread

FAMILIES = ("multi_tensor_apply", "closure", "reduce", "cat", "pointer_list", "tensor_info")
UNCONFIRMED = "unconfirmed layout"


# ----------------------------------------------------------------------------- confirmed layouts
@dataclass(frozen=True)
class Layouts:
    """What `graphsan.cuda.calibrate` confirmed on this torch (None or False: unconfirmed, with
    the reason in `why`)."""

    mta: MtaLayout | None = None
    max_dims: int | None = None  # OffsetCalculator and TensorInfo: MAX_DIMS entries
    closure: bool = False  # TensorIterator closures start with their OffsetCalculator
    reduce: bool = False  # ReduceOp ends with src, dst[2], buffers, base_idx, noutputs
    cat: bool = False
    pointer_list: bool = False
    tensor_info: bool = False
    why: tuple[tuple[str, str], ...] = ()  # (family, why it is unconfirmed)
    torch: str = ""

    def confirmed(self, family: str) -> bool:
        if family == "multi_tensor_apply":
            return self.mta is not None
        ok = bool(getattr(self, family))
        return ok and (self.max_dims is not None or family in ("cat", "pointer_list"))

    def reason(self, family: str) -> str:
        return dict(self.why).get(family, "not calibrated")

    def summary(self) -> dict:
        return {f: ("confirmed" if self.confirmed(f) else self.reason(f)) for f in FAMILIES}


NOT_CALIBRATED = Layouts(why=tuple((f, "not calibrated yet") for f in FAMILIES))


# ----------------------------------------------------------------------------- what a node holds
@dataclass
class Decoded:
    """Byte ranges of one node's parameter buffer: `dead` holds no reference (never read by
    the kernel), `unsure` is a struct of a known family whose layout is not confirmed (its words
    are scanned, and their references carry `caveat`)."""

    dead: list[Range] = field(default_factory=list)
    unsure: list[Range] = field(default_factory=list)
    caveat: str | None = None


_CAT = re.compile(r"(?:^|::)CatArrInputTensorMetadata<.*>$")
_POINTER_LIST = re.compile(r"(?:^|::)TensorListAddresses$")
_TENSOR_INFO = re.compile(
    r"^at::cuda::detail::TensorInfo<(.*), (unsigned int|unsigned long|int|long)>$"
)
_REDUCE = re.compile(r"^at::native::ReduceOp<.*>$")
# the closures TensorIterator's loops launch: their first capture is the OffsetCalculator
_CLOSURE = re.compile(
    r"at::native::gpu_kernel_impl(?:_nocast)?<.*\)::\{lambda\(int(?:, bool)?\)#\d+\}$"
)
_CLOSURE_KERNELS = (
    "at::native::elementwise_kernel<",
    "at::native::elementwise_kernel_manual_unroll<",
)


def family_of(type_name: str, kernel: str) -> str | None:
    """The family of one parameter type of `kernel`, or None."""
    if METADATA.search(type_name):
        return "multi_tensor_apply"
    if _CAT.search(type_name):
        return "cat"
    if _POINTER_LIST.search(type_name):
        return "pointer_list"
    if _TENSOR_INFO.match(type_name):
        return "tensor_info"
    if _REDUCE.match(type_name):
        return "reduce"
    if _CLOSURE.search(type_name) and any(k in kernel for k in _CLOSURE_KERNELS):
        return "closure"
    return None


@functools.lru_cache(maxsize=8192)
def plan(name: str) -> tuple[tuple[int, str, str], ...]:
    """(parameter index, family, type) of every parameter of the kernel `name` that is a known
    struct; cached per name (a graph launches the same kernels many times)."""
    out = []
    for i, t in enumerate(parameter_tuple(name)):
        fam = family_of(t, name)
        if fam is not None:
            out.append((i, fam, t))
    return tuple(out)


def decode(
    name: str, buffer: bytes, offsets: list[int], grid: tuple[int, int, int], layouts: Layouts
) -> Decoded | None:
    """What one kernel node's known structs hold (None: the kernel has none)."""
    structs = plan(name)
    if not structs or not offsets:
        return None
    out = Decoded()
    ends = [*offsets[1:], len(buffer)]
    for index, fam, type_name in structs:
        if index >= len(offsets):
            continue
        start, end = offsets[index], min(ends[index], len(buffer))
        if end <= start:
            continue
        data = buffer[start:end]
        dead = None
        if layouts.confirmed(fam):
            dead = _DECODERS[fam](type_name, data, grid, layouts)
        if dead is None:  # unconfirmed, or this launch's bytes do not fit the layout
            out.unsure.append((start, end))
            why = layouts.reason(fam) if not layouts.confirmed(fam) else "bytes do not fit it"
            out.caveat = out.caveat or f"{UNCONFIRMED} ({_short(type_name)}: {why})"
            continue
        out.dead += [(start + a, start + b) for a, b in dead if b > a]
    return out


def _short(type_name: str) -> str:
    base = type_name.split("<", 1)[0].rsplit("::", 1)[-1]
    args = template_args(type_name)
    return f"{base}<{', '.join(a.rsplit('::', 1)[-1] for a in args)}>" if args else base


# ----------------------------------------------------------------------------- multi_tensor_apply
def _decode_mta(type_name: str, data: bytes, grid, layouts: Layouts) -> list[Range] | None:
    return mta_unread(type_name, data, grid[0], layouts.mta)


# ----------------------------------------------------------------------------- OffsetCalculator
DIVIDER_BYTES = 12  # IntDivider<uint32_t>: divisor, magic number, shift


def calculator_bytes(nargs: int, max_dims: int) -> int:
    """An OffsetCalculator<nargs>'s bytes: dims, max_dims dividers, max_dims x nargs strides."""
    return 4 + DIVIDER_BYTES * max_dims + 4 * max_dims * nargs


def calculator_dims(data: bytes, at: int, max_dims: int, minimum: int = 1) -> int | None:
    """The `dims` of an OffsetCalculator at byte `at`, when its used dividers are exactly what
    the constructor computes; else None. (A full reduction's output calculator has 0 dims.)"""
    if at < 0 or at + 4 + DIVIDER_BYTES * max_dims > len(data):
        return None
    (dims,) = struct.unpack_from("<I", data, at)
    if not minimum <= dims <= max_dims:
        return None
    words = struct.unpack_from(f"<{3 * dims}I", data, at + 4)
    for i in range(0, 3 * dims, 3):
        if not _divider_ok(*words[i : i + 3]):
            return None
    return dims


def _divider_ok(divisor: int, m1: int, shift: int) -> bool:
    """Whether (divisor, m1, shift) is what `IntDivider<uint32_t>(divisor)` holds (the smallest
    shift with 2**shift >= divisor, m1 = 2**32 * (2**shift - divisor) // divisor + 1); plain
    integers: a calculator has a few dividers, too few for numpy to pay."""
    if not 1 <= divisor <= 0x7FFFFFFF or shift > 31:
        return False
    if (1 << shift) < divisor or (shift > 0 and (1 << (shift - 1)) >= divisor):
        return False
    return m1 == ((1 << 32) * ((1 << shift) - divisor)) // divisor + 1


def calculator_dead(at: int, dims: int, nargs: int, max_dims: int) -> list[Range]:
    """The unused dividers and stride rows of a calculator at `at` (strides are
    [max_dims][nargs], so rows dims.. are unused)."""
    strides = at + 4 + DIVIDER_BYTES * max_dims
    return [
        (at + 4 + DIVIDER_BYTES * dims, strides),
        (strides + 4 * nargs * dims, strides + 4 * nargs * max_dims),
    ]


def closure_nargs(size: int, max_dims: int) -> int:
    """The operand count of a TensorIterator closure of `size` bytes: the calculator, then the
    8-aligned data-pointer array, fit; each more operand adds 4 x max_dims + 8 bytes, more than
    the functor and dtypes that follow take."""
    n = 0
    while -(-calculator_bytes(n + 1, max_dims) // 8) * 8 + 8 * (n + 1) <= size:
        n += 1
    return n


def _decode_closure(type_name: str, data: bytes, grid, layouts: Layouts) -> list[Range] | None:
    md = layouts.max_dims
    dims = calculator_dims(data, 0, md)
    nargs = closure_nargs(len(data), md)
    if dims is None or nargs < 1:
        return None
    at = -(-calculator_bytes(nargs, md) // 8) * 8
    if 0 in struct.unpack_from(f"<{nargs}Q", data, at):
        return None  # every operand of a launch has data
    return calculator_dead(0, dims, nargs, md)


# ----------------------------------------------------------------------------- ReduceOp
REDUCE_TAIL = 64  # src, dst[2], acc_buf, cta_buf, semaphores, base_idx, flags and noutputs


def _decode_reduce(type_name: str, data: bytes, grid, layouts: Layouts) -> list[Range] | None:
    md, size = layouts.max_dims, len(data)
    tail = size - REDUCE_TAIL
    out_bytes, in_bytes = calculator_bytes(2, md), calculator_bytes(1, md)
    (noutputs,) = struct.unpack_from("<i", data, size - 4)
    if tail < out_bytes + in_bytes or noutputs not in (1, 2):
        return None
    for pad in (0, 4):  # the output calculator ends at src, or 4 bytes before it
        out_at = tail - pad - out_bytes
        in_at = out_at - in_bytes
        dims_out = calculator_dims(data, out_at, md, minimum=0)
        dims_in = calculator_dims(data, in_at, md)
        if dims_out is not None and dims_in is not None:
            dead = calculator_dead(in_at, dims_in, 1, md) + calculator_dead(out_at, dims_out, 2, md)
            if noutputs == 1:
                dead.append((tail + 16, tail + 24))  # dst[1]
            return dead
    return None


# ----------------------------------------------------------------------------- pointer arrays
def _decode_cat(type_name: str, data: bytes, grid, layouts: Layouts) -> list[Range] | None:
    args = template_args(type_name[type_name.find("CatArrInputTensorMetadata") :])
    try:
        batch = int(args[2])
    except (IndexError, ValueError):
        return None
    count = grid[1]
    if not 1 <= count <= batch or 8 * batch > len(data):
        return None
    return [(8 * count, 8 * batch)]


def _decode_pointer_list(type_name: str, data: bytes, grid, layouts: Layouts) -> list[Range] | None:
    count = grid[0]
    if not 1 <= count <= len(data) // 8:
        return None
    return [(8 * count, len(data) // 8 * 8)]


def _decode_tensor_info(type_name: str, data: bytes, grid, layouts: Layouts) -> list[Range] | None:
    md = layouts.max_dims
    index = 4 if _TENSOR_INFO.match(type_name).group(2) in ("unsigned int", "int") else 8
    sizes, strides, dims_at = 8, 8 + index * md, 8 + 2 * index * md
    if dims_at + 4 > len(data):
        return None
    (dims,) = struct.unpack_from("<i", data, dims_at)
    if not 0 <= dims <= md:
        return None
    return [(sizes + index * dims, strides), (strides + index * dims, dims_at)]


_DECODERS = {
    "multi_tensor_apply": _decode_mta,
    "closure": _decode_closure,
    "reduce": _decode_reduce,
    "cat": _decode_cat,
    "pointer_list": _decode_pointer_list,
    "tensor_info": _decode_tensor_info,
}

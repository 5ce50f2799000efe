"""The launchers of the quantize kernels: outputs, tiles, and which kernel runs for which input.

Same arguments and bytes as `mxfp8.quantize_reference` and `nvfp4.quantize_reference`, which
check the arguments; these launchers trust them (`mxfp8.quantize` and `nvfp4.quantize` check
once and call here). The bf16-word kernels run where `words_fit(x)`, the strided kernels
elsewhere; `_strided=True` runs the strided kernels everywhere, for the benchmarks and tests that
compare the two.

NVFP4: the global amax is accumulated into a device buffer (atomic max, no host sync) and the
quantize kernel reads it there. SR bits are Philox bytes per 16-element block from one seed
drawn on the caller's generator, as the reference draws them (`elements.sr_bits`): the words
kernels and the fused column kernel make them in registers, the strided kernels read them from
a tensor (`elements.block_random_bits`). Columnwise copies with RHT or SR (1D blocks) run the
fused column kernel (`nvfp4_col.py`: the transform in registers too); with the strided kernels
forced, the RHT is the torch one. Either way SR is reproducible and graph-capturable.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..elements import block_random_bits, random_seed
from ..formats import (
    FP8_BITS,
    FP8_MAX,
    INV_6,
    MXFP8_BLOCK,
    NVFP4_ALPHA_DIVISOR,
    NVFP4_BLOCK,
    fp32_reciprocal,
)
from ..options import DEFAULT, NVFP4Options
from ..rht import rht as apply_rht
from ..tensors import MXFP8Tensor, NVFP4Tensor
from .fastlaunch import fast
from .gemm import (
    dequant_kernel,
    dequant_mxfp8_cols_kernel,
    dequant_mxfp8_rows_kernel,
    dequant_nvfp4_kernel,
    gemm_epilogue_kernel,
    qgemm_kernel,
)
from .mxfp8 import mxfp8_strided_kernel, mxfp8_words_kernel
from .nvfp4 import (
    amax_kernel,
    group_amax_kernel,
    nvfp4_col_strided_kernel,
    nvfp4_col_words_kernel,
    nvfp4_row_strided_kernel,
    nvfp4_row_words_kernel,
)
from .nvfp4_col import nvfp4_col_amax_kernel, nvfp4_col_fused_kernel

# Every kernel this module launches goes through `fastlaunch` (compiled kernels only): the same
# kernels and arguments, without Triton's per-call binding once a specialization has been seen.
for _name in (
    "dequant_kernel",
    "dequant_mxfp8_cols_kernel",
    "dequant_mxfp8_rows_kernel",
    "dequant_nvfp4_kernel",
    "gemm_epilogue_kernel",
    "qgemm_kernel",
    "mxfp8_strided_kernel",
    "mxfp8_words_kernel",
    "amax_kernel",
    "group_amax_kernel",
    "nvfp4_col_strided_kernel",
    "nvfp4_col_words_kernel",
    "nvfp4_row_strided_kernel",
    "nvfp4_row_words_kernel",
    "nvfp4_col_amax_kernel",
    "nvfp4_col_fused_kernel",
):
    globals()[_name] = fast(globals()[_name])

# Launch parameters, fixed: the fastest tiles of bench/tile_sweep.py (docs/PERF.md).
MXFP8_STRIDED_TILE = {"BM": 32, "BN": 128, "SPLIT": 2, "num_warps": 2}
MXFP8_WORDS_COL_TILE = {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2}  # columnwise alone
MXFP8_WORDS_BOTH_TILE = {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2}  # row+col in one pass
NVFP4_ROW_STRIDED_TILE = {"BR": 32, "BC": 128, "num_warps": 4}
NVFP4_COL_STRIDED_TILE = {"BM": 256, "BK": 64, "num_warps": 4}
NVFP4_ROW_WORDS_TILE = {"BR": 16, "CW": 64, "num_warps": 2}
NVFP4_COL_WORDS_TILE = {"NB": 8, "CW": 16, "num_warps": 2}
# The fused column kernel's quantize pass: 64 values a thread (about 128 registers, so twice
# the warps per SM of 128 a thread), the fastest of bench/tile_sweep.py's tiles on the H200 for
# RHT+SR, RHT and SR alike; its RHT amax pass (`nvfp4_col_amax_kernel`: loads and the transform,
# no encoder) 64 a thread and 4 tiles a program, the fastest taking both amaxes (docs/PERF.md).
NVFP4_COL_FUSED_TILE = {"NB": 8, "BK": 64, "num_warps": 4}
NVFP4_COL_AMAX_TILE = {"NB": 8, "BK": 64, "ITERS": 4, "num_warps": 4}
GROUP_AMAX_TILE = {"BR": 16, "BC": 256, "ITERS": 8, "num_warps": 4}
# gemm_operand's kernels (contiguous operands; DEQUANT_TILE: any strides), the fastest or level
# with the fastest of bench/tile_sweep.py's tiles on the H200 (docs/PERF.md). BLOCK: bytes
# (NVFP4) or elements (MXFP8 rowwise) a program; columnwise MXFP8: R rows a program (R divides
# 32), 256 x num_warps columns.
DEQUANT_NVFP4_TILE = {"BLOCK": 2048, "num_warps": 4}
DEQUANT_MXFP8_ROW_TILE = {"BLOCK": 4096, "num_warps": 4}
DEQUANT_MXFP8_COL_TILE = {"R": 8, "num_warps": 4}
DEQUANT_TILE = {"BP": 32, "BQ": 128, "num_warps": 4}
GEMM_TILE = {"BI": 128, "BJ": 128, "BR": 64, "GROUP": 8, "num_warps": 8, "num_stages": 3}
AMAX_TILE = (4096, 16)  # (elements per load round, rounds per program)
# Compiled without fp contraction: no rounding step of the reference may be fused away.
_COMPILE_OPTIONS = {"enable_fp_fusion": False}


@functools.cache
def hw_fp8(device_index: int) -> bool:
    """Whether the kernels convert to FP8 with the hardware instruction on this GPU (sm_90+;
    the tests run both paths against the reference)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _hw_fp8_for(x: torch.Tensor) -> bool:
    if not x.is_cuda:  # CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1, tests)
        return False
    return hw_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())


def words_fit(x: torch.Tensor) -> bool:
    """Whether a words kernel can read x as 64-bit words of 4 bf16."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and x.shape[1] % 4 == 0
        and x.stride(0) % 4 == 0
        and x.data_ptr() % 8 == 0
    )


# --- MXFP8 -------------------------------------------------------------------------------------


def mxfp8_quantize(
    x: torch.Tensor, axis: int = -1, fmt: str = "e4m3", *, _strided: bool = False
) -> MXFP8Tensor:
    """One direction of MXFP8 (TE's round-up scale rule)."""
    row, col = _mxfp8(x, fmt, axis != 0, axis == 0, _strided)
    return col if axis == 0 else row


def mxfp8_quantize_both(
    x: torch.Tensor, fmt: str = "e4m3", *, _strided: bool = False
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Rowwise and columnwise MXFP8 from one read of x."""
    return _mxfp8(x, fmt, True, True, _strided)


def _mxfp8(x, fmt, do_row, do_col, strided):
    m, k = x.shape
    dev = x.device
    row = col = None
    if do_row:
        row = MXFP8Tensor(
            torch.empty(m, k, dtype=torch.uint8, device=dev),
            torch.empty(m, k // MXFP8_BLOCK, dtype=torch.uint8, device=dev),
            -1,
            fmt,
        )
    if do_col:
        col = MXFP8Tensor(
            torch.empty(m, k, dtype=torch.uint8, device=dev),
            torch.empty(m // MXFP8_BLOCK, k, dtype=torch.uint8, device=dev),
            0,
            fmt,
        )
    if do_col and not strided and words_fit(x):  # the words kernel always writes columnwise
        _mxfp8_words(x, fmt, row, col)
    else:
        _mxfp8_strided(x, fmt, row, col)
    return row, col


def _fp8_constants(fmt: str) -> dict:
    """The MXFP8 kernels' element-format arguments."""
    mbits, emin, sub = FP8_BITS[fmt]
    max_ = FP8_MAX[fmt]
    return {"INV_MAX": fp32_reciprocal(max_), "MAX": max_, "MBITS": mbits, "EMIN": emin, "SUB": sub}


def _mxfp8_strided(x, fmt, row, col):
    m, k = x.shape
    dummy = torch.empty(1, dtype=torch.uint8, device=x.device)
    tile = MXFP8_STRIDED_TILE
    grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(k, tile["BN"]))
    mxfp8_strided_kernel[grid](
        x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        row.data if row else dummy,
        row.scale if row else dummy,
        col.data if col else dummy,
        col.scale if col else dummy,
        **_fp8_constants(fmt),
        HW_FP8=_hw_fp8_for(x),
        DO_ROW=row is not None,
        DO_COL=col is not None,
        **tile,
        **_COMPILE_OPTIONS,
    )


def _mxfp8_words(x, fmt, row, col):
    """x as int64 words [M, K/4]; data and columnwise scales written as int32 words."""
    m, k = x.shape
    xw = x.view(torch.int64)
    tile = MXFP8_WORDS_BOTH_TILE if row is not None else MXFP8_WORDS_COL_TILE
    grid = (triton.cdiv(m, MXFP8_BLOCK), triton.cdiv(k // 4, tile["G"] * tile["CW"]))
    dummy = col.scale.new_empty(1)
    mxfp8_words_kernel[grid](
        xw,
        m,
        k // 4,
        x.stride(0) // 4,
        row.data.view(torch.int32) if row else dummy,
        row.scale if row else dummy,
        col.data.view(torch.int32),
        col.scale.view(torch.int32),
        **_fp8_constants(fmt),
        HW_FP8=_hw_fp8_for(x),
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        DO_ROW=row is not None,
        **tile,
        **_COMPILE_OPTIONS,
    )


# --- NVFP4 -------------------------------------------------------------------------------------


def global_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| ignoring NaN into a fresh float32 0-dim device buffer (no host sync)."""
    flat = x.contiguous().view(-1)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    n = flat.numel()
    block, iters = AMAX_TILE
    iters = iters if n >= block * iters * 64 else 1  # small tensors: more programs
    grid = (triton.cdiv(n, block * iters),)
    amax_kernel[grid](flat, n, amax, BLOCK=block, ITERS=iters, num_warps=8)
    return amax


def nvfp4_quantize(
    x: torch.Tensor,
    axis: int = -1,
    options: NVFP4Options = DEFAULT,
    amax: torch.Tensor | None = None,
    *,
    _strided: bool = False,
) -> NVFP4Tensor:
    """NVFP4; `amax` may pass a precomputed global amax buffer (with RHT: the post-RHT one)."""
    rht, sr = options.rht, options.sr
    if axis == 0 and (rht or sr) and not options.block_2d and not _strided:
        return _nvfp4_col_fused(x, options, amax)
    src = x.t() if axis == 0 else x
    if rht:
        src = apply_rht(src).contiguous()
        amax = global_amax(src) if amax is None else amax
    elif amax is None:
        amax = global_amax(x)
    data, scale, seed = _nvfp4_outputs(src.shape, options, x.device)
    if not _strided and (axis != 0 or rht) and words_fit(src):
        _nvfp4_row_words(x, src, amax, seed, data, scale, options)
    elif not _strided and axis == 0 and not sr and words_fit(x):
        _nvfp4_col_words(x, amax, data, scale, options)
    else:
        rbits = block_random_bits(seed, *src.shape) if sr else seed
        _nvfp4_strided(x, src, axis, options, amax, rbits, data, scale)
    return NVFP4Tensor(data, scale, amax, 0 if axis == 0 else -1, options.block_2d, rht)


def _nvfp4_outputs(shape, options: NVFP4Options, dev):
    """The data and scale buffers of a copy with `shape` (rows, cols: the blocks along cols) and
    the SR seed drawn on the options' generator (a placeholder buffer without SR)."""
    r, c = shape
    data = torch.empty(r, c // 2, dtype=torch.uint8, device=dev)
    scale = torch.empty(r, c // NVFP4_BLOCK, dtype=torch.uint8, device=dev)
    sr = options.generator is not None
    return data, scale, random_seed(options.generator, dev) if sr else scale.new_empty(1)


def nvfp4_quantize_grouped(
    x: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    axis: int = -1,
    options: NVFP4Options = DEFAULT,
    _amax: torch.Tensor | None = None,
) -> NVFP4Tensor | None:
    """`nvfp4.quantize_grouped` (one global amax per row group) in kernels, no host sync: the
    per-group amax (`group_amax_kernel`, or after the RHT `nvfp4_col_amax_kernel`)
    into a device buffer, gathered per row, which the quantize kernels read as their global
    amax. bf16 with unit column stride (the words kernels; columnwise without SR), or any
    columnwise input with RHT or SR and 1D blocks (the fused kernel); None elsewhere (the caller
    runs the reference). `_amax`: the per-group amaxes already taken ([num_groups + 1], post-RHT
    with RHT: `nvfp4_quantize_grouped_both`)."""
    rht = options.rht
    fused = axis == 0 and (rht or options.sr) and not options.block_2d
    if not fused and (not words_fit(x) or (axis == 0 and options.sr)):
        return None  # the column words kernel has no SR
    amax = _amax
    if amax is None:  # the last: no group
        amax = torch.zeros(num_groups + 1, dtype=torch.float32, device=x.device)
        if not rht:
            _group_amax(x, groups, num_groups, amax)
    if fused:
        fill = rht and _amax is None
        q = _nvfp4_col_fused(x, options, amax, (groups, num_groups), fill)
    else:
        row_amax = amax[groups]  # each row's group's amax
        src = x.t() if axis == 0 else x
        data, scale, seed = _nvfp4_outputs(src.shape, options, x.device)
        if axis == 0:
            _nvfp4_col_words(x, row_amax, data, scale, options, per_row=True)
        else:
            _nvfp4_row_words(x, src, row_amax, seed, data, scale, options, per_row=True)
        q = NVFP4Tensor(data, scale, amax, 0 if axis == 0 else -1, options.block_2d, rht)
    q.amax = q.amax[:num_groups]
    return q


def nvfp4_quantize_grouped_both(
    x: torch.Tensor, groups: torch.Tensor, num_groups: int, options: NVFP4Options = DEFAULT
) -> tuple[NVFP4Tensor, NVFP4Tensor] | None:
    """(rowwise, columnwise) grouped copies, byte for byte the two `nvfp4_quantize_grouped`
    calls (rowwise first), with one read of x for both per-group amaxes (`nvfp4_quantize_both`'s
    rule); None where the kernels do not take both copies (the caller quantizes each alone)."""
    if not words_fit(x) or (options.sr and options.block_2d):
        return None  # the row words kernel takes bf16 with unit column stride only
    amax = torch.zeros(2, num_groups + 1, dtype=torch.float32, device=x.device)
    if options.rht:
        _col_amax_pass(x, amax[0], amax[1], (groups, num_groups))
        col_amax = amax[0]
    else:
        _group_amax(x, groups, num_groups, amax[1])
        col_amax = amax[1]
    common = (groups, num_groups)
    row = nvfp4_quantize_grouped(x, *common, -1, options.for_rowwise(), amax[1])
    col = nvfp4_quantize_grouped(x, *common, 0, options, col_amax)
    return row, col


def _group_amax(x, groups, num_groups, amax):
    """Each group's max |x| (NaN ignored) into amax[group] (zeroed, [num_groups + 1])."""
    m, k = x.shape
    bits = x.dtype == torch.bfloat16
    tile = GROUP_AMAX_TILE
    iters = max(1, min(tile["ITERS"], triton.cdiv(k, tile["BC"])))
    grid = (triton.cdiv(m, tile["BR"]), triton.cdiv(k, tile["BC"] * iters))
    group_amax_kernel[grid](
        x.view(torch.int16) if bits else x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        groups,
        amax,
        num_groups,
        BF16_BITS=bits,
        BR=tile["BR"],
        BC=tile["BC"],
        ITERS=iters,
        num_warps=tile["num_warps"],
    )


def _nvfp4_col_fused(x, options: NVFP4Options, amax, grouped=None, fill=None):
    """Columnwise with RHT and/or SR in one kernel (`nvfp4_col.py`): where `fill` (by default:
    RHT and no `amax` given), the RHT amax pass runs first and takes the post-RHT global amax
    (`_col_amax_pass`; per group with `grouped` = (groups, num_groups), into the zeroed buffer
    `amax`); SR bits come from a seed drawn on the generator, as the reference draws them. A
    given `amax` is the post-RHT one with RHT (`nvfp4_quantize_both` takes it with the plain
    one, in one pass)."""
    m, k = x.shape
    data, scale, seed = _nvfp4_outputs((k, m), options, x.device)
    if fill is None:
        fill = options.rht and amax is None
    if fill:
        if amax is None:
            amax = torch.zeros((), dtype=torch.float32, device=x.device)
        _col_amax_pass(x, amax, None, grouped)
    elif amax is None:
        amax = global_amax(x)
    row_amax = amax[grouped[0]] if grouped is not None else amax  # grouped: each row's own
    _col_fused_launch(x, options, row_amax, seed, data, scale, grouped)
    return NVFP4Tensor(data, scale, amax, 0, False, options.rht)


def _col_amax_pass(x, amax, pre_amax, grouped=None):
    """`nvfp4_col_amax_kernel`: the post-RHT amax into `amax` and, where `pre_amax` is given,
    the plain max |x| into it, both from one read (zeroed buffers, per group with `grouped`)."""
    m, k = x.shape
    bits = x.dtype == torch.bfloat16
    groups, count = grouped if grouped is not None else (amax, 0)
    tile = dict(NVFP4_COL_AMAX_TILE)
    rows = m // NVFP4_BLOCK  # block rows
    tile["ITERS"] = max(1, min(tile.get("ITERS", 1), rows // tile["NB"]))
    grid = (triton.cdiv(rows, tile["NB"] * tile["ITERS"]), triton.cdiv(k, tile["BK"]))
    nvfp4_col_amax_kernel[grid](
        x.view(torch.int16) if bits else x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        amax,
        pre_amax if pre_amax is not None else amax,
        groups,
        count,
        BF16_BITS=bits,
        GROUPED=grouped is not None,
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        PTX=x.is_cuda,  # nor inline PTX
        EVEN=rows % (tile["NB"] * tile["ITERS"]) == 0 and k % tile["BK"] == 0,
        PRE_AMAX=pre_amax is not None,
        **tile,
        **_COMPILE_OPTIONS,
    )


def _nvfp4_flags(x, options: NVFP4Options) -> dict:
    """The constexprs every NVFP4 quantize kernel takes: the op order and the FP8 conversion."""
    return {"INV_6": INV_6, "LEGACY": options.legacy, "HW_FP8": _hw_fp8_for(x)}


def _col_fused_launch(x, options: NVFP4Options, amax, seed, data, scale, grouped):
    """One launch of the quantize pass, `nvfp4_col_fused_kernel` (amax: the global amax buffer,
    or with `grouped` each row's; seed: the SR seed buffer)."""
    m, k = x.shape
    bits = x.dtype == torch.bfloat16
    tile = NVFP4_COL_FUSED_TILE
    grid = (triton.cdiv(m // NVFP4_BLOCK, tile["NB"]), triton.cdiv(k, tile["BK"]))
    nvfp4_col_fused_kernel[grid](
        x.view(torch.int16) if bits else x,
        m,
        k,
        x.stride(0),
        x.stride(1),
        amax,
        seed,
        data.view(torch.int64),
        scale,
        **_nvfp4_flags(x, options),
        RHT=options.rht,
        SR=options.sr,
        BF16_BITS=bits,
        GROUPED=grouped is not None,
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        PTX=x.is_cuda,  # nor inline PTX or rounding modes
        EVEN=(m // NVFP4_BLOCK) % tile["NB"] == 0 and k % tile["BK"] == 0,
        **tile,
        **_COMPILE_OPTIONS,
    )


def nvfp4_quantize_both(
    x: torch.Tensor, options: NVFP4Options = DEFAULT
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """(rowwise, columnwise) copies of x, byte for byte `nvfp4_quantize(x, -1,
    options.for_rowwise())` then `nvfp4_quantize(x, 0, options)` (the generator drawn in that
    order), with one read of x for both global amaxes: with RHT the fused column kernel's amax
    pass takes the post-RHT amax and the plain one together (as TE's `hadamard_transform_amax`
    does), without RHT one global amax serves both copies."""
    row_options = options.for_rowwise()
    if options.rht:
        amax = torch.zeros(2, dtype=torch.float32, device=x.device)  # post-RHT, plain
        _col_amax_pass(x, amax[0], amax[1])
        row = nvfp4_quantize(x, -1, row_options, amax[1])
        return row, _nvfp4_col_fused(x, options, amax[0])
    amax = global_amax(x)
    row = nvfp4_quantize(x, -1, row_options, amax)
    return row, nvfp4_quantize(x, 0, options, amax)


def _nvfp4_strided(x, src, axis, options: NVFP4Options, amax, rbits, data, scale):
    """The row kernel for rowwise and for the contiguous RHT copy; otherwise the column kernel
    reads x in its own order (blocks down its columns) and writes the transposed layout."""
    common = {
        **_nvfp4_flags(x, options),
        "BLOCK_2D": options.block_2d,
        "SR": options.sr,
        **_COMPILE_OPTIONS,
    }
    if axis == 0 and not options.rht:
        m, k = x.shape
        tile = NVFP4_COL_STRIDED_TILE
        grid = (triton.cdiv(m, tile["BM"]), triton.cdiv(k, tile["BK"]))
        nvfp4_col_strided_kernel[grid](
            x, m, k, x.stride(0), x.stride(1), amax, rbits, data, scale, **common, **tile
        )
        return
    r, c = src.shape
    tile = NVFP4_ROW_STRIDED_TILE
    grid = (triton.cdiv(r, tile["BR"]), triton.cdiv(c, tile["BC"]))
    nvfp4_row_strided_kernel[grid](
        src, r, c, src.stride(0), src.stride(1), amax, rbits, data, scale, **common, **tile
    )


def _nvfp4_row_words(x, src, amax, seed, data, scale, options: NVFP4Options, per_row=False):
    """src as int64 words [R, C/4], data written as int16 words (4 nibbles); SR bits from the
    int64 `seed` (Philox per block, in the kernel)."""
    r, c = src.shape
    tile = NVFP4_ROW_WORDS_TILE
    grid = (triton.cdiv(r, tile["BR"]), triton.cdiv(c // 4, tile["CW"]))
    nvfp4_row_words_kernel[grid](
        src.view(torch.int64),
        r,
        c // 4,
        src.stride(0) // 4,
        amax,
        seed,
        data.view(torch.int16),
        scale,
        **_nvfp4_flags(x, options),
        BLOCK_2D=options.block_2d,
        SR=options.sr,
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        PER_ROW=per_row,
        **tile,
        **_COMPILE_OPTIONS,
    )


def _nvfp4_col_words(x, amax, data, scale, options: NVFP4Options, per_row=False):
    """Columnwise, no RHT, no SR: x as int64 words [M, K/4], the transposed data written as
    int64 words [K, M/16] (one per column and 16-row block)."""
    m, k = x.shape
    tile = NVFP4_COL_WORDS_TILE
    grid = (triton.cdiv(m // NVFP4_BLOCK, tile["NB"]), triton.cdiv(k // 4, tile["CW"]))
    nvfp4_col_words_kernel[grid](
        x.view(torch.int64),
        m,
        k // 4,
        x.stride(0) // 4,
        amax,
        data.view(torch.int64),
        scale,
        **_nvfp4_flags(x, options),
        BLOCK_2D=options.block_2d,
        MAXNUM=x.is_cuda,  # Triton's interpreter has no NaN-ignoring maximum
        PER_ROW=per_row,
        **tile,
        **_COMPILE_OPTIONS,
    )


# --- the emulated GEMM -------------------------------------------------------------------------

# Whether QuantLinear's GEMMs run the fused packed-operand GEMM (`quantized_mm`) instead of
# one-pass operand preparation (`gemm_operand`) and cuBLAS. Off: the fused kernel decodes every
# operand tile once per output tile, about 15 integer operations per element against 0.5 tensor
# core multiply-adds at 128x128 tiles on Hopper, so it is expected to be ALU-bound; the benchmark
# (bench/bench_quant_linear.py) times both.
FUSED_GEMM = False


@functools.cache
def _nan16(device_type: str) -> int:
    """The bf16 bits (int16) that torch's float32 -> bf16 cast gives NaN on a device type, for
    the bit-field paths of Triton's interpreter (CPU: 0xFFFF from the vectorised cast, whatever
    the payload; read from torch, not assumed); 0 on CUDA, where the compiled kernels' NaN is
    the GPU's canonical one, as torch's (and reading it back here would sync, or fail inside a
    graph capture)."""
    if device_type == "cuda":
        return 0
    nan = torch.full((64,), float("nan"), dtype=torch.float32, device=device_type)
    return int(nan.to(torch.bfloat16).view(torch.int16)[0])


def gemm_operand(q, *, _strided: bool = False) -> torch.Tensor | None:
    """The exact bf16 values of an MXFP8 or NVFP4 operand without its per-tensor factor, in its
    logical shape (a transposed view for NVFP4 columnwise), from one pass over the packed data;
    None for other tensors. The same bits as `linear.gemm_operand_reference`. Contiguous data
    and scales run `dequant_nvfp4_kernel`, `dequant_mxfp8_rows_kernel` or
    `dequant_mxfp8_cols_kernel`, anything else (or `_strided=True`, for the tests)
    `dequant_kernel`."""
    if isinstance(q, NVFP4Tensor):
        fmt, (p, q2), sp, sq = 0, q.data.shape, 1, NVFP4_BLOCK
        cols = q2 * 2
    elif isinstance(q, MXFP8Tensor):
        fmt, (p, cols) = (1 if q.fmt == "e4m3" else 2), q.data.shape
        sp, sq = (MXFP8_BLOCK, 1) if q.axis == 0 else (1, MXFP8_BLOCK)
    else:
        return None
    if q.data.stride(1) != 1:
        return None
    dev = q.data.device
    out = torch.empty(p, cols, dtype=torch.bfloat16, device=dev)
    nan16 = _nan16(dev.type)
    dense = not _strided and q.data.is_contiguous() and q.scale.is_contiguous()
    if out.numel() and dense:
        _dequant_dense(q, fmt, p, cols, out.view(torch.int16), nan16)
    elif out.numel():
        tile = DEQUANT_TILE
        grid = (triton.cdiv(p, tile["BP"]), triton.cdiv(cols, tile["BQ"]))
        dequant_kernel[grid](
            q.data,
            q.scale,
            out.view(torch.int16),
            p,
            cols,
            q.data.stride(0),
            q.scale.stride(0),
            q.scale.stride(1),
            FMT=fmt,
            SP=sp,
            SQ=sq,
            NAN16=nan16,
            **tile,
            **_COMPILE_OPTIONS,
        )
    return out.t() if isinstance(q, NVFP4Tensor) and q.axis == 0 else out


def _dequant_dense(q, fmt, p, cols, out16, nan16):
    """`gemm_operand` for contiguous data and scales (out16: the bf16 output as int16)."""
    if fmt == 0:
        _dequant_flat(
            dequant_nvfp4_kernel, DEQUANT_NVFP4_TILE, q, out16.view(torch.int32), NAN16=nan16
        )
        return
    flags = {"FMT": fmt, "HW": _hw_fp8_for(q.data), "NAN16": nan16}
    if q.axis != 0:
        _dequant_flat(dequant_mxfp8_rows_kernel, DEQUANT_MXFP8_ROW_TILE, q, out16, **flags)
        return
    tile = dict(DEQUANT_MXFP8_COL_TILE)
    if MXFP8_BLOCK % tile["R"]:
        raise ValueError(f"DEQUANT_MXFP8_COL_TILE: R={tile['R']} must divide {MXFP8_BLOCK}")
    bq = 256 * tile["num_warps"]  # 8 columns a thread: one layout for scales and data
    grid = (p // tile["R"], triton.cdiv(cols, bq))
    dequant_mxfp8_cols_kernel[grid](
        q.data,
        q.scale,
        out16,
        cols,
        **flags,
        EVEN=cols % bq == 0,
        BQ=bq,
        **tile,
        **_COMPILE_OPTIONS,
    )


def _dequant_flat(kernel, tile, q, out, **flags):
    """A kernel that takes the packed data as one flat run of BLOCK elements a program."""
    n = q.data.numel()
    tile = dict(tile)
    kernel[(triton.cdiv(n, tile["BLOCK"]),)](
        q.data, q.scale, out, n, **flags, EVEN=n % tile["BLOCK"] == 0, **tile, **_COMPILE_OPTIONS
    )


def _gemm_view(q, r_is_q: bool):
    """An operand as the GEMM kernel reads it: (data, scale, rows X, reduction R, data strides
    (x, r), scale strides (x, r-block), format), where the reduction runs along the logical
    dim q (r_is_q) or p of q's logical [p, q] shape; None where the blocks do not run along it."""
    d, s = q.data, q.scale
    if isinstance(q, NVFP4Tensor):
        if r_is_q != (q.axis != 0):
            return None
        return d, s, d.shape[0], d.shape[1] * 2, d.stride(0), d.stride(1), *s.stride(), 0
    if isinstance(q, MXFP8Tensor):
        fmt = 1 if q.fmt == "e4m3" else 2
        if r_is_q and q.axis != 0:
            return d, s, d.shape[0], d.shape[1], d.stride(0), d.stride(1), *s.stride(), fmt
        if not r_is_q and q.axis == 0:
            return (
                d,
                s,
                d.shape[1],
                d.shape[0],
                d.stride(1),
                d.stride(0),
                s.stride(1),
                s.stride(0),
                fmt,
            )
    return None


def quantized_mm(a, b, transpose_a, transpose_b, alpha, out=None):
    """op(a) @ op(b) * alpha (float32) from the packed operands in one kernel, or added into
    `out` (float32) when given; None where the kernel does not take the operands (FP8
    per-tensor, mixed kinds): the caller runs the torch emulation."""
    if type(a) is not type(b) or not isinstance(a, (NVFP4Tensor, MXFP8Tensor)):
        return None
    va, vb = _gemm_view(a, not transpose_a), _gemm_view(b, transpose_b)
    if va is None or vb is None or va[3] != vb[3]:
        return None
    i, j, r = va[2], vb[2], va[3]
    c = out if out is not None else torch.empty(i, j, dtype=torch.float32, device=a.data.device)
    tile = GEMM_TILE
    grid = (triton.cdiv(i, tile["BI"]) * triton.cdiv(j, tile["BJ"]),)
    qgemm_kernel[grid](
        va[0],
        va[1],
        vb[0],
        vb[1],
        c,
        alpha if alpha is not None else c,
        i,
        j,
        r,
        *va[4:8],
        *vb[4:8],
        c.stride(0),
        c.stride(1),
        FMT_A=va[8],
        FMT_B=vb[8],
        ALPHA=alpha is not None,
        ACCUMULATE=out is not None,
        BF16_DOT=c.is_cuda,
        **tile,
        **_COMPILE_OPTIONS,
    )
    return c


# --- the emulated GEMM's epilogue --------------------------------------------------------------

GEMM_EPILOGUE_TILE = {"BR": 8, "BC": 512, "num_warps": 4}


def gemm_epilogue(c, a, b, mode, out=None, row_groups=None, offsets=None):
    """A GEMM result c [R, C] (or [G, N, K] with `offsets`) times alpha in one pass: written as
    a new bf16 tensor, or added into the float32 `out` (returned). `mode` and the factors a, b
    are `linear.alpha_factors`' (0: no alpha; 1: a * b; 2: NVFP4, (a * b) / 6^2 448^2). Rows:
    `row_groups` (a RowGroups) gives each row its group's factors and writes rows in no group as
    zeros; `offsets` (int32 cumulative group rows) reads c as G groups of N rows, each with its
    group's factors, an empty group's rows as zeros (the grouped weight gradient)."""
    c = c.contiguous()
    cols = c.shape[-1]
    rows = c.numel() // cols
    groups, group_rows, kind, count = c, 1, 0, 0
    if row_groups is not None:
        groups, kind, count = row_groups.index, 1, row_groups.count
    elif offsets is not None:
        kind, count, group_rows = 2, c.shape[0], c.shape[1]
    if out is None:
        out = torch.empty(c.shape, dtype=torch.bfloat16, device=c.device)
    tile = GEMM_EPILOGUE_TILE
    grid = (triton.cdiv(rows, tile["BR"]), triton.cdiv(cols, tile["BC"]))
    add = out.dtype == torch.float32
    gemm_epilogue_kernel[grid](
        c,
        out if add else out.view(torch.int16),
        a if a is not None else c,
        b if b is not None else c,
        groups,
        offsets if offsets is not None else c,
        rows,
        cols,
        count,
        group_rows,
        NAN16=_nan16(c.device.type),
        DIVISOR=NVFP4_ALPHA_DIVISOR,
        ALPHA=mode,
        GROUPS=kind,
        ADD=add,
        **tile,
        **_COMPILE_OPTIONS,
    )
    return out

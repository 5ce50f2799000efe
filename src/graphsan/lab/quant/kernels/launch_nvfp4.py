"""The NVFP4 launchers: outputs, tiles, and which kernel runs for which input.

Same arguments and bytes as `nvfp4.quantize_reference` (and `quantize_grouped_reference`); how a
copy is quantized is one `NVFP4Options`. The bf16-word kernels run where `words_fit(x)`, the
strided kernels elsewhere; `_strided=True` runs the strided kernels everywhere, for the
benchmarks and tests that compare the two.

The global amax is accumulated into a device buffer (atomic max, no host sync) and the quantize
kernel reads it there. SR bits are Philox bytes per 16-element block from one seed drawn on the
caller's generator, as the reference draws them (`elements.sr_bits`): the words kernels and the
fused column kernel make them in registers, the strided kernels read them from a tensor
(`elements.block_random_bits`). Columnwise copies with RHT or SR (1D blocks) run the fused
column kernel (`nvfp4_col.py`: the transform in registers too); with the strided kernels forced,
the RHT is the torch one. Either way SR is reproducible and graph-capturable.
"""

from __future__ import annotations

import torch
import triton

from ..elements import block_random_bits, random_seed
from ..formats import INV_6, NVFP4_BLOCK
from ..options import DEFAULT, NVFP4Options
from ..rht import rht as apply_rht
from ..tensors import NVFP4Tensor
from . import nvfp4 as jit
from . import nvfp4_col as col_jit
from . import nvfp4_words as words_jit
from .launch_common import COMPILE_OPTIONS, compiled, fast_kernels, hw_fp8_for, words_fit

(
    amax_kernel,
    group_amax_kernel,
    nvfp4_col_strided_kernel,
    nvfp4_col_words_kernel,
    nvfp4_row_strided_kernel,
    nvfp4_row_words_kernel,
    nvfp4_col_amax_kernel,
    nvfp4_col_fused_kernel,
) = fast_kernels(
    jit.amax_kernel,
    jit.group_amax_kernel,
    jit.nvfp4_col_strided_kernel,
    words_jit.nvfp4_col_words_kernel,
    jit.nvfp4_row_strided_kernel,
    words_jit.nvfp4_row_words_kernel,
    col_jit.nvfp4_col_amax_kernel,
    col_jit.nvfp4_col_fused_kernel,
)

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
AMAX_TILE = (4096, 16)  # (elements per load round, rounds per program)


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
    source, bits = _bits_source(x)
    tile = GROUP_AMAX_TILE
    iters = max(1, min(tile["ITERS"], triton.cdiv(k, tile["BC"])))
    grid = (triton.cdiv(m, tile["BR"]), triton.cdiv(k, tile["BC"] * iters))
    group_amax_kernel[grid](
        *source,
        groups,
        amax,
        num_groups,
        BF16_BITS=bits,
        BR=tile["BR"],
        BC=tile["BC"],
        ITERS=iters,
        num_warps=tile["num_warps"],
    )


def _bits_source(x):
    """x [M, K] as the kernels that widen bf16 by a shift read it, (bf16 as int16 bits, M, K, the
    two strides), and their BF16_BITS flag: one convention for the group amax and both column
    passes."""
    bits = x.dtype == torch.bfloat16
    return (x.view(torch.int16) if bits else x, *x.shape, *x.stride()), bits


def _col_flags(x, grouped, even) -> dict:
    """The constexprs both passes of `nvfp4_col.py` take alike: per-group amaxes, and the GPU's
    NaN-ignoring maximum and inline PTX where compiled (Triton's interpreter has neither)."""
    gpu = compiled(x)
    return {"GROUPED": grouped is not None, "MAXNUM": gpu, "PTX": gpu, "EVEN": even}


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
    source, bits = _bits_source(x)
    groups, count = grouped if grouped is not None else (amax, 0)
    tile = dict(NVFP4_COL_AMAX_TILE)
    rows = m // NVFP4_BLOCK  # block rows
    tile["ITERS"] = max(1, min(tile.get("ITERS", 1), rows // tile["NB"]))
    grid = (triton.cdiv(rows, tile["NB"] * tile["ITERS"]), triton.cdiv(k, tile["BK"]))
    even = rows % (tile["NB"] * tile["ITERS"]) == 0 and k % tile["BK"] == 0
    nvfp4_col_amax_kernel[grid](
        *source,
        amax,
        pre_amax if pre_amax is not None else amax,
        groups,
        count,
        BF16_BITS=bits,
        **_col_flags(x, grouped, even),
        PRE_AMAX=pre_amax is not None,
        **tile,
        **COMPILE_OPTIONS,
    )


def _nvfp4_flags(x, options: NVFP4Options) -> dict:
    """The constexprs every NVFP4 quantize kernel takes: the op order and the FP8 conversion."""
    return {"INV_6": INV_6, "LEGACY": options.legacy, "HW_FP8": hw_fp8_for(x)}


def _col_fused_launch(x, options: NVFP4Options, amax, seed, data, scale, grouped):
    """One launch of the quantize pass, `nvfp4_col_fused_kernel` (amax: the global amax buffer,
    or with `grouped` each row's; seed: the SR seed buffer)."""
    m, k = x.shape
    source, bits = _bits_source(x)
    tile = NVFP4_COL_FUSED_TILE
    grid = (triton.cdiv(m // NVFP4_BLOCK, tile["NB"]), triton.cdiv(k, tile["BK"]))
    even = (m // NVFP4_BLOCK) % tile["NB"] == 0 and k % tile["BK"] == 0
    nvfp4_col_fused_kernel[grid](
        *source,
        amax,
        seed,
        data.view(torch.int64),
        scale,
        **_nvfp4_flags(x, options),
        RHT=options.rht,
        SR=options.sr,
        BF16_BITS=bits,
        **_col_flags(x, grouped, even),
        **tile,
        **COMPILE_OPTIONS,
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
        **COMPILE_OPTIONS,
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


def _words_flags(x, options: NVFP4Options, per_row) -> dict:
    """The constexprs both bf16-words kernels take alike (the row kernel adds SR): the GPU's
    NaN-ignoring maximum where compiled (Triton's interpreter has none), per-row amaxes."""
    flags = _nvfp4_flags(x, options)
    return {**flags, "BLOCK_2D": options.block_2d, "MAXNUM": compiled(x), "PER_ROW": per_row}


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
        **_words_flags(x, options, per_row),
        SR=options.sr,
        **tile,
        **COMPILE_OPTIONS,
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
        **_words_flags(x, options, per_row),
        **tile,
        **COMPILE_OPTIONS,
    )

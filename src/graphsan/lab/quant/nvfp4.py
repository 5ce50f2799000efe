"""NVFP4: E2M1 elements (two per byte), one E4M3 scale per 16 elements, a float32 global scale.

Plain torch, following docs/numerics.md step by step (all arithmetic in float32, in this order):

1. Global: S_enc = min(2688 / amax, FLT_MAX), 1 when amax == 0 or S_enc == 0; S_dec = 1 / S_enc.
2. Per block: vec_max = max |x| over 1x16 (activations, gradients) or 16x16 ("2D", weights).
3. Block scale: current order (TE >= 2.15) s = vec_max * (S_enc * fl(1/6)); legacy order
   (TE 2.9-2.14) s = (vec_max / 6) * S_enc; then min(s, FLT_MAX), clamp to 448, E4M3 nearest even.
4. Encode factor: enc = min(1 / (fp32(s_e4m3) * S_dec), FLT_MAX).
5. q = E2M1(clamp(x * enc, -6, 6)): nearest even, or stochastic with 8 random bits per element.
6. Dequantize: q * (fp32(s_e4m3) * amax * fl(1/2688)).

Directions: axis -1 (rowwise) blocks along the last dim; axis 0 (columnwise) blocks along the
first dim and stores everything transposed ([K, M/2] data, [K, M/16] scales). How a copy is
quantized is one `NVFP4Options` (block_2d, order, rht, generator; options.py). The random
Hadamard transform (`rht=True`, columnwise wgrad copies only) is applied along the token dim and
rounded to bf16 before the global amax and the quantization; `amax` is then the post-RHT amax.

    q = quantize(x, axis=-1, options=NVFP4Options(block_2d=False, order="current"))
    q.data; q.scale; q.amax; dequantize(q)
    row, col = quantize_both(x, NVFP4Options(rht=True))  # both global amaxes from one read

A `generator` means stochastic rounding (one seed drawn from that generator, then Philox bytes
per 16-element block, `elements.sr_bits`: graph-capturable, no host sync, no data-dependent
shapes). With `block_2d` each 16x16 tile's scale byte is repeated over its 16 rows; rows beyond
the tensor count as zeros.

On CUDA, `quantize` runs the Triton kernels (`graphsan.lab.quant.kernels`) when Triton is
importable; `quantize_reference` is their fallback and their oracle. `quantize_grouped` gives
each row group (expert) of a stacked tensor its own global amax, for the grouped expert GEMMs
(kernels on CUDA, `quantize_grouped_reference` elsewhere).
"""

from __future__ import annotations

import torch

from . import kernels
from .elements import (
    check_blocked,
    check_groups,
    div,
    e2m1_decode,
    e2m1_rne,
    e2m1_stochastic,
    fp8_decode,
    fp8_encode,
    group_amax,
    nan_to_zero_abs,
    pack_nibbles,
    sr_bits,
    unpack_nibbles,
)
from .formats import E2M1_MAX, FLT_MAX, INV_6, NVFP4_BLOCK, NVFP4_GLOBAL_MAX
from .options import DEFAULT, NVFP4Options
from .rht import rht as apply_rht
from .tensors import NVFP4Tensor

BLOCK = NVFP4_BLOCK


def quantize(x: torch.Tensor, axis: int = -1, options: NVFP4Options = DEFAULT) -> NVFP4Tensor:
    """Quantize a 2-D tensor to NVFP4 along `axis`; Triton on CUDA, the reference elsewhere."""
    _check_args(x, axis, options)
    fast = kernels.nvfp4_launcher(x)
    if fast is not None:
        return fast.nvfp4_quantize(x, axis, options)
    return _reference(x, axis, options)


def quantize_both(
    x: torch.Tensor, options: NVFP4Options = DEFAULT
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """The (rowwise, columnwise) copies: `quantize(x, -1, options.for_rowwise())` and
    `quantize(x, 0, options)`, byte for byte, the generator drawn in that order. On CUDA one read
    of x takes both global amaxes (with `rht` the post-RHT one and the plain one together, as
    TE's quantizer takes them for its two copies), so the copies read x three times where two
    calls read it four times."""
    _check_args(x, -1, options.for_rowwise())
    _check_args(x, 0, options)
    fast = kernels.nvfp4_launcher(x)
    if fast is not None:
        return fast.nvfp4_quantize_both(x, options)
    row = _reference(x, -1, options.for_rowwise())
    return row, _reference(x, 0, options)


def quantize_reference(
    x: torch.Tensor, axis: int = -1, options: NVFP4Options = DEFAULT
) -> NVFP4Tensor:
    """The torch reference on any device."""
    _check_args(x, axis, options)
    return _reference(x, axis, options)


def _reference(x, axis, options: NVFP4Options) -> NVFP4Tensor:
    """Blocks run along the last dim of `src` (x, or x transposed); arguments already checked."""
    src = x.t() if axis == 0 else x
    if options.rht:
        src = apply_rht(src)  # bf16, along the token dim (the last dim of the transposed copy)
    x32 = src.to(torch.float32)

    amax = global_amax(x32)
    s_enc, s_dec = global_scales(amax)
    return _encode(x32, axis, options, s_enc, s_dec, amax)


def quantize_grouped(
    x: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    axis: int = -1,
    options: NVFP4Options = DEFAULT,
) -> NVFP4Tensor:
    """NVFP4 of a tensor whose rows form consecutive groups (experts), each with its own global
    amax (step 1 per group): the bytes equal quantizing each group's rows alone and stacking the
    results, provided no block crosses a group boundary. Rowwise 1x16 blocks never do; columnwise
    blocks, RHT blocks and 16x16 tiles run over 16 rows, so every group's row count must then be a
    multiple of 16 (the caller's guarantee: checking it would need a host sync).

    groups: int64 [rows], the group of each row; `num_groups` marks rows in no group (padding:
    ignored by the amax, quantized with S_enc = 1). The result's `amax` is float32 [num_groups]
    (post-RHT with `rht`). Stochastic rounding draws the same number of bits as `quantize`, in one
    call, so it is reproducible but does not repeat a per-group loop's bits.

    On CUDA the kernels run (`kernels.launch_nvfp4.nvfp4_quantize_grouped`: the same bytes,
    the per-group amax reduced on the device); `quantize_grouped_reference` is their oracle.
    """
    _check_args(x, axis, options)
    check_groups(x, groups, "NVFP4")
    fast = kernels.nvfp4_launcher(x)
    if fast is not None:
        q = fast.nvfp4_quantize_grouped(x, groups, num_groups, axis, options)
        if q is not None:
            return q
    return _grouped_reference(x, groups, num_groups, axis, options)


def quantize_grouped_both(
    x: torch.Tensor, groups: torch.Tensor, num_groups: int, options: NVFP4Options = DEFAULT
) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """`quantize_grouped`'s (rowwise, columnwise) copies, as `quantize_both` gives them: byte for
    byte the two calls (rowwise first), on CUDA with one read of x for both per-group amaxes
    where the kernels take both copies."""
    _check_args(x, -1, options.for_rowwise())
    _check_args(x, 0, options)
    check_groups(x, groups, "NVFP4")
    fast = kernels.nvfp4_launcher(x)
    if fast is not None:
        both = fast.nvfp4_quantize_grouped_both(x, groups, num_groups, options)
        if both is not None:
            return both
    row = quantize_grouped(x, groups, num_groups, -1, options.for_rowwise())
    return row, quantize_grouped(x, groups, num_groups, 0, options)


def quantize_grouped_reference(
    x: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    axis: int = -1,
    options: NVFP4Options = DEFAULT,
) -> NVFP4Tensor:
    """`quantize_grouped` in torch on any device."""
    _check_args(x, axis, options)
    check_groups(x, groups, "NVFP4")
    return _grouped_reference(x, groups, num_groups, axis, options)


def _grouped_reference(x, groups, num_groups, axis, options: NVFP4Options):
    src = x.t() if axis == 0 else x  # rows (the groups) run along the last dim when axis == 0
    if options.rht:
        src = apply_rht(src)
    x32 = src.to(torch.float32)
    line_amax = nan_to_zero_abs(x32).amax(dim=0 if axis == 0 else 1)
    amax = group_amax(line_amax, groups, num_groups)  # [num_groups + 1]
    s_enc, s_dec = global_scales(amax)
    if axis == 0:  # one group per 16-row block: the block's first row names it
        s_enc, s_dec = s_enc[groups[::BLOCK]].unsqueeze(0), s_dec[groups[::BLOCK]].unsqueeze(0)
    else:
        s_enc, s_dec = s_enc[groups].unsqueeze(1), s_dec[groups].unsqueeze(1)
    return _encode(x32, axis, options, s_enc, s_dec, amax[:num_groups])


def _encode(x32, axis, options: NVFP4Options, s_enc, s_dec, amax) -> NVFP4Tensor:
    """Steps 2-5 of the float32 source, whose global scales are known (one, or one per row or
    column where the rows are grouped)."""
    vec_max = block_amax(x32, options.block_2d)
    scale = block_scale(vec_max, s_enc, options.order)
    enc = encode_factor(scale, s_dec)
    codes = encode_elements(x32, enc, sr_bits(x32.shape, options.generator, x32.device))
    axis = -1 if axis != 0 else 0
    return NVFP4Tensor(pack_nibbles(codes), scale, amax, axis, options.block_2d, options.rht)


# --- the steps, one function each -----------------------------------------------------------


def global_amax(x32: torch.Tensor) -> torch.Tensor:
    """Max |x| over the whole tensor, ignoring NaN (float32 0-dim)."""
    return nan_to_zero_abs(x32).amax()


def global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: S_enc = min(2688 / amax, FLT_MAX), 1 when amax == 0 or S_enc == 0; S_dec = 1/S_enc."""
    s_enc = torch.clamp(div(NVFP4_GLOBAL_MAX, amax), max=FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return s_enc, div(1.0, s_enc)


def block_amax(x32: torch.Tensor, block_2d: bool) -> torch.Tensor:
    """Step 2: vec_max per 1x16 block ([R, C/16]), or per 16x16 tile repeated over its rows."""
    rows, cols = x32.shape
    a = nan_to_zero_abs(x32)
    if not block_2d:
        return a.reshape(rows, cols // BLOCK, BLOCK).amax(dim=-1)
    pad = (-rows) % BLOCK
    if pad:
        a = torch.cat((a, a.new_zeros(pad, cols)), dim=0)
    tiles = a.reshape(-1, BLOCK, cols // BLOCK, BLOCK).amax(dim=(1, 3))
    return tiles.repeat_interleave(BLOCK, dim=0)[:rows]


def block_scale(vec_max: torch.Tensor, s_enc: torch.Tensor, order: str) -> torch.Tensor:
    """Step 3: the E4M3 block scale bytes, in the `current` or `legacy` op order."""
    if order == "current":
        s = vec_max * (s_enc * INV_6)
    else:
        s = div(vec_max, E2M1_MAX) * s_enc
    s = torch.clamp(s, max=FLT_MAX)
    return fp8_encode(s, "e4m3")  # clamps to +-448, nearest even


def encode_factor(scale: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """Step 4: enc = min(1 / (fp32(s_e4m3) * S_dec), FLT_MAX) per block."""
    return torch.clamp(div(1.0, fp8_decode(scale, "e4m3") * s_dec), max=FLT_MAX)


def encode_elements(
    x32: torch.Tensor, enc: torch.Tensor, rbits: torch.Tensor | None
) -> torch.Tensor:
    """Step 5: E2M1 codes of clamp(x * enc, -6, 6), nearest even or stochastic."""
    rows, cols = x32.shape
    v = x32.reshape(rows, cols // BLOCK, BLOCK) * enc.unsqueeze(-1)
    v = v.clamp(-E2M1_MAX, E2M1_MAX).reshape(rows, cols)
    return e2m1_rne(v) if rbits is None else e2m1_stochastic(v, rbits)


def dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """Step 6: q * (fp32(s_e4m3) * amax * fl(1/2688)), float32 in the logical shape."""
    return q.dequantize()


def block_values(q: NVFP4Tensor) -> torch.Tensor:
    """q * fp32(s_e4m3) in the stored layout, without the global factor (exact in bf16)."""
    values = e2m1_decode(unpack_nibbles(q.data))
    return values * fp8_decode(q.scale, "e4m3").repeat_interleave(BLOCK, dim=1)


def _check_args(x, axis, options: NVFP4Options) -> None:
    """What the options cannot check alone: the tensor, the axis RHT applies to, and the
    generator's device."""
    check_blocked(x, axis, BLOCK, "NVFP4")
    if options.rht and axis != 0:
        raise ValueError("NVFP4: rht=True applies to columnwise (axis=0) wgrad copies only")
    generator = options.generator
    if generator is not None and torch.device(generator.device).type != x.device.type:
        raise ValueError(
            f"NVFP4: generator is on {generator.device}, the tensor on {x.device}; expected the same"
        )

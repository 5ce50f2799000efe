"""Element and scale encodings shared by the formats: E4M3, E5M2, E2M1 and E8M0.

Every function here works on float32 tensors and returns raw bytes (uint8) or float32, on any
device, without host synchronisation. The rules are the ones in docs/numerics.md:

- E4M3 / E5M2 elements: round to nearest even with saturation to +-max ("satfinite"): +-inf goes
  to +-max, NaN stays NaN. Torch casts round to nearest even but do not saturate on every torch
  version, so values are clamped first.
- E8M0 scales are built from float32 bit fields, never by a torch cast (which rounds to nearest
  even instead of up).
- E2M1 (FP4) codes 0-7 are the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign.
  Two codes per byte, element 2j in the low nibble.
"""

from __future__ import annotations

import torch

from .formats import E2M1_MAX, E8M0_BIAS, E8M0_MAX, E8M0_NAN, FP8_DTYPES, FP8_MAX


def check_fp8_format(fmt: str) -> None:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fmt={fmt!r}: expected one of {sorted(FP8_DTYPES)}")


def div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 a / b with one rounding, for tensors or Python numbers on either side.

    Torch computes `float / tensor` as reciprocal(tensor) * float, and on CUDA `tensor / float`
    as tensor * (1 / float): both round twice. Numbers become device tensors (a fill kernel, so
    this stays graph-capturable) and the division is tensor / tensor.
    """
    like = a if isinstance(a, torch.Tensor) else b
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(like, a, dtype=torch.float32)
    if not isinstance(b, torch.Tensor):
        b = torch.full((), b, dtype=torch.float32, device=like.device)
    return torch.div(a, b)


def nan_to_zero_abs(x32: torch.Tensor) -> torch.Tensor:
    """|x| with NaN replaced by 0, so a max over it ignores NaN (fmax semantics, amax starts at 0)."""
    a = x32.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def group_amax(line_amax: torch.Tensor, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Per-group max of per-line amaxes (a batched reduction, no host sync).

    line_amax: float32 [L], NaN-free (see `nan_to_zero_abs`); groups: int64 [L], the group of each
    line, `num_groups` for a line in no group. Returns float32 [num_groups + 1]: one amax per
    group (0 for an empty group), then 0 for the lines in no group, which are ignored.
    """
    out = torch.zeros(num_groups + 1, dtype=torch.float32, device=line_amax.device)
    out = out.scatter_reduce(0, groups, line_amax, "amax", include_self=True)
    return torch.cat((out[:num_groups], torch.zeros_like(out[num_groups:])))


def check_groups(x: torch.Tensor, groups: torch.Tensor, what: str) -> None:
    """A row-group index fits x: int64, one entry per row, on x's device."""
    if groups.dtype != torch.int64 or groups.shape != (x.shape[0],) or groups.device != x.device:
        raise ValueError(
            f"{what} grouped: groups is {groups.dtype} {tuple(groups.shape)} on {groups.device}; "
            f"expected int64 ({x.shape[0]},) on {x.device} (the group of each row)"
        )


def check_blocked(x: torch.Tensor, axis: int, block: int, what: str) -> None:
    """Raise a ValueError unless x is a 2-D floating-point tensor whose blocked dimension (the
    last for axis -1, the first for axis 0) is a multiple of `block`."""
    if axis not in (-1, 0, 1):
        raise ValueError(f"{what}: axis={axis!r}; expected -1 (rowwise) or 0 (columnwise)")
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{what}: expected a floating-point tensor, got {x.dtype}")
    dim = 0 if axis == 0 else 1
    if x.shape[dim] % block:
        direction = "columnwise (axis=0)" if dim == 0 else "rowwise (axis=-1)"
        raise ValueError(
            f"{what} {direction}: dimension {dim} of shape {tuple(x.shape)} is {x.shape[dim]}, "
            f"expected a multiple of {block}"
        )


# --- FP8 elements (E4M3, E5M2) ---------------------------------------------------------------


def fp8_encode(x32: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round float32 to the FP8 format, nearest even, saturating to +-max; returns the bytes."""
    m = FP8_MAX[fmt]
    return x32.clamp(-m, m).to(FP8_DTYPES[fmt]).view(torch.uint8)


def fp8_decode(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """FP8 bytes -> float32 (exact)."""
    return data.view(FP8_DTYPES[fmt]).to(torch.float32)


# --- E8M0 scales ------------------------------------------------------------------------------


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """TE's E8M0 rule for a non-negative float32 `v` = amax * fl(1/max_elem); returns bytes.

    The biased exponent is v's float32 exponent field, plus 1 if any mantissa bit is set, except:
    field already 0xFE stays 0xFE; a subnormal v with mantissa <= 0x400000 (v <= 2^-127) gives
    0x00; v == 0 gives 0x00; v == inf gives 0xFE; NaN gives 0xFF.
    """
    bits = v.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != E8M0_MAX) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + round_up.to(torch.int32)
    e = torch.where(torch.isinf(v), torch.full_like(e, E8M0_MAX), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, E8M0_NAN), e)
    return e.to(torch.uint8)


def exp2_biased(e: torch.Tensor, negate: bool = False) -> torch.Tensor:
    """Exact float32 2^(e-127) (or 2^(127-e) with `negate`) for E8M0 bytes, built from bits.

    2^-127 is the float32 subnormal 0x00400000; 2^128 is +inf; byte 0xFF gives NaN.
    """
    k = e.to(torch.int32) - E8M0_BIAS
    if negate:
        k = -k
    normal = ((k + 127).clamp(1, 254) << 23).view(torch.float32)
    out = torch.where(k == -127, torch.full_like(normal, 2.0**-127), normal)
    out = torch.where(k == 128, torch.full_like(out, float("inf")), out)
    return torch.where(e == E8M0_NAN, torch.full_like(out, float("nan")), out)


# --- E2M1 (FP4) elements --------------------------------------------------------------------

# Magnitude a maps to code = number of thresholds it passes; ">" where a tie goes down (to the
# even code below), ">=" where a tie goes up (to the even code above).
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)  # 0.25->0, 1.25->1, 2.5->2, 5->4
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # 0.75->1, 1.75->2, 3.5->4


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """Round float32 `v` (already clamped to [-6, 6]) to E2M1 codes, nearest even.

    Sign bit only for strictly negative inputs (-0.0 gives code 0, tiny negatives code 8).
    NaN gives +6 (code 7), the documented policy.
    """
    a = v.abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, E2M1_MAX), a)
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t in _E2M1_TIES_DOWN:
        code += (a > t).to(torch.uint8)
    for t in _E2M1_TIES_UP:
        code += (a >= t).to(torch.uint8)
    return code | ((v < 0).to(torch.uint8) << 3)


def e2m1_stochastic(v: torch.Tensor, rbits: torch.Tensor) -> torch.Tensor:
    """Stochastically round float32 `v` (clamped to [-6, 6]) to E2M1 codes with 8 random bits.

    u = r/256; t = |v| + u * step(|v|); q = min(floor(t / step(t)) * step(t), 6), where step is
    the grid spacing: 0.5 below 2, 1 on [2, 4), 2 on [4, 6]. NaN gives +6.
    """
    a = v.abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, E2M1_MAX), a)
    u = rbits.to(torch.float32) * (1.0 / 256.0)
    t = a + u * _e2m1_step(a)
    step_t = _e2m1_step(t)
    q = torch.minimum(torch.floor(t / step_t) * step_t, torch.full_like(t, E2M1_MAX))
    code = e2m1_rne(q)  # q is on the grid already; this only maps value -> code
    return code | ((v < 0).to(torch.uint8) << 3)


# Philox4x32-10 (Salmon et al., SC 2011) with the round and key constants of Triton's
# `tl.randint4x`, so a kernel draws in registers exactly the bits `block_random_bits` returns.
_PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF


def random_seed(generator: torch.Generator, device) -> torch.Tensor:
    """One int64 seed (0-dim, on the device) drawn from `generator` for `block_random_bits`:
    graph-safe (randint on the device, no host sync); a replay draws a fresh seed."""
    return torch.randint(0, 2**62, (), generator=generator, device=device, dtype=torch.int64)


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of the 64-bit product of the constant a and uint32 values b (int64
    tensors), from 16-bit halves of b so no partial product leaves int64."""
    t = a * (b & 0xFFFF)  # < 2^48
    u = a * (b >> 16)  # < 2^48
    return (u + (t >> 16)) >> 16, (((u & 0xFFFF) << 16) + t) & _U32


def philox4x32(seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 of counters (c0, c1) = (counter mod 2^32, counter >> 32), c2 = c3 = 0, key
    (seed mod 2^32, seed >> 32): four uint32 words as int64 tensors, as Triton's
    `tl.randint4x(seed, counter)` returns them for an int64 counter."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    c0, c1 = counter & _U32, (counter >> 32) & _U32
    c2 = c3 = torch.zeros_like(counter)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND[1], c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY[0]) & _U32, (k1 + _PHILOX_KEY[1]) & _U32
    return c0, c1, c2, c3


def block_random_bits(seed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """8 random bits per element of an [rows, cols] source quantized in 16-element blocks along
    its last dim (cols a multiple of 16), from a counter-based generator: block b (row-major
    index in [rows, cols/16]) takes the 16 bytes of `philox4x32(seed, b)`, element j of the
    block byte j % 4 (lowest first) of word j // 4. One Philox call per block, so a kernel that
    holds a whole block makes its bits in registers (uint8 [rows, cols])."""
    counter = torch.arange(rows * (cols // 16), dtype=torch.int64, device=seed.device)
    words = torch.stack(philox4x32(seed, counter), dim=-1)  # [blocks, 4]
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=seed.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(rows, cols)


def sr_bits(shape, generator: torch.Generator | None, device) -> torch.Tensor | None:
    """The 8 random bits per element of stochastic rounding for a source of `shape` quantized
    in 16-element blocks along its last dim (None without a generator): one seed drawn from the
    generator, then Philox bytes per block (`block_random_bits`), which the kernels make in
    registers instead of reading a bits tensor."""
    if generator is None:
        return None
    return block_random_bits(random_seed(generator, device), *shape)


def _e2m1_step(a: torch.Tensor) -> torch.Tensor:
    half, one, two = (torch.full_like(a, s) for s in (0.5, 1.0, 2.0))
    return torch.where(a < 2.0, half, torch.where(a < 4.0, one, two))


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (0-15) -> float32 values (code 8 is -0.0)."""
    # From the bit fields, not a lookup table: a table would be a host-to-device copy, which is
    # illegal inside CUDA graph capture (the first forward of a graphed NVFP4 layer).
    c = codes.to(torch.int32)
    e = ((c >> 1) & 3).to(torch.float32)
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1.0) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (inverse of `pack_nibbles`)."""
    return torch.stack((data & 0x0F, data >> 4), dim=-1).flatten(-2)

"""Independent oracles and inputs for the quantization tests (shared by test_quant_*.py and
test_grouped_*.py).

Nothing here reuses the code under test: FP8 rounding searches all 256 byte values, E8M0 scales come
from float64 logarithms, NVFP4 follows the spec's steps with numpy float32 scalars, GEMMs are
float64 products.
"""

from __future__ import annotations

import math

import numpy as np
import torch

F32 = np.float32


def fp8_grid(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, float64 values) of every finite, non-negative value of the format."""
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    codes = torch.arange(0, 128, dtype=torch.uint8)
    vals = codes.view(dtype).to(torch.float64).numpy()
    keep = np.isfinite(vals)
    return codes.numpy()[keep], vals[keep]


def fp8_rne_oracle(x: float, fmt: str) -> int:
    """Byte of float x rounded nearest-even with saturation, by searching the grid."""
    codes, vals = fp8_grid(fmt)
    if math.isnan(x):
        return None  # any NaN pattern
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = min(abs(x), vals.max())
    d = np.abs(vals - a)
    best = np.flatnonzero(d == d.min())
    if len(best) > 1:  # tie: the even code (even mantissa)
        best = [b for b in best if codes[b] % 2 == 0]
    return int(codes[best[0]]) | sign


def e8m0_te_oracle(amax: float, fmt: str) -> int:
    """TE's scale byte: smallest e with amax * fl(1/max) <= 2^(e-127), from float64 math."""
    inv = float(F32(1.0) / F32({"e4m3": 448.0, "e5m2": 57344.0}[fmt]))
    v = float(F32(F32(amax) * F32(inv)))
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0 or v <= 2.0**-127:
        return 0
    e = math.ceil(math.log2(v)) + 127
    return min(max(e, 0), 0xFE)


def e2m1_oracle(v: float) -> int:
    """E2M1 code of v (already scaled and clamped), nearest even by search."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    if math.isnan(v):
        return 7
    a = min(abs(v), 6.0)
    d = [abs(g - a) for g in grid]
    m = min(d)
    cands = [i for i, di in enumerate(d) if di == m]
    code = cands[0] if len(cands) == 1 else [c for c in cands if c % 2 == 0][0]
    return code | (8 if v < 0 else 0)


def nvfp4_block_oracle(block: np.ndarray, global_amax: float, order: str = "current"):
    """(scale byte, codes) of one 16-element block (float32 numpy) by the spec, step by step."""
    amax = F32(global_amax)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s_enc = min(F32(2688.0) / amax, F32(np.finfo(F32).max)) if amax != 0 else F32(1.0)
        if s_enc == 0:
            s_enc = F32(1.0)
        s_dec = F32(1.0) / F32(s_enc)
        vec_max = F32(np.nanmax(np.abs(block))) if not np.all(np.isnan(block)) else F32(0)
        if order == "current":
            s = vec_max * (F32(s_enc) * (F32(1.0) / F32(6.0)))
        else:
            s = (vec_max / F32(6.0)) * F32(s_enc)
        s = min(F32(s), F32(np.finfo(F32).max))
        byte = fp8_rne_oracle(float(min(s, F32(448.0))), "e4m3")
        s_q = F32(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item())
        enc = min(F32(1.0) / (s_q * s_dec), F32(np.finfo(F32).max))
        codes = [e2m1_oracle(float(np.clip(F32(x) * enc, -6, 6))) for x in block]
    return byte, codes


def mxfp8_numpy_reference(x: np.ndarray, fmt: str, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised independent MXFP8 reference (numpy): (data bytes [M, K], scale bytes)."""
    src = x.T if axis == 0 else x
    rows, cols = src.shape
    b = src.astype(np.float32).reshape(rows, cols // 32, 32)
    a = np.abs(b)
    amax = np.where(np.isnan(a), 0, a).max(axis=-1)
    inv = F32(1.0) / F32({"e4m3": 448.0, "e5m2": 57344.0}[fmt])
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        v = (amax * inv).astype(np.float32).astype(np.float64)
        e = np.ceil(np.log2(np.where(v > 0, v, 1.0))) + 127
    e = np.where(v <= 2.0**-127, 0, e)
    e = np.where(np.isinf(v), 0xFE, np.minimum(e, 0xFE)).astype(np.int64)
    factor = np.ldexp(np.float32(1.0), (127 - e)).astype(np.float32)  # exact 2^(127-e) in fp32
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = (b * factor[..., None]).astype(np.float32).astype(np.float64)
    codes, vals = fp8_grid(fmt)
    mag = np.minimum(np.abs(scaled), vals.max())
    hi = np.clip(np.searchsorted(vals, mag), 1, len(vals) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - vals[lo], vals[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    idx = np.where(mag == 0, 0, np.where(pick_hi, hi, lo))
    byte = codes[idx].astype(np.uint8) | np.where(np.signbit(scaled), 0x80, 0).astype(np.uint8)
    nan_byte = 0x7F
    byte = np.where(np.isnan(scaled), nan_byte, byte).astype(np.uint8)
    data = byte.reshape(rows, cols)
    scale = e.astype(np.uint8)
    if axis == 0:
        return data.T.copy(), scale.T.copy()
    return data, scale


def skewed(rows, cols, g):
    """Random bf16 whose row and column magnitudes vary: rowwise and columnwise blocks differ."""
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    return (x * torch.exp(torch.randn(1, cols, generator=g))).to(torch.bfloat16)


def ref_mm(a, b, alpha=None):
    """float64 product of dequantized operands and the |a||b| scale for the tolerance."""
    out = a.double() @ b.double()
    mag = a.double().abs() @ b.double().abs()
    if alpha is not None:
        out, mag = out * alpha.double(), mag * alpha.double()
    return out, mag

"""The formats' constants, defined once: block sizes, element and scale limits, and the float32
constants the rules multiply by (docs/numerics.md). The torch reference and the Triton kernels
both read them from here.
"""

from __future__ import annotations

import functools

import torch

FLT_MAX = torch.finfo(torch.float32).max

# --- elements ----------------------------------------------------------------------------------

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
# (mantissa bits, smallest normal exponent, subnormal quanta per unit = 2^(mbits - emin)) of each
# FP8 format: what the kernels' bit-field encoding needs where there is no hardware conversion
FP8_BITS = {"e4m3": (3, -6, 2.0**9), "e5m2": (2, -14, 2.0**16)}

# --- E8M0 scales -------------------------------------------------------------------------------

E8M0_BIAS = 127
E8M0_MAX = 0xFE  # 2^127, the largest scale
E8M0_NAN = 0xFF

# --- blocks ------------------------------------------------------------------------------------

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16


@functools.cache
def fp32_reciprocal(value: float) -> float:
    """fl(1/value) computed as one IEEE float32 division (what a kernel's constant holds).
    Cached: computed once per constant, never inside a captured forward."""
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(value, dtype=torch.float32))


# --- NVFP4 per-tensor factors ------------------------------------------------------------------

NVFP4_GLOBAL_MAX = E2M1_MAX * E4M3_MAX  # 2688: S_enc = 2688 / amax
INV_6 = fp32_reciprocal(E2M1_MAX)  # fl(1/6), the current op order's block-scale factor
INV_2688 = fp32_reciprocal(NVFP4_GLOBAL_MAX)  # fl(1/2688), the dequantization factor
NVFP4_ALPHA_DIVISOR = NVFP4_GLOBAL_MAX**2  # 6^2 * 448^2: a GEMM's alpha is amax_A amax_B / this

"""The emulated low-precision GEMM of the quantized modules (docs/numerics.md, "The quantized
Linear"), the way Hopper must run it: dequantize the operands exactly to bf16 (without the
per-tensor factor; MXFP8 blocks with the tiniest scales excepted, see docs/numerics.md), bf16
GEMM with float32 accumulation, then one float32 alpha (NVFP4: amax_A * amax_B / (6^2 * 448^2);
FP8 per-tensor: the product of the scale_invs; MXFP8: 1).

On CUDA the operands are prepared, and alpha, the rounding and a main_grad addition applied, by
Triton passes (`kernels.launch_gemm`); the `*_reference` functions are their torch oracles and
run everywhere else. QuantLinear (linear.py) and GroupedQuantLinear (grouped.py) call these.
"""

from __future__ import annotations

import torch

from . import kernels, nvfp4
from .elements import div, fp8_decode
from .formats import NVFP4_ALPHA_DIVISOR
from .tensors import FP8Tensor, MXFP8Tensor, NVFP4Tensor, QTensor


def gemm_operand(q: QTensor) -> torch.Tensor:
    """Exact bf16 values of a quantized operand in its logical [rows, cols] shape, without the
    per-tensor factor (which goes into alpha). On CUDA one Triton pass over the packed MXFP8 or
    NVFP4 data (`kernels.launch_gemm.gemm_operand`); `gemm_operand_reference` is its
    oracle."""
    fast = kernels.gemm_launcher(q.data)
    if fast is not None:
        values = fast.gemm_operand(q)
        if values is not None:
            return values
    return gemm_operand_reference(q)


def gemm_operand_reference(q: QTensor) -> torch.Tensor:
    """`gemm_operand` in torch, on any device."""
    if isinstance(q, NVFP4Tensor):
        values = nvfp4.block_values(q)  # E2M1 x E4M3: exact in bf16
        values = values.t() if q.axis == 0 else values
    elif isinstance(q, MXFP8Tensor):
        # element x 2^k: exact in bf16 for scale bytes >= 3 (E4M3) or 10 (E5M2); below that the
        # smallest elements fall under bf16's subnormal grid (docs/numerics.md)
        values = q.dequantize()
    elif isinstance(q, FP8Tensor):
        values = fp8_decode(q.data, "e4m3")
        values = values.t() if q.axis == 0 else values
    else:
        raise TypeError(f"not a quantized tensor: {type(q).__name__}")
    return values.to(torch.bfloat16)


def gemm_alpha(a: QTensor, b: QTensor) -> torch.Tensor | None:
    """The float32 epilogue factor of a GEMM of `a` and `b`, computed on device (None: 1)."""
    if isinstance(a, NVFP4Tensor):
        return div(a.amax * b.amax, NVFP4_ALPHA_DIVISOR)
    if isinstance(a, FP8Tensor):
        return a.scale_inv * b.scale_inv
    return None


def alpha_factors(a: QTensor, b: QTensor) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """`gemm_alpha` as the epilogue kernel computes it (`kernels.launch_gemm.gemm_epilogue`):
    the two factors and the mode (2: NVFP4 amaxes, (a * b) / 6^2 448^2; 1: FP8 scale_invs,
    a * b; 0: none)."""
    if isinstance(a, NVFP4Tensor):
        return a.amax, b.amax, 2
    if isinstance(a, FP8Tensor):
        return a.scale_inv, b.scale_inv, 1
    return None, None, 0


_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether torch.mm(..., out_dtype=) works


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 a @ b with float32 accumulation and a float32 result."""
    if a.is_cuda:
        ok = _MM_OUT_DTYPE.get("cuda")
        if ok is None:  # probed once, eagerly (the first call is never inside a capture)
            try:
                torch.mm(a[:1, :1], b[:1, :1], out_dtype=torch.float32)
                ok = True
            except (TypeError, RuntimeError):
                ok = False
            _MM_OUT_DTYPE["cuda"] = ok
        if ok:
            return torch.mm(a, b, out_dtype=torch.float32)
    # bf16 x bf16 products are exact in float32, so this is a float32-accumulated bf16 GEMM.
    return torch.mm(a.to(torch.float32), b.to(torch.float32))


def quantized_mm(
    a: QTensor,
    b: QTensor,
    transpose_a: bool = False,
    transpose_b: bool = False,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """op(a) @ op(b) * alpha in float32, from exactly dequantized bf16 operands, returned in
    `out_dtype` (the float32 result rounded once); added into the float32 `out` when given (and
    `out` returned). On CUDA each operand is prepared by one Triton pass over its packed data
    (`gemm_operand`), the bf16 GEMM is cuBLAS's and alpha, the rounding and the addition are one
    Triton pass (`kernels.launch_gemm.gemm_epilogue`); with `kernels.launch_gemm.FUSED_GEMM`
    one Triton GEMM reads the packed operands instead (`kernels.launch_gemm.quantized_mm`,
    tested against `quantized_mm_reference`)."""
    fast = kernels.gemm_launcher(a.data)
    if fast is not None and fast.FUSED_GEMM:
        c = fast.quantized_mm(a, b, transpose_a, transpose_b, gemm_alpha(a, b), out)
        if c is not None:
            return c if out is not None else c.to(out_dtype)
    a_val, b_val = gemm_operand(a), gemm_operand(b)
    return _values_mm(a_val, b_val, a, b, transpose_a, transpose_b, out, out_dtype)


def quantized_mm_reference(
    a: QTensor,
    b: QTensor,
    transpose_a: bool = False,
    transpose_b: bool = False,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`quantized_mm` in torch on any device: dequantize each operand to bf16, bf16 GEMM with
    float32 accumulation, alpha."""
    a_val, b_val = gemm_operand_reference(a), gemm_operand_reference(b)
    return _values_mm(a_val, b_val, a, b, transpose_a, transpose_b, out, out_dtype, torch_only=True)


def _values_mm(a_val, b_val, a, b, transpose_a, transpose_b, out, out_dtype, torch_only=False):
    """The bf16 GEMM of the operand values, alpha, the rounding to `out_dtype` or the addition
    into `out`: one epilogue kernel on CUDA where there is an alpha (without one the rounding or
    the addition is a single torch operation anyway)."""
    c = mm_fp32(a_val.t() if transpose_a else a_val, b_val.t() if transpose_b else b_val)
    x, y, mode = alpha_factors(a, b)
    fast = None if torch_only else kernels.gemm_launcher(c)
    if fast is not None and mode and (out is not None or out_dtype == torch.bfloat16):
        return fast.gemm_epilogue(c, x, y, mode, out=out)
    alpha = gemm_alpha(a, b)
    c = c if alpha is None else c * alpha
    return c.to(out_dtype) if out is None else out.add_(c)

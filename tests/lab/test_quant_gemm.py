"""The GEMM kernels (kernels/gemm.py) in Triton's interpreter on CPU: the one-pass operand
preparation byte-equal to the torch dequantization for every operand kind and edge value; the
packed-operand GEMM, for each GEMM of the quantized Linear, against dequantize-then-GEMM in
float64, for MXFP8 (E4M3, and E5M2 gradients) and NVFP4 (2-D weights, RHT, SR); the operand
layouts it leaves to the torch emulation. The compiled kernels are checked by
test_quant_triton_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from graphsan.lab.quant import get_recipe
from graphsan.lab.quant.linear import quantized_mm_reference
from tests.lab.kernel_checks import (
    assert_gemm_operands_match,
    assert_quantized_mm_matches,
    quantized_gemm_cases,
)

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="this machine has CUDA: the compiled kernels are tested (test_quant_triton_gpu)",
    ),
    # an infinite element times its scale, on purpose; numpy says so
    pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning"),
]

RECIPES = {
    "mxfp8": get_recipe("mxfp8"),
    "mxfp8-hybrid": get_recipe("mxfp8", fp8_format="hybrid"),
    "nvfp4": get_recipe("nvfp4"),
    "nvfp4-plain": get_recipe("nvfp4", rht=False, sr=False, weight_2d=False, order="legacy"),
}


@pytest.fixture(scope="module")
def tk():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py)")
    pytest.importorskip("triton")
    from graphsan.lab.quant import kernels

    assert kernels.available(), "triton imports but the kernels do not"
    from graphsan.lab.quant.kernels import launch

    return launch


def test_operand_preparation_equals_the_torch_dequantization(tk):
    assert_gemm_operands_match(tk, "cpu", (64, 160))


@pytest.mark.parametrize("name", list(RECIPES))
def test_packed_gemm_matches_dequantize_then_gemm(tk, name):
    """Two tiles along the output's columns (the second partial), a reduction that is not a
    multiple of the tile's (96 = 64 + 32), every GEMM orientation."""
    assert_quantized_mm_matches(tk, RECIPES[name], 64, 96, 160, "cpu")


def test_packed_gemm_is_close_to_the_torch_emulation(tk):
    """Same operands, both accumulating in float32: the kernel and the torch emulation agree to
    2^-18 of the largest output."""
    from graphsan.lab.quant.linear import gemm_alpha

    for name, a, b, ta, tb in quantized_gemm_cases(RECIPES["nvfp4"], 64, 96, 160, "cpu"):
        got = tk.quantized_mm(a, b, ta, tb, gemm_alpha(a, b))
        ref = quantized_mm_reference(a, b, ta, tb)
        scale = ref.abs().max()
        assert ((got - ref).abs() <= scale * 2.0**-18).all(), name


def test_layouts_left_to_the_emulation(tk):
    """Operands whose blocks do not run along the reduction dim, mixed kinds and FP8 per-tensor
    give None (the caller's torch emulation runs)."""
    cases = quantized_gemm_cases(RECIPES["nvfp4"], 64, 96, 160, "cpu")
    _, x_row, w_row, _, _ = cases[0]
    assert tk.quantized_mm(x_row, w_row, False, False, None) is None  # W's blocks along N
    m_cases = quantized_gemm_cases(RECIPES["mxfp8"], 64, 96, 160, "cpu")
    assert tk.quantized_mm(x_row, m_cases[0][2], False, True, None) is None
    f_cases = quantized_gemm_cases(get_recipe("fp8"), 64, 96, 160, "cpu")
    assert tk.quantized_mm(f_cases[0][1], f_cases[0][2], False, True, None) is None

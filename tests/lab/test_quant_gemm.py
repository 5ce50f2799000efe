"""The GEMM kernels (kernels/gemm.py) in Triton's interpreter on CPU: the one-pass operand
preparation byte-equal to the torch dequantization for every operand kind and edge value; the
packed-operand GEMM, for each GEMM of the quantized Linear, against dequantize-then-GEMM in
float64, for MXFP8 (E4M3, and E5M2 gradients) and NVFP4 (2-D weights, RHT, SR); the operand
layouts it leaves to the torch emulation. The compiled kernels are checked by
test_quant_gemm_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from graphsan.lab.quant import get_recipe
from graphsan.lab.quant.gemm import quantized_mm_reference
from tests.lab.kernel_checks import (
    assert_gemm_operand_bits,
    assert_gemm_operands_match,
    assert_quantized_mm_matches,
    exhaustive_operands,
    launchers,
    quantized_gemm_cases,
    random_byte_operands,
)

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="this machine has CUDA: the compiled kernels are tested (test_quant_gemm_gpu)",
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
    return launchers()


def test_operand_preparation_equals_the_torch_dequantization(tk):
    assert_gemm_operands_match(tk, "cpu", (64, 160))


# Launch tiles and small ones (several programs, partial last tiles); (64, 128) fills whole
# tiles of the contiguous kernels at the launch tiles (their EVEN path), (96, 160) does not.
SMALL_TILES = {
    "DEQUANT_NVFP4_TILE": {"BLOCK": 256, "num_warps": 2},
    "DEQUANT_MXFP8_ROW_TILE": {"BLOCK": 512, "num_warps": 2},
    "DEQUANT_MXFP8_COL_TILE": {"R": 4, "num_warps": 1},
    "DEQUANT_TILE": {"BP": 16, "BQ": 64, "num_warps": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("tiles", ["launch", "small"])
@pytest.mark.parametrize("shape", [(64, 128), (96, 160)])
def test_operand_preparation_on_random_bytes(tk, tiles, shape, monkeypatch):
    """Random data and scale bytes (every E2M1 pair, FP8 NaN, E5M2 inf, NaN and negative E4M3
    scales, tiny and NaN E8M0 scales; a fresh seed each run, printed on failure), every
    kernel, bit for bit."""
    if tiles == "small":
        for name, tile in SMALL_TILES.items():
            monkeypatch.setattr(tk.gemm, name, tile)
    seed = int.from_bytes(os.urandom(4), "little")
    assert_gemm_operand_bits(tk, random_byte_operands("cpu", seed, shape), f"seed {seed}")


@pytest.mark.slow
def test_operand_preparation_every_element_and_scale_byte(tk):
    """All 256 element bytes (NVFP4: code pairs) against all 256 scale bytes, each format and
    direction."""
    assert_gemm_operand_bits(tk, exhaustive_operands("cpu"))


def test_operand_preparation_picks_the_contiguous_kernels(tk, monkeypatch):
    """Contiguous data and scales run the NVFP4, MXFP8 rowwise and columnwise kernels; a data
    slice (row stride wider than the row) and `_strided=True` the strided one."""
    calls = []
    names = ("dequant_nvfp4_kernel", "dequant_mxfp8_rows_kernel", "dequant_mxfp8_cols_kernel")
    for name in names + ("dequant_kernel",):
        monkeypatch.setattr(tk.gemm, name, _Recorder(name, calls))
    ops = random_byte_operands("cpu", 0, (64, 128))
    picked = []
    for q in ops:
        calls.clear()
        tk.gemm.gemm_operand(q)
        picked.append(calls[0])
    assert (
        picked
        == [names[0], names[0], "dequant_kernel"] + [names[1], names[2], "dequant_kernel"] * 2
    )
    calls.clear()
    tk.gemm.gemm_operand(ops[0], _strided=True)
    assert calls == ["dequant_kernel"]


class _Recorder:
    """Stands in for a kernel: `kernel[grid](...)` records its name."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(self.name)


@pytest.mark.parametrize("name", list(RECIPES))
def test_packed_gemm_matches_dequantize_then_gemm(tk, name):
    """Two tiles along the output's columns (the second partial), a reduction that is not a
    multiple of the tile's (96 = 64 + 32), every GEMM orientation."""
    assert_quantized_mm_matches(tk, RECIPES[name], 64, 96, 160, "cpu")


def test_packed_gemm_is_close_to_the_torch_emulation(tk):
    """Same operands, both accumulating in float32: the kernel and the torch emulation agree to
    2^-18 of the largest output."""
    from graphsan.lab.quant.gemm import gemm_alpha

    for name, a, b, ta, tb in quantized_gemm_cases(RECIPES["nvfp4"], 64, 96, 160, "cpu"):
        got = tk.gemm.quantized_mm(a, b, ta, tb, gemm_alpha(a, b))
        ref = quantized_mm_reference(a, b, ta, tb)
        scale = ref.abs().max()
        assert ((got - ref).abs() <= scale * 2.0**-18).all(), name


def test_layouts_left_to_the_emulation(tk):
    """Operands whose blocks do not run along the reduction dim, mixed kinds and FP8 per-tensor
    give None (the caller's torch emulation runs)."""
    cases = quantized_gemm_cases(RECIPES["nvfp4"], 64, 96, 160, "cpu")
    _, x_row, w_row, _, _ = cases[0]
    assert tk.gemm.quantized_mm(x_row, w_row, False, False, None) is None  # W's blocks along N
    m_cases = quantized_gemm_cases(RECIPES["mxfp8"], 64, 96, 160, "cpu")
    assert tk.gemm.quantized_mm(x_row, m_cases[0][2], False, True, None) is None
    f_cases = quantized_gemm_cases(get_recipe("fp8"), 64, 96, 160, "cpu")
    assert tk.gemm.quantized_mm(f_cases[0][1], f_cases[0][2], False, True, None) is None

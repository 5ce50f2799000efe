"""The Triton quantize kernels under Triton's interpreter (TRITON_INTERPRET=1) on CPU, byte for
byte against the torch reference: the kernels' logic is checked on every machine with Triton,
GPU or not. The compiled kernels (and the hardware FP8 conversion, which the interpreter only
emulates) are checked on the GPU by test_quant_triton_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

from tests.lab.kernel_checks import (
    assert_mxfp8_matches,
    assert_nvfp4_edges_match,
    assert_nvfp4_matches,
    edge_inputs,
    mxfp8_inputs,
)

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="this machine has CUDA: the compiled kernels are tested (test_quant_triton_gpu)",
    ),
    # the kernels divide by zero on purpose (an all-zero block) and clamp the inf; numpy says so
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def tk():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py)")
    pytest.importorskip("triton")
    from graphsan.lab.quant import triton_kernels

    assert triton_kernels.available(), "triton imports but the kernels do not"
    return triton_kernels


VARIANTS = ["v1", "v2"]  # triton_kernels.VARIANTS (not imported here: Triton loads lazily)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(32, 32), (64, 160), (96, 64)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_kernel_matches_reference(tk, shape, fmt, variant):
    for seed in range(3):
        assert_mxfp8_matches(tk, mxfp8_inputs(shape, seed, "cpu"), fmt, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", [(32, 128), (48, 64)])
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_kernel_matches_reference(tk, shape, order, variant):
    assert_nvfp4_matches(tk, edge_inputs(shape, 3, "cpu"), order, 5, variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_kernel_edge_inputs(tk, order, variant):
    assert_nvfp4_edges_match(tk, order, variant, "cpu")

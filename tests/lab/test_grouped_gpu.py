"""GPU: the grouped expert GEMMs on CUDA (torch._grouped_mm, bf16 result) against the per-expert
loop in float64; stacked quantization (torch reference) byte-equal to the per-expert Triton path;
the MoE expert path runs with host syncs made errors."""

from __future__ import annotations

import pytest
import torch

from graphsan.lab.models import build_model, get_preset
from graphsan.lab.quant import apply_precision, get_recipe
from tests.lab.grouped_checks import (
    NO_SR,
    RECIPES,
    check_against_loop,
    check_stack_equals_groups,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp8", "nvfp4", "nvfp4-plain"])
def test_grouped_gemms_match_the_per_expert_loop_on_cuda(name):
    check_against_loop(RECIPES[name], "cuda")


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4-rht-2d", "fp8"])
@pytest.mark.parametrize("role", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_stacked_quantization_equals_per_expert_on_cuda(name, role, axis):
    check_stack_equals_groups(NO_SR[name], role, axis, "cuda")


@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "nvfp4"])
def test_expert_path_has_no_host_sync_on_cuda(recipe):
    """Routed experts + combine, forward and backward, with CUDA host syncs made errors."""
    model = build_model(get_preset("tiny"), device="cuda", seed=0)
    apply_precision(model, get_recipe(recipe))
    moe = next(la for la in model.layers if la.kind == "E").mixer
    x = torch.randn(2, 64, model.args.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        permuted, probs, token, counts = moe.preprocess(x, *moe.router(x))

    def run():
        inp = permuted.detach().requires_grad_(True)
        out = moe.experts_and_combine(inp, probs, token, counts, num_tokens=128)
        out.float().square().sum().backward()
        return inp

    run()  # warm-up: Triton compiles, the grouped GEMM probe runs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inp = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    total = int(counts.sum())
    assert torch.isfinite(inp.grad).all() and inp.grad[:total].abs().sum() > 0
    assert inp.grad[total:].eq(0).all()

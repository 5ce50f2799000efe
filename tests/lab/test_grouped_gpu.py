"""GPU: the grouped expert GEMMs on CUDA (torch._grouped_mm, bf16 result) against the per-expert
loop in float64; stacked quantization (grouped kernels) byte-equal to the per-expert Triton path
and to the torch reference; the MoE expert path runs with host syncs made errors."""

from __future__ import annotations

import pytest
import torch

from graphsan.lab.models import build_model, get_preset
from graphsan.lab.quant import apply_precision, get_recipe
from tests.lab.grouped_checks import (
    NO_SR,
    RECIPES,
    check_against_loop,
    check_nvfp4_grouped_kernels,
    check_stack_equals_groups,
)
from tests.lab.kernel_checks import launchers

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp8", "nvfp4", "nvfp4-plain"])
def test_grouped_gemms_match_the_per_expert_loop_on_cuda(name):
    check_against_loop(RECIPES[name], "cuda")


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4-rht-2d", "fp8"])
@pytest.mark.parametrize("role", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_stacked_quantization_equals_per_expert_on_cuda(name, role, axis):
    check_stack_equals_groups(NO_SR[name], role, axis, "cuda")


@pytest.mark.parametrize("order", ["current", "legacy"])
def test_grouped_nvfp4_kernels_match_the_reference_on_cuda(order, monkeypatch):
    """The grouped NVFP4 kernels (per-group amax on the device) byte-equal to the torch reference
    for every operand kind, SR included; and `nvfp4.quantize_grouped` runs them on CUDA."""
    pytest.importorskip("triton")
    from graphsan.lab.quant import nvfp4

    tk = launchers()

    assert check_nvfp4_grouped_kernels(tk, (64, 0, 32, 96), "cuda", order) == 8
    assert check_nvfp4_grouped_kernels(tk, (8, 0, 24, 40), "cuda", order) == 3
    calls = []
    orig = tk.nv.nvfp4_quantize_grouped
    monkeypatch.setattr(tk.nv, "nvfp4_quantize_grouped", lambda *a: calls.append(1) or orig(*a))
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    nvfp4.quantize_grouped(x, torch.zeros(64, dtype=torch.int64, device="cuda"), 1)
    assert calls


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

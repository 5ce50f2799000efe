"""GPU: QuantLinear under CUDA-graph capture with the skip flag (both GEMM paths), the Triton path
against the torch reference path, the compiled GEMM operand preparation bit for bit, and the
fused packed-operand GEMM against float64."""

from __future__ import annotations

import os

import pytest
import torch

from graphsan.lab.quant import QuantLinear, SkipFlag, get_recipe
from tests.lab.kernel_checks import (
    FP8_PATHS,
    assert_gemm_operand_bits,
    assert_gemm_operands_match,
    assert_quantized_mm_matches,
    exhaustive_operands,
    launchers,
    random_byte_operands,
    use_fp8_path,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tk():
    pytest.importorskip("triton")
    return launchers()


@pytest.mark.parametrize("flag", ["tensor", "SkipFlag"])
@pytest.mark.parametrize("fused", [False, True], ids=["prepared-operands", "fused-gemm"])
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8"])
def test_quantlinear_graph_capture_with_skip_flag(tk, name, fused, flag, monkeypatch):
    """Capture fwd+bwd; the skip flag (device tensor) decides on replay whether the workspace is
    re-quantized, with no re-allocation. Both GEMM paths (operand preparation + cuBLAS, and the
    fused packed-operand GEMM); a `SkipFlag`, whose host value eager forwards read, records the
    same masked copy when captured."""
    monkeypatch.setattr(tk.gemm, "FUSED_GEMM", fused)
    torch.manual_seed(0)
    lin = QuantLinear(256, 128, device="cuda")
    lin.set_recipe(get_recipe(name))
    if flag == "SkipFlag":
        lin.skip_weight_update = SkipFlag("cuda")
        set_flag = lin.skip_weight_update.set
    else:
        lin.skip_weight_update = torch.zeros((), dtype=torch.bool, device="cuda")
        set_flag = lin.skip_weight_update.fill_
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            lin(x).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    ws = lin.workspace
    ptrs = [t.data_ptr() for t in ws.buffers()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lin(x)
        y.backward(dy)
    assert lin.workspace is ws and [t.data_ptr() for t in ws.buffers()] == ptrs
    before = [t.clone() for t in ws.buffers()]
    with torch.no_grad():
        lin.weight.mul_(-1.5)
    set_flag(1)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(ws.buffers(), before, strict=True))
    set_flag(0)
    graph.replay()
    torch.cuda.synchronize()
    q = lin.quantizers["weight"]
    fresh = q.quantize(lin.weight.detach(), -1).buffers()
    assert all(torch.equal(a, b) for a, b in zip(ws.buffers()[: len(fresh)], fresh, strict=True))
    eager_y = lin(x)
    torch.testing.assert_close(y, eager_y.detach(), rtol=0.05, atol=0.05)


def test_quantlinear_triton_equals_reference_path(tk, monkeypatch):
    torch.manual_seed(1)
    for name, options in (("mxfp8", {}), ("nvfp4", {"sr": False}), ("nvfp4", {})):
        lin = QuantLinear(256, 128, device="cuda")
        lin.set_recipe(get_recipe(name, **options))
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.manual_seed(9)  # SR: both paths draw the same seeds
        y1 = lin(x)
        y1.backward(torch.ones_like(y1))
        g1, m1 = x.grad.clone(), lin.weight.main_grad.clone()
        x.grad = None
        lin.weight.main_grad.zero_()
        lin.clear_workspace()
        monkeypatch.setenv("GRAPHSAN_NO_TRITON", "1")
        torch.cuda.manual_seed(9)
        y2 = lin(x)
        y2.backward(torch.ones_like(y2))
        monkeypatch.delenv("GRAPHSAN_NO_TRITON")
        assert (
            torch.equal(y1, y2)
            and torch.equal(g1, x.grad)
            and torch.equal(m1, lin.weight.main_grad)
        )


@pytest.mark.parametrize("path", FP8_PATHS)
def test_gemm_operand_preparation_matches_reference(tk, path, monkeypatch):
    use_fp8_path(tk, path, monkeypatch)
    assert_gemm_operands_match(tk, "cuda", (256, 640))


@pytest.mark.parametrize("path", FP8_PATHS)
def test_gemm_operand_bits_on_random_and_every_byte(tk, path, monkeypatch):
    """The compiled dequantization kernels (contiguous and strided; MXFP8 with the hardware FP8
    and bf16 conversions and with bit fields) against the torch dequantization on CUDA, bit for
    bit, NaN included: random data and scale bytes at shapes that fill the launch tiles exactly
    (no masks) and that do not, and every element byte against every scale byte."""
    use_fp8_path(tk, path, monkeypatch)
    for shape in [(256, 640), (1024, 4096), (96, 160)]:
        seed = int.from_bytes(os.urandom(4), "little")
        ops = random_byte_operands("cuda", seed, shape)
        assert_gemm_operand_bits(tk, ops, f"{shape} seed {seed}")
    assert_gemm_operand_bits(tk, exhaustive_operands("cuda"))


GEMM_RECIPES = {
    "mxfp8": get_recipe("mxfp8"),
    "mxfp8-hybrid": get_recipe("mxfp8", fp8_format="hybrid"),
    "nvfp4": get_recipe("nvfp4"),
    "nvfp4-plain": get_recipe("nvfp4", rht=False, sr=False, weight_2d=False, order="legacy"),
}


@pytest.mark.parametrize("shape", [(512, 384, 640), (4096, 96, 160), (256, 2048, 1024)])
@pytest.mark.parametrize("name", list(GEMM_RECIPES))
def test_packed_gemm_matches_dequantize_then_gemm(tk, name, shape):
    """The compiled fused GEMM (tensor cores) within the float32 accumulation bound of the
    float64 product, every GEMM orientation, partial tiles."""
    assert_quantized_mm_matches(tk, GEMM_RECIPES[name], *shape, "cuda")


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4"])
def test_quantlinear_fused_gemm_close_to_prepared_operands(tk, name, monkeypatch):
    """QuantLinear fwd+bwd with the fused GEMM agrees with the prepared-operand path (same
    operands, another float32 accumulation order) to 2^-16 of each output's largest value."""
    torch.manual_seed(2)
    lin = QuantLinear(512, 256, device="cuda")
    lin.set_recipe(get_recipe(name, **({"sr": False} if name == "nvfp4" else {})))
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(tk.gemm, "FUSED_GEMM", fused)
        x.grad = None
        lin.weight.main_grad.zero_()
        y = lin(x)
        y.backward(torch.ones_like(y))
        results.append((y.float(), x.grad.float(), lin.weight.main_grad.clone()))
    for a, b in zip(*results, strict=True):
        assert ((a - b).abs() <= b.abs().max() * 2.0**-16 + 2.0**-8 * b.abs()).all()

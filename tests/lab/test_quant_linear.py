"""QuantLinear: GEMM operands and numerics against float64, main_grad, and the workspace state rules."""

from __future__ import annotations

import weakref

import pytest
import torch

from graphsan.lab.quant import (
    NVFP4Options,
    QuantLinear,
    Recipe,
    RecipeKind,
    SkipFlag,
    WeightWorkspace,
    get_recipe,
    mxfp8,
    nvfp4,
)
from graphsan.lab.quant.gemm import gemm_alpha, gemm_operand
from tests.lab.quant_oracles import ref_mm, skewed

RECIPES = {
    "bf16": get_recipe("bf16"),
    "fp8": get_recipe("fp8"),
    "mxfp8": get_recipe("mxfp8"),
    "mxfp8-hybrid": get_recipe("mxfp8", fp8_format="hybrid"),
    "nvfp4": get_recipe("nvfp4"),
    "nvfp4-plain": get_recipe("nvfp4", rht=False, sr=False, weight_2d=False, order="legacy"),
}


def q_operands(q):
    return gemm_operand(q), q


def check_close(got, ref, mag, out_bf16):
    # fp32 accumulation: |err| <= ~K * 2^-24 |a||b|; bf16 outputs add one rounding (2^-8 rel).
    tol = mag * 1e-5 + (ref.abs() * 2.0**-8 if out_bf16 else 0) + 1e-30
    assert ((got.double() - ref).abs() <= tol).all()
    return tol


def run_step(recipe: Recipe, seed=0, m=64, k=96, n=128, gen_seed=5):
    g = torch.Generator().manual_seed(seed)
    lin = QuantLinear(k, n)
    with torch.no_grad():
        lin.weight.copy_(skewed(n, k, g))
    lin.set_recipe(recipe)
    lin.sr_generator = torch.Generator().manual_seed(gen_seed)
    x = skewed(m, k, g).requires_grad_(True)
    dy = skewed(m, n, g)
    y = lin(x)
    state = lin.sr_generator.get_state()
    y.backward(dy)
    return lin, x, dy, y, state


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "bf16"])
def test_gemms_use_the_table_operands(name):
    """fprop: X row, W row; dgrad: dY row, W col; wgrad: dY col, X col; vs float64.

    Where the two directions of an operand differ by more than the tolerance (NVFP4 with 1-D
    weight blocks; the RHT'd wgrad copies), the swapped operand is shown to fail. MXFP8 and FP8
    directions agree to within rounding for most inputs (a block scale only shifts the exponent),
    so for them only the numerics are checked."""
    recipe = RECIPES[name]
    lin, x, dy, y, state = run_step(recipe)
    qw, qx, qg = (recipe.quantizers()[r] for r in ("weight", "input", "grad_output"))
    w = lin.weight.detach()
    gen = torch.Generator()
    gen.set_state(state)
    w_row, w_col = qw.quantize(w, -1), qw.quantize(w, 0)
    x_row, x_col = qx.quantize(x.detach(), -1), qx.quantize(x.detach(), 0)
    dy_row = qg.quantize(dy, -1, generator=gen)
    dy_col = qg.quantize(dy, 0, generator=gen)

    # fprop
    ref, mag = ref_mm(gemm_operand(x_row), gemm_operand(w_row).t(), gemm_alpha(x_row, w_row))
    tol = check_close(y, ref, mag, True)
    swapped, _ = ref_mm(gemm_operand(x_row), gemm_operand(w_col).t(), gemm_alpha(x_row, w_col))
    if name == "nvfp4-plain":  # 2-D weight blocks make W's two directions equal
        assert ((swapped - ref).abs() > tol).any()
    # dgrad
    ref, mag = ref_mm(gemm_operand(dy_row), gemm_operand(w_col), gemm_alpha(dy_row, w_col))
    tol = check_close(x.grad, ref, mag, True)
    swapped, _ = ref_mm(gemm_operand(dy_row), gemm_operand(w_row), gemm_alpha(dy_row, w_row))
    if name == "nvfp4-plain":
        assert ((swapped - ref).abs() > tol).any()
    # wgrad
    ref, mag = ref_mm(gemm_operand(dy_col).t(), gemm_operand(x_col), gemm_alpha(dy_col, x_col))
    tol = check_close(lin.weight.main_grad, ref, mag, False)
    swapped, _ = ref_mm(gemm_operand(dy_col).t(), gemm_operand(x_row), gemm_alpha(dy_col, x_row))
    if name.startswith("nvfp4"):
        assert ((swapped - ref).abs() > tol).any()
    assert lin.weight.grad is None


def test_bf16_matches_float64_and_is_close_to_quantized():
    lin, x, dy, y, _ = run_step(RECIPES["bf16"])
    w = lin.weight.detach()
    ref, mag = ref_mm(x.detach(), w.t())
    check_close(y, ref, mag, True)
    ref, mag = ref_mm(dy, w)
    check_close(x.grad, ref, mag, True)
    ref, mag = ref_mm(dy.t(), x.detach())
    check_close(lin.weight.main_grad, ref, mag, False)
    assert lin.workspace is None  # bf16 reads the weight directly
    # quantized recipes approximate the same GEMMs
    for name in ("mxfp8", "nvfp4"):
        lq, xq, _, yq, _ = run_step(RECIPES[name])
        rel = (yq.double() - y.double()).norm() / y.double().norm()
        assert rel < {"mxfp8": 0.08, "nvfp4": 0.4}[name]
        rel = (lq.weight.main_grad - lin.weight.main_grad).norm() / lin.weight.main_grad.norm()
        assert rel < {"mxfp8": 0.08, "nvfp4": 0.4}[name]


@pytest.mark.parametrize("name", ["bf16", "mxfp8", "nvfp4"])
def test_main_grad_accumulates_in_place(name):
    g = torch.Generator().manual_seed(1)
    lin = QuantLinear(64, 32, bias=True)
    lin.set_recipe(RECIPES[name])
    main = lin.weight.main_grad
    ptr = main.data_ptr()
    x = skewed(2 * 32, 64, g).reshape(2, 32, 64)
    lin(x).float().sum().backward()
    first = main.clone()
    assert first.abs().sum() > 0
    lin(x).float().sum().backward()
    assert lin.weight.main_grad is main and main.data_ptr() == ptr
    assert lin.weight.grad is None
    if name == "nvfp4":  # SR makes the two steps differ slightly
        assert torch.allclose(main, 2 * first, rtol=0.1, atol=1e-2 * first.abs().max().item())
    else:
        assert torch.equal(main, 2 * first)
    assert lin.bias.grad is not None and torch.allclose(
        lin.bias.grad.float(), torch.full((32,), 128.0), rtol=1e-2
    )


def test_dgrad_reads_the_workspace_columnwise_buffers():
    """Overwrite the workspace's columnwise bytes between forward and backward: dgrad follows."""
    g = torch.Generator().manual_seed(2)
    lin = QuantLinear(64, 64)
    lin.set_recipe(RECIPES["mxfp8"])
    x = skewed(32, 64, g).requires_grad_(True)
    dy = skewed(32, 64, g)
    lin(x).backward(dy)
    normal = x.grad.clone()
    x.grad = None
    y = lin(x)
    lin.workspace.columnwise.data.zero_()
    y.backward(dy)
    assert normal.abs().sum() > 0 and x.grad.eq(0).all()


def test_workspace_allocation_and_in_place_requantization():
    g = torch.Generator().manual_seed(3)
    lin = QuantLinear(64, 64)
    lin.set_recipe(RECIPES["nvfp4"])
    x = skewed(32, 64, g)
    with torch.no_grad():
        lin.weight.copy_(skewed(64, 64, g))
    lin(x)
    ws = lin.workspace
    assert isinstance(ws, WeightWorkspace) and ws.kind == "nvfp4"
    assert ws.rowwise is not None and ws.columnwise is not None  # grad enabled
    ptrs = [t.data_ptr() for t in ws.buffers()]
    qw = lin.quantizers["weight"]

    def bytes_equal(w):
        return all(
            torch.equal(a, b)
            for a, b in zip(
                ws.buffers(),
                qw.quantize(w, -1).buffers() + qw.quantize(w, 0).buffers(),
                strict=True,
            )
        )

    assert bytes_equal(lin.weight.detach())
    old = lin.weight.detach().clone()
    with torch.no_grad():
        lin.weight.copy_(skewed(64, 64, g))
    lin.skip_weight_update = torch.ones((), dtype=torch.bool)
    lin(x)
    assert lin.workspace is ws and bytes_equal(old) and not bytes_equal(lin.weight.detach())
    lin.skip_weight_update.fill_(False)
    lin(x)
    assert lin.workspace is ws and bytes_equal(lin.weight.detach())
    assert [t.data_ptr() for t in ws.buffers()] == ptrs  # never re-allocated
    lin.clear_workspace()
    assert lin.workspace is None


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_a_skip_flag_the_host_set_skips_the_quantization(name, monkeypatch):
    """With a SkipFlag an eager forward reads the host's value: at 1 the weight is not quantized
    at all (the workspace keeps its bytes), at 0 it is quantized into the same buffers; the
    device tensor always holds the same value."""
    g = torch.Generator().manual_seed(8)
    lin = QuantLinear(64, 64)
    lin.set_recipe(RECIPES[name])
    x = skewed(32, 64, g)
    flag = SkipFlag()
    lin.skip_weight_update = flag
    lin(x)
    ws = lin.workspace
    before = [t.clone() for t in ws.buffers()]
    qw = lin.quantizers["weight"]
    calls = []
    real = type(qw).quantize_both

    def counted(self, w, *args, **kwargs):
        calls.append(self.role)
        return real(self, w, *args, **kwargs)

    monkeypatch.setattr(type(qw), "quantize_both", counted)
    with torch.no_grad():
        lin.weight.copy_(skewed(64, 64, g))
    flag.set(1)
    assert flag.tensor.item() == 1
    lin(x)
    assert "weight" not in calls and lin.workspace is ws
    assert all(torch.equal(a, b) for a, b in zip(ws.buffers(), before, strict=True))
    flag.set(0)
    assert flag.tensor.item() == 0
    lin(x)
    fresh = (
        qw.quantize(lin.weight.detach(), -1).buffers()
        + qw.quantize(lin.weight.detach(), 0).buffers()
    )
    assert calls.count("weight") == 1 and lin.workspace is ws
    assert all(torch.equal(a, b) for a, b in zip(ws.buffers(), fresh, strict=True))
    with pytest.raises(ValueError, match=r"SkipFlag.set\(2\): expected 0 or 1"):
        flag.set(2)


def test_fixed_policy_eval_never_touches_the_workspace():
    g = torch.Generator().manual_seed(4)
    lin = QuantLinear(64, 64)
    lin.set_recipe(RECIPES["mxfp8"])
    x = skewed(32, 64, g)
    with torch.no_grad():
        y_eval = lin(x)
    assert lin.workspace is None  # eval before any training forward: nothing cached
    lin(x)
    ws = lin.workspace
    snapshot = [t.clone() for t in ws.buffers()]
    lin.stored_recipe = get_recipe("nvfp4")  # what a graph wrapper does on replay
    with torch.no_grad():
        lin.weight.mul_(2)
        y2 = lin(x)
    assert lin.workspace is ws and ws.columnwise is not None
    assert all(torch.equal(a, b) for a, b in zip(ws.buffers(), snapshot, strict=True))
    assert torch.allclose(y2.float(), 2 * y_eval.float(), rtol=0.02, atol=1e-2)  # fresh weight used


def test_te218_policy_clears_on_recipe_class_change_and_rebuilds_rowwise_only():
    g = torch.Generator().manual_seed(5)
    lin = QuantLinear(64, 64)
    lin.state_policy = "te218"
    lin.set_recipe(RECIPES["mxfp8"])
    x = skewed(32, 64, g)
    lin(x)
    w1 = lin.workspace
    col_ref = weakref.ref(w1.columnwise.data)
    assert lin.stored_recipe == RECIPES["mxfp8"]
    # same class again: kept
    lin(x)
    assert lin.workspace is w1
    # the graph wrapper overwrites the stored recipe with the ambient NVFP4 recipe
    lin.stored_recipe = get_recipe("nvfp4")
    del w1
    with torch.no_grad():
        lin(x)
    w2 = lin.workspace
    assert w2 is not None and w2.columnwise is None  # rebuilt rowwise-only by the eval forward
    assert col_ref() is None  # the old columnwise buffer was freed
    assert lin.stored_recipe == RECIPES["mxfp8"]
    lin(x)  # a training forward adds the columnwise part to the same workspace
    assert lin.workspace is w2 and w2.columnwise is not None


def test_te218_without_mismatch_eval_reuses_the_workspace():
    g = torch.Generator().manual_seed(6)
    lin = QuantLinear(64, 64)
    lin.state_policy = "te218"
    lin.set_recipe(RECIPES["mxfp8"])
    x = skewed(32, 64, g)
    with torch.no_grad():
        lin(x)
    ws = lin.workspace
    assert ws is not None and ws.columnwise is None  # te218 caches even in eval
    lin(x)
    assert lin.workspace is ws and ws.columnwise is not None


def test_set_recipe_drops_a_workspace_of_another_class():
    lin = QuantLinear(64, 64)
    lin.set_recipe(RECIPES["mxfp8"])
    lin(torch.randn(32, 64, dtype=torch.bfloat16))
    ws = lin.workspace
    lin.set_recipe(get_recipe("mxfp8", fp8_format="hybrid"))
    assert lin.workspace is ws
    lin.recipe = RECIPES["nvfp4"]
    assert lin.workspace is None and lin.recipe.kind == "nvfp4"


def test_errors():
    lin = QuantLinear(64, 64)
    lin.set_recipe(RECIPES["mxfp8"])
    with pytest.raises(ValueError, match="multiple of 32"):
        lin(torch.randn(24, 64, dtype=torch.bfloat16))
    with torch.no_grad():
        assert lin(torch.randn(24, 64, dtype=torch.bfloat16)).shape == (24, 64)  # no wgrad: fine
    with pytest.raises(ValueError, match="in_features"):
        lin(torch.randn(32, 48, dtype=torch.bfloat16))
    lin.state_policy = "te217"
    with pytest.raises(ValueError, match="state_policy"):
        lin(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="Recipe"):
        lin.set_recipe("nvfp4")


def test_recipes_and_errors():
    r = get_recipe("nvfp4", order="legacy", rht=True, sr=True, weight_2d=True)
    assert r.kind is RecipeKind.NVFP4 and r.nvfp4.order == "legacy"
    assert get_recipe("nvfp4") == Recipe("nvfp4")
    with pytest.raises(AttributeError):
        r.kind = "bf16"
    with pytest.raises(ValueError, match="unknown recipe 'fp4'"):
        get_recipe("fp4")
    with pytest.raises(ValueError, match="option 'rht'"):
        get_recipe("mxfp8", rht=True)
    with pytest.raises(ValueError, match="order"):
        get_recipe("nvfp4", order="newest")
    assert get_recipe("nvfp4").describe() == "nvfp4(current, rht, sr, 2d-weights)"


def test_nvfp4_weight_workspace_uses_2d_blocks_and_no_rht():
    lin = QuantLinear(64, 48)
    lin.set_recipe(RECIPES["nvfp4"])
    lin(torch.randn(32, 64, dtype=torch.bfloat16))
    ws = lin.workspace
    assert ws.rowwise.block_2d and not ws.rowwise.rht and not ws.columnwise.rht
    row = nvfp4.quantize(lin.weight.detach(), -1, NVFP4Options(block_2d=True))
    assert torch.equal(ws.rowwise.data, row.data) and torch.equal(ws.rowwise.scale, row.scale)
    assert torch.equal(ws.rowwise.scale[::16], ws.columnwise.scale[::16].t())


def test_mxfp8_hybrid_uses_e5m2_gradients():
    q = get_recipe("mxfp8", fp8_format="hybrid").quantizers()
    x = torch.randn(32, 32)
    assert q["grad_output"].quantize(x, -1).fmt == "e5m2"
    assert q["input"].quantize(x, -1).fmt == "e4m3" and q["weight"].quantize(x, 0).fmt == "e4m3"
    assert isinstance(q["input"].quantize(x, 0), mxfp8.MXFP8Tensor)

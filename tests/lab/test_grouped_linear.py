"""GroupedQuantLinear: stacked quantization byte-equal to per-expert quantization, the grouped GEMMs
against the per-expert loop in float64 on the same dequantized operands, padding rows, the
weight workspace rules it shares with QuantLinear, and bad input."""

from __future__ import annotations

import zlib

import pytest
import torch

from graphsan.lab.quant import GroupedQuantLinear, RowGroups, WeightWorkspace, get_recipe
from graphsan.lab.quant import fp8 as fp8_fmt
from graphsan.lab.quant import grouped as grouped_mod
from graphsan.lab.quant import mxfp8 as mxfp8_fmt
from graphsan.lab.quant import nvfp4 as nvfp4_fmt
from graphsan.lab.quant.linear import gemm_alpha, gemm_operand
from tests.lab.test_quant_linear import ref_mm, skewed

RECIPES = {
    "bf16": get_recipe("bf16"),
    "fp8": get_recipe("fp8"),
    "mxfp8": get_recipe("mxfp8"),
    "mxfp8-hybrid": get_recipe("mxfp8", fp8_format="hybrid"),
    "nvfp4": get_recipe("nvfp4"),  # RHT, SR, 2-D weights
    "nvfp4-plain": get_recipe("nvfp4", rht=False, sr=False, weight_2d=False, order="legacy"),
}
NO_SR = {
    "fp8": RECIPES["fp8"],
    "mxfp8": RECIPES["mxfp8"],
    "mxfp8-hybrid": RECIPES["mxfp8-hybrid"],
    "nvfp4-rht-2d": get_recipe("nvfp4", sr=False),
    "nvfp4-plain": RECIPES["nvfp4-plain"],
}
COUNTS = (64, 0, 32, 96)  # rows per expert (multiples of 32, one expert empty)
PAD = 32  # rows past the last expert (the permuted buffer's unused capacity)


def grouped_rows(counts, cols, g, pad=PAD, device="cpu"):
    """Skewed rows per group (each group its own magnitude), then `pad` rows of junk."""
    parts = [skewed(c, cols, g).float() * 4.0 ** (i - 1) for i, c in enumerate(counts)]
    parts.append(skewed(pad, cols, g).float() * 1e3)  # padding: must not leak anywhere
    return torch.cat(parts).to(device, torch.bfloat16)


def offsets_of(counts, device="cpu"):
    return torch.tensor(counts).cumsum(0).to(device, torch.int32)


def row_groups(counts, rows, device="cpu"):
    rows = torch.arange(rows, dtype=torch.int32, device=device)
    return RowGroups(torch.searchsorted(offsets_of(counts, device), rows, right=True), len(counts))


def spans(counts):
    ends = offsets_of(counts).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


def group_part(q, s, e, g):
    """Rows s:e of a grouped quantization as the plain QTensor of that group alone."""
    if isinstance(q, mxfp8_fmt.MXFP8Tensor):
        if q.axis == 0:
            return mxfp8_fmt.MXFP8Tensor(q.data[s:e], q.scale[s // 32 : e // 32], 0, q.fmt)
        return mxfp8_fmt.MXFP8Tensor(q.data[s:e], q.scale[s:e], -1, q.fmt)
    if isinstance(q, nvfp4_fmt.NVFP4Tensor):
        if q.axis == 0:
            data, scale = q.data[:, s // 2 : e // 2], q.scale[:, s // 16 : e // 16]
        else:
            data, scale = q.data[s:e], q.scale[s:e]
        return nvfp4_fmt.NVFP4Tensor(data, scale, q.amax[g], q.axis, q.block_2d, q.rht)
    if q.axis == 0:
        return fp8_fmt.FP8Tensor(q.data[:, s:e], q.scale_inv[g], q.amax[g], 0)
    return fp8_fmt.FP8Tensor(q.data[s:e], q.scale_inv[g], q.amax[g], -1)


def check_close(got, ref, mag, bf16_roundings):
    """float32 accumulation (~K * 2^-24 |a||b|) plus 2^-8 |ref| per rounding to bf16."""
    tol = mag * 1e-5 + ref.abs() * (bf16_roundings * 2.0**-8) + 1e-30
    assert ((got.double() - ref).abs() <= tol).all()


def assert_same_bytes(a, b):
    for x, y in zip(a.buffers(), b.buffers(), strict=True):
        assert x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("name", list(NO_SR))
@pytest.mark.parametrize("role", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_quantizing_the_whole_stack_equals_quantizing_each_group(name, role, axis):
    """One quantization of the stacked rows gives the bytes of one quantization per group: blocks
    never cross groups (counts are multiples of 32) and per-tensor factors are per group."""
    check_stack_equals_groups(NO_SR[name], role, axis, "cpu")


def check_stack_equals_groups(recipe, role, axis, device):
    g = torch.Generator().manual_seed(zlib.crc32(f"{recipe} {role} {axis}".encode()))
    q = recipe.quantizers()[role]
    x = grouped_rows(COUNTS, 64, g, device=device)
    groups = row_groups(COUNTS, x.shape[0], device)
    whole = q.quantize(x, axis, groups=groups)
    for gi, (s, e) in enumerate(spans(COUNTS)):
        if s == e:
            if hasattr(whole, "amax"):
                assert whole.amax.shape == (len(COUNTS),) and whole.amax[gi] == 0
            continue
        assert_same_bytes(group_part(whole, s, e, gi), q.quantize(x[s:e], axis))


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "nvfp4-rht-2d"])
def test_stacked_weight_workspace_equals_each_expert_quantized_alone(name):
    g = torch.Generator().manual_seed(7)
    lin = GroupedQuantLinear(3, 64, 32)
    with torch.no_grad():
        lin.weight.copy_(torch.stack([skewed(32, 64, g) * 10.0**i for i in range(3)]))
    lin.set_recipe(NO_SR[name])
    x = grouped_rows((32, 32, 32), 64, g, pad=0)
    lin(x, offsets_of((32, 32, 32)))
    ws = lin.workspace
    assert isinstance(ws, WeightWorkspace) and ws.kind == NO_SR[name].kind
    qw = lin.quantizers["weight"]
    for e in range(3):
        w = lin.weight.detach()[e]
        assert_same_bytes(group_part(ws.rowwise, 32 * e, 32 * (e + 1), e), qw.quantize(w, -1))
        assert_same_bytes(group_part(ws.columnwise, 32 * e, 32 * (e + 1), e), qw.quantize(w, 0))


def run_grouped(recipe, counts=COUNTS, k=64, n=96, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lin = GroupedQuantLinear(len(counts), k, n, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.stack([skewed(n, k, g) for _ in counts]))
    lin.set_recipe(recipe)
    lin.sr_generator = torch.Generator(device=device).manual_seed(seed + 11)
    x = grouped_rows(counts, k, g, device=device).requires_grad_(True)
    dy = grouped_rows(counts, n, g, device=device)
    y = lin(x, offsets_of(counts, device))
    state = lin.sr_generator.get_state()
    y.backward(dy)
    return lin, x, dy, y, state


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_gemms_match_the_per_expert_loop_in_float64(name):
    """fprop, dgrad and wgrad of every expert against float64 products of that expert's
    dequantized operands (the table's directions); padding rows give exact zeros."""
    check_against_loop(RECIPES[name], "cpu")


def check_against_loop(recipe, device):
    """Every expert's three GEMMs against float64; on CUDA the grouped kernel's result is
    rounded to bf16 once more (grouped.py), which the tolerance allows for."""
    lin, x, dy, y, state = run_grouped(recipe, device=device)
    total = sum(COUNTS)
    assert y[total:].eq(0).all() and x.grad[total:].eq(0).all()
    assert lin.weight.grad is None
    main = lin.weight.main_grad
    groups = row_groups(COUNTS, x.shape[0], device)
    if recipe.quantized:
        qw, qx, qg = (recipe.quantizers()[r] for r in ("weight", "input", "grad_output"))
        gen = torch.Generator(device=device)
        gen.set_state(state)  # replay the SR bits backward drew: the same dY operands
        dy_row = qg.quantize(dy, -1, generator=gen, groups=groups)
        dy_col = qg.quantize(dy, 0, generator=gen, groups=groups)
    for e, (s, t) in enumerate(spans(COUNTS)):
        w = lin.weight.detach()[e]
        if s == t:
            assert main[e].eq(0).all()
            continue
        xs, dys = x.detach()[s:t], dy[s:t]
        if not recipe.quantized:
            refs = (ref_mm(xs, w.t()), ref_mm(dys, w), ref_mm(dys.t(), xs))
        else:
            # the old loop's operands: each expert's rows and weight quantized on their own
            x_row, x_col = qx.quantize(xs, -1), qx.quantize(xs, 0)
            w_row, w_col = qw.quantize(w, -1), qw.quantize(w, 0)
            d_row, d_col = group_part(dy_row, s, t, e), group_part(dy_col, s, t, e)
            refs = (
                ref_mm(gemm_operand(x_row), gemm_operand(w_row).t(), gemm_alpha(x_row, w_row)),
                ref_mm(gemm_operand(d_row), gemm_operand(w_col), gemm_alpha(d_row, w_col)),
                ref_mm(gemm_operand(d_col).t(), gemm_operand(x_col), gemm_alpha(d_col, x_col)),
            )
        (ry, my), (rdx, mdx), (rdw, mdw) = refs
        # bf16 roundings of a result: the output's; on CUDA also the grouped kernel's (before
        # the alpha of per-tensor-scaled recipes, and before the main_grad accumulation)
        cuda = device != "cpu"
        out_rounds = 1 + (cuda and recipe.kind in ("fp8", "nvfp4"))
        check_close(y[s:t], ry, my, out_rounds)
        check_close(x.grad[s:t], rdx, mdx, out_rounds)
        check_close(main[e], rdw, mdw, int(cuda))
        assert main[e].abs().sum() > 0


@pytest.mark.parametrize("name", ["bf16", "mxfp8", "nvfp4"])
def test_padding_rows_change_nothing(name):
    """Junk in the rows past the last group changes no valid output, input grad or weight grad."""
    recipe = RECIPES[name]
    outs = []
    for junk in (1.0, -1e4):
        lin, x, dy, y, _ = run_grouped(recipe, seed=3)
        with torch.no_grad():
            lin.weight.main_grad.zero_()
        x = x.detach().clone()
        x[sum(COUNTS) :] *= junk
        x.requires_grad_(True)
        lin.sr_generator.manual_seed(5)
        y = lin(x, offsets_of(COUNTS))
        y.backward(dy * torch.where(torch.arange(len(dy)) < sum(COUNTS), 1.0, junk)[:, None])
        outs.append((y.detach(), x.grad, lin.weight.main_grad.clone()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_main_grad_accumulates_in_place_and_skip_flag_keeps_the_workspace():
    g = torch.Generator().manual_seed(4)
    lin = GroupedQuantLinear(2, 64, 32)
    lin.set_recipe(RECIPES["mxfp8"])
    counts = (32, 64)
    x = grouped_rows(counts, 64, g, pad=32)
    main = lin.weight.main_grad
    lin(x, offsets_of(counts)).float().sum().backward()
    first = main.clone()
    ws = lin.workspace
    ptrs = [t.data_ptr() for t in ws.buffers()]
    snapshot = [t.clone() for t in ws.buffers()]
    with torch.no_grad():
        lin.weight.mul_(3)  # not a power of two: the element bytes change
    lin.skip_weight_update = torch.ones((), dtype=torch.bool)
    lin(x, offsets_of(counts)).float().sum().backward()
    assert lin.weight.main_grad is main and torch.equal(main, 2 * first)  # dW needs no weight
    assert lin.workspace is ws and [t.data_ptr() for t in ws.buffers()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(ws.buffers(), snapshot, strict=True))
    lin.skip_weight_update.fill_(False)
    lin(x, offsets_of(counts))
    assert lin.workspace is ws and not torch.equal(ws.rowwise.data, snapshot[0])
    assert [t.data_ptr() for t in ws.buffers()] == ptrs  # re-quantized in place


def test_state_policies_apply_as_for_quantlinear():
    g = torch.Generator().manual_seed(5)
    counts = (32, 32)
    x = grouped_rows(counts, 64, g, pad=0)
    offs = offsets_of(counts)
    fixed = GroupedQuantLinear(2, 64, 32)
    fixed.set_recipe(RECIPES["mxfp8"])
    with torch.no_grad():
        fixed(x, offs)
    assert fixed.workspace is None  # "fixed": eval never touches the workspace
    te = GroupedQuantLinear(2, 64, 32)
    te.state_policy = "te218"
    te.set_recipe(RECIPES["mxfp8"])
    te(x, offs)
    w1 = te.workspace
    assert w1.columnwise is not None and te.stored_recipe == RECIPES["mxfp8"]
    te.stored_recipe = get_recipe("nvfp4")  # what the te218 graph wrapper writes on replay
    with torch.no_grad():
        te(x, offs)
    assert te.workspace is not w1 and te.workspace.columnwise is None  # cleared, rebuilt rowwise


def test_grouped_mm_fallback_loop_matches(monkeypatch):
    g = torch.Generator().manual_seed(6)
    counts = (32, 0, 64)
    a = grouped_rows(counts, 64, g)
    b = torch.randn(3, 64, 48, generator=g).to(torch.bfloat16)
    offs = offsets_of(counts)
    fast = grouped_mm_fp32_pair(a, b, offs)
    monkeypatch.setitem(grouped_mod._GROUPED_MM, "cpu", False)
    slow = grouped_mm_fp32_pair(a, b, offs)
    for f, s in zip(fast, slow, strict=True):
        torch.testing.assert_close(f, s, rtol=1e-6, atol=1e-6)


def grouped_mm_fp32_pair(a, b, offs):
    total = int(offs[-1])
    y = grouped_mod.grouped_mm(a, b, offs)[:total]
    dw = grouped_mod.grouped_mm(a.t(), a, offs)
    nonempty = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
    return y, dw[nonempty]


def test_errors():
    lin = GroupedQuantLinear(2, 64, 32)
    x = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="offsets is torch.int64"):
        lin(x, torch.tensor([32, 64]))
    with pytest.raises(ValueError, match=r"expected int32 \(2,\)"):
        lin(x, torch.tensor([64], dtype=torch.int32))
    with pytest.raises(ValueError, match="in_features=64"):
        lin(torch.randn(64, 48, dtype=torch.bfloat16), offsets_of((32, 32)))
    with pytest.raises(ValueError, match="num_groups=0"):
        GroupedQuantLinear(0, 64, 32)
    with pytest.raises(ValueError, match="out_features=48; expected a multiple of 32"):
        GroupedQuantLinear(2, 64, 48).set_recipe(RECIPES["mxfp8"])
    with pytest.raises(ValueError, match="row_multiple=8; expected a multiple of 16"):
        GroupedQuantLinear(2, 64, 32, row_multiple=8).set_recipe(RECIPES["nvfp4"])
    lin.set_recipe(RECIPES["mxfp8"])
    with pytest.raises(ValueError, match="48 rows.*multiple of 32"):
        lin(torch.randn(48, 64, dtype=torch.bfloat16), offsets_of((16, 32)))
    lin.state_policy = "te217"
    with pytest.raises(ValueError, match="state_policy"):
        lin(x, offsets_of((32, 32)))
    with pytest.raises(TypeError, match="Recipe"):
        lin.set_recipe("nvfp4")
    with pytest.raises(ValueError, match="groups is torch.int32"):
        nvfp4_fmt.quantize_grouped(x, torch.zeros(64, dtype=torch.int32), 2)

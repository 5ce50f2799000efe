"""GroupedQuantLinear: stacked quantization byte-equal to per-expert quantization, the grouped GEMMs
against the per-expert loop in float64 on the same dequantized operands, padding rows, the
weight workspace rules it shares with QuantLinear, and bad input."""

from __future__ import annotations

import pytest
import torch

from graphsan.lab.quant import GroupedQuantLinear, WeightWorkspace, get_recipe
from graphsan.lab.quant import grouped as grouped_mod
from graphsan.lab.quant import nvfp4 as nvfp4_fmt
from tests.lab.grouped_checks import (
    COUNTS,
    NO_SR,
    RECIPES,
    assert_same_bytes,
    check_against_loop,
    check_stack_equals_groups,
    group_part,
    grouped_rows,
    offsets_of,
    run_grouped,
)
from tests.lab.quant_oracles import skewed


@pytest.mark.parametrize("name", list(NO_SR))
@pytest.mark.parametrize("role", ["input", "grad_output", "weight"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_quantizing_the_whole_stack_equals_quantizing_each_group(name, role, axis):
    """One quantization of the stacked rows gives the bytes of one quantization per group: blocks
    never cross groups (counts are multiples of 32) and per-tensor factors are per group."""
    check_stack_equals_groups(NO_SR[name], role, axis, "cpu")


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


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_gemms_match_the_per_expert_loop_in_float64(name):
    """fprop, dgrad and wgrad of every expert against float64 products of that expert's
    dequantized operands (the table's directions); padding rows give exact zeros."""
    check_against_loop(RECIPES[name], "cpu")


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

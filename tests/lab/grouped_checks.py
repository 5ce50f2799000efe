"""What the grouped-expert tests check, shared by the CPU tests (test_grouped_linear.py) and the
GPU tests (test_grouped_gpu.py): the recipes, grouped inputs, and the two checks (stacked
quantization byte-equal per group; the grouped GEMMs against a per-expert float64 loop)."""

from __future__ import annotations

import zlib

import torch

from graphsan.lab.quant import GroupedQuantLinear, NVFP4Options, RowGroups, get_recipe
from graphsan.lab.quant import fp8 as fp8_fmt
from graphsan.lab.quant import mxfp8 as mxfp8_fmt
from graphsan.lab.quant import nvfp4 as nvfp4_fmt
from graphsan.lab.quant.gemm import gemm_alpha, gemm_operand
from tests.lab.quant_oracles import ref_mm, skewed

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


# (axis, block_2d, rht, sr) of every NVFP4 operand kind the grouped experts quantize
NVFP4_GROUPED_KINDS = [
    (-1, False, False, False),  # X rowwise
    (-1, False, False, True),  # dY rowwise (SR)
    (-1, True, False, False),  # stacked weights, rowwise
    (0, True, False, False),  # stacked weights, columnwise
    (0, False, False, False),  # plain columnwise
    (0, False, True, False),  # X columnwise (RHT)
    (0, False, True, True),  # dY columnwise (RHT, SR)
    (0, False, False, True),  # columnwise SR without RHT
]


def check_nvfp4_grouped_kernels(tk, counts, device, order="current"):
    """`tk.nv.nvfp4_quantize_grouped` byte-equal to the torch reference for every operand kind
    (columnwise kinds only where every count is a multiple of 16), SR from equally seeded
    generators; the per-group amax too, including 0 for an empty group."""
    g = torch.Generator().manual_seed(sum(counts))
    x = grouped_rows(counts, 96, g, pad=16, device=device)
    x[3, 5] = float("nan")
    groups = row_groups(counts, x.shape[0], device)
    n = len(counts)
    checked = 0
    for axis, block_2d, use_rht, sr in NVFP4_GROUPED_KINDS:
        if axis == 0 and any(c % 16 for c in counts):
            continue
        g1 = torch.Generator(device=device).manual_seed(4) if sr else None
        g2 = torch.Generator(device=device).manual_seed(4) if sr else None
        a = tk.nv.nvfp4_quantize_grouped(
            x, groups.index, n, axis, NVFP4Options(block_2d, order, use_rht, g1)
        )
        b = nvfp4_fmt.quantize_grouped_reference(
            x, groups.index, n, axis, NVFP4Options(block_2d, order, use_rht, g2)
        )
        assert a is not None, (axis, block_2d, use_rht, sr)
        assert_same_bytes(a, b)
        checked += 1
    return checked

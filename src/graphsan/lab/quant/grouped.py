"""GroupedQuantLinear: one projection of every expert as one module, GEMMs grouped by rows.

    y[rows of group g] = x[rows of group g] W_g^T        for g in 0 .. G-1

`x` holds the rows of all groups one after another (a MoE's permuted tokens, expert-major) and
`offsets` (int32 device tensor [G]) the end of each group (cumulative row counts). Rows past
`offsets[-1]` are padding: their output and input gradient are zero and they add nothing to any
weight gradient. Group sizes never leave the device: the module has no host sync, so it could be
captured in a CUDA graph.

GEMMs and operands follow `QuantLinear` (docs/numerics.md, "The quantized Linear"), one call per
operand for all groups:

    fprop  Y  = X W_g^T    W rowwise (NVFP4: 16x16 blocks), X rowwise
    dgrad  dX = dY W_g     W columnwise (weight workspace), dY rowwise (NVFP4: SR)
    wgrad  dW_g = dY^T X   X columnwise and dY columnwise (NVFP4: both RHT, dY SR), per group

- Weights [G, out, in] are quantized as one stacked [G*out, in] tensor with the per-tensor factor
  (NVFP4 global amax, FP8 scale) per expert from a batched reduction; `out_features` is a multiple
  of the block, so no block crosses experts and the bytes equal quantizing each expert alone.
- Activations and gradients are quantized whole, with the per-tensor factor per group. Their
  columnwise blocks (and RHT blocks) run along the rows; every group's row count is a multiple of
  `row_multiple` (the caller pads: the MoE's `moe_pad_multiple`), which must be a multiple of the
  block, so these blocks never cross groups either.
- The GEMM is `torch._grouped_mm` on the exactly dequantized bf16 operands with float32
  accumulation, then one float32 alpha per group (rows of group g: alpha_g). On CPU the result is
  float32, as `QuantLinear`'s. On CUDA torch's sync-free grouped kernel (sm90/sm100) writes bf16
  only (asking for float32 sends torch to a per-group fallback that copies the offsets to the
  host), so there the GEMM result is rounded to bf16 once before alpha and before the float32
  `main_grad` accumulation: the one difference from `QuantLinear`.

Weight workspace, stored recipe, state policies, skip flag and SR generator are `QuantModule`'s,
shared with `QuantLinear`. No bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import kernels
from .gemm import alpha_factors, gemm_alpha, gemm_operand
from .linear import BLOCKS, QuantModule, _check_tokens, _Plan
from .recipe import Quantizer, Recipe, RowGroups
from .tensors import QTensor

# --- the grouped GEMM -------------------------------------------------------------------------

_GROUPED_MM: dict[str, bool] = {}  # device type -> whether torch._grouped_mm runs there


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype=torch.float32
) -> torch.Tensor:
    """A grouped GEMM of bf16-valued operands with float32 accumulation, returned in `out_dtype`
    (float32, or bf16 where the caller rounds to bf16 anyway: on CUDA that skips a round trip).

    2-D x 3-D: a [M, K] (rows grouped by `offsets`), b [G, K, N] -> [M, N]; rows past
    offsets[-1] are left unspecified (the caller masks them).
    2-D x 2-D: a [N, M], b [M, K] (the M dim grouped) -> [G, N, K]; an empty group's entry is
    left unspecified.
    """
    kind = a.device.type
    ok = _GROUPED_MM.get(kind)
    if ok is None:  # probed once, eagerly, on tiny operands
        try:
            ones = torch.ones(16, 16, device=a.device, dtype=_mm_dtype(a))
            offs = torch.full((1,), 16, device=a.device, dtype=torch.int32)
            torch._grouped_mm(ones, ones.unsqueeze(0), offs=offs)
            ok = True
        except (AttributeError, NotImplementedError, RuntimeError):
            ok = False
        _GROUPED_MM[kind] = ok
    if not ok:
        return _grouped_mm_loop(a, b, offsets).to(out_dtype)
    dtype = _mm_dtype(a)
    return torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offsets).to(out_dtype)


def _mm_dtype(a: torch.Tensor) -> torch.dtype:
    # CUDA: bf16 operands, the only sync-free grouped kernel (bf16 result: asking for bf16
    # makes no float32 copy, so the quantized GEMMs ask for this dtype too). CPU: float32 operands
    # hold the bf16 values and their products exactly: a float32-accumulated bf16 GEMM with a
    # float32 result, as `mm_fp32` computes on CPU. The meta device (a step's memory counted
    # without data, lab/train/device.py) takes CUDA's path: the loop would read the offsets.
    return torch.bfloat16 if a.device.type in ("cuda", "meta") else torch.float32


def _grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The fallback where torch has no grouped GEMM for the device: one GEMM per group. Reads
    the offsets on the host (a sync); the grouped path never comes here when it exists."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    if b.dim() == 3:
        out = a32.new_zeros(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out[s:e] = a32[s:e] @ b32[g]
        return out
    return torch.stack([a32[:, s:e] @ b32[s:e] for s, e in zip(starts, ends, strict=True)])


def _rows_epilogue(y, a: QTensor, b: QTensor, groups: RowGroups, dtype) -> torch.Tensor:
    """A quantized GEMM's rows times their group's alpha, padding rows zero, in `dtype`: one
    epilogue kernel on CUDA (`kernels.launch_gemm.gemm_epilogue`), the torch operations
    elsewhere."""
    fast = kernels.gemm_launcher(y)
    if fast is not None and dtype == torch.bfloat16:
        return fast.gemm_epilogue(y, *alpha_factors(a, b), row_groups=groups)
    return _rows_out(y, gemm_alpha(a, b), groups).to(dtype)


def _groups_epilogue(dw, a: QTensor, b: QTensor, offsets, main_grad) -> None:
    """main_grad += each group's weight gradient times its alpha, an empty group's adding zero:
    one epilogue kernel on CUDA, the torch operations elsewhere."""
    fast = kernels.gemm_launcher(dw)
    if fast is not None:
        fast.gemm_epilogue(dw, *alpha_factors(a, b), out=main_grad, offsets=offsets)
        return
    main_grad.add_(_groups_out(dw, gemm_alpha(a, b), _nonempty(offsets)))


def _nonempty(offsets: torch.Tensor) -> torch.Tensor:
    return torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0


def _rows_out(out: torch.Tensor, alpha: torch.Tensor | None, groups: RowGroups) -> torch.Tensor:
    """Rows of group g times alpha_g; padding rows (in no group) exactly zero."""
    if alpha is not None:
        out = out * alpha[groups.index.clamp(max=groups.count - 1)].unsqueeze(1)
    return torch.where((groups.index < groups.count).unsqueeze(1), out, 0.0)  # NaN junk too


def _groups_out(dw: torch.Tensor, alpha: torch.Tensor | None, nonempty: torch.Tensor):
    """Group g's weight gradient times alpha_g; an empty group's exactly zero."""
    if alpha is not None:
        dw = dw * alpha.view(-1, 1, 1)
    return torch.where(nonempty.view(-1, 1, 1), dw, 0.0)


def _stacked(values: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[G*R, C] operand values as [G, R, C] (contiguous: the grouped kernel's layout)."""
    return values.reshape(num_groups, -1, values.shape[1]).contiguous()


# --- autograd ---------------------------------------------------------------------------------


@dataclass
class _GroupedPlan(_Plan):
    """QuantLinear's plan plus the groups of the rows."""

    offsets: torch.Tensor  # int32 [G], the end of each group
    groups: RowGroups  # the group of each row of x


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, plan: _GroupedPlan):
        g, groups = weight.shape[0], plan.groups
        if plan.recipe.quantized:
            q = plan.quantizers["input"]
            if plan.save_for_wgrad:
                xq, ctx.x_saved = q.quantize_both(x, groups=groups)
            else:
                xq, ctx.x_saved = q.quantize(x, -1, groups=groups), None
            w = _stacked(gemm_operand(plan.w_rowwise), g).transpose(1, 2)
            y = grouped_mm(gemm_operand(xq), w, plan.offsets, _mm_dtype(x))
            y = _rows_epilogue(y, xq, plan.w_rowwise, groups, x.dtype)
        else:
            y = grouped_mm(x, weight.transpose(1, 2), plan.offsets, x.dtype)
            y = _rows_out(y, None, groups)
            ctx.x_saved = x if plan.save_for_wgrad else None
        ctx.plan = plan
        ctx.weight = weight if not plan.recipe.quantized else None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        plan: _GroupedPlan = ctx.plan
        g, groups, offsets = plan.main_grad.shape[0], plan.groups, plan.offsets
        dy = dy.contiguous()
        dx = None
        if plan.recipe.quantized:
            q = plan.quantizers["grad_output"]
            need = (ctx.needs_input_grad[0], ctx.x_saved is not None)
            dy_row, dy_col = q.quantize_copies(dy, *need, plan.generator, groups)
            if dy_row is not None:
                w = _stacked(gemm_operand(plan.w_columnwise), g)
                dx = grouped_mm(gemm_operand(dy_row), w, offsets, _mm_dtype(dy))
                dx = _rows_epilogue(dx, dy_row, plan.w_columnwise, groups, dy.dtype)
            if dy_col is not None:
                x_col = gemm_operand(ctx.x_saved)
                dw = grouped_mm(gemm_operand(dy_col).t(), x_col, offsets, _mm_dtype(dy))
                _groups_epilogue(dw, dy_col, ctx.x_saved, offsets, plan.main_grad)
        else:
            if ctx.needs_input_grad[0]:
                dx = _rows_out(grouped_mm(dy, ctx.weight, offsets, dy.dtype), None, groups)
            if ctx.x_saved is not None:
                dw = grouped_mm(dy.t(), ctx.x_saved, offsets)
                plan.main_grad.add_(_groups_out(dw, None, _nonempty(offsets)))
        ctx.x_saved = None
        return dx, None, None


# --- the module -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StackedWeightQuantizer:
    """The weight quantizer applied to the stacked [G*out, in] weights, one factor per expert."""

    quantizer: Quantizer
    groups: RowGroups

    def quantize(self, w: torch.Tensor, axis: int) -> QTensor:
        return self.quantizer.quantize(w, axis, groups=self.groups)

    def quantize_both(self, w: torch.Tensor) -> tuple[QTensor, QTensor]:
        return self.quantizer.quantize_both(w, groups=self.groups)


class GroupedQuantLinear(QuantModule):
    """`num_groups` bias-free linear layers in one module: y = x W_g^T on the rows of group g.

    weight: Parameter [num_groups, out, in] in `params_dtype`; `weight.main_grad` (float32
    [num_groups, out, in]) accumulates the weight gradient in place.
    row_multiple: every group's row count is a multiple of it (the caller's promise, e.g. the
    MoE's `moe_pad_multiple`); a quantized recipe needs it to be a multiple of its block.
    forward(x [rows, in], offsets int32 [num_groups] on x's device) -> [rows, out].
    Recipe and state: see `QuantModule` (shared with QuantLinear).
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        *,
        row_multiple: int = 32,
        device=None,
        params_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_groups", num_groups),
            ("in_features", in_features),
            ("out_features", out_features),
            ("row_multiple", row_multiple),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GroupedQuantLinear: {name}={value!r}; expected a positive int")
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.row_multiple = row_multiple
        shape = (num_groups, out_features, in_features)
        bound = 1.0 / in_features**0.5  # nn.Linear's default init, per expert
        weight = torch.empty(shape, device=device, dtype=torch.float32).uniform_(-bound, bound)
        self.weight = nn.Parameter(weight.to(params_dtype))
        self.weight.main_grad = torch.zeros(shape, device=device, dtype=torch.float32)

    def set_recipe(self, recipe: Recipe) -> None:
        """As QuantLinear's; also checks that the recipe's blocks cannot cross experts."""
        block = BLOCKS.get(recipe.kind) if isinstance(recipe, Recipe) else None
        if block:
            for name in ("in_features", "out_features", "row_multiple"):
                if getattr(self, name) % block:
                    raise ValueError(
                        f"GroupedQuantLinear({recipe.kind}): {name}={getattr(self, name)}; "
                        f"expected a multiple of {block} (the {recipe.kind} block), so that no "
                        "block crosses two experts"
                    )
        super().set_recipe(recipe)

    def _weight_source(self) -> torch.Tensor:
        return self.weight.detach().reshape(-1, self.in_features)

    def _weight_quantizer(self):
        rows = torch.arange(self.num_groups * self.out_features, device=self.weight.device)
        groups = RowGroups(rows // self.out_features, self.num_groups)
        return _StackedWeightQuantizer(self.quantizers["weight"], groups)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GroupedQuantLinear: input shape {tuple(x.shape)}; expected [rows, "
                f"in_features={self.in_features}]"
            )
        if (
            offsets.dtype != torch.int32
            or offsets.shape != (self.num_groups,)
            or offsets.device != x.device
        ):
            raise ValueError(
                f"GroupedQuantLinear: offsets is {offsets.dtype} {tuple(offsets.shape)} on "
                f"{offsets.device}; expected int32 ({self.num_groups},) on {x.device} (the "
                "cumulative row count at the end of each group)"
            )
        grad_enabled = torch.is_grad_enabled()
        wgrad = grad_enabled and self.weight.requires_grad
        _check_tokens(self._recipe, x.shape[0], wgrad, "GroupedQuantLinear", "row")
        rows = torch.arange(x.shape[0], device=x.device, dtype=torch.int32)
        groups = RowGroups(torch.searchsorted(offsets, rows, right=True), self.num_groups)
        plan = _GroupedPlan(**self._plan_fields(x, grad_enabled), offsets=offsets, groups=groups)
        return _GroupedLinearFn.apply(x, self.weight, plan)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, row_multiple={self.row_multiple}, "
            f"recipe={self._recipe.describe()}, state_policy={self.state_policy}"
        )

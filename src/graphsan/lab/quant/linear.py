"""QuantLinear: a Linear layer whose three GEMMs run on quantized operands, with TE-like state.

GEMMs (docs/numerics.md, "The quantized Linear"):

    fprop  Y  = X W^T    W rowwise (NVFP4: 16x16 blocks), X rowwise
    dgrad  dX = dY W     W columnwise, read from the cached weight workspace; dY rowwise (NVFP4: SR)
    wgrad  dW = dY^T X   X columnwise and dY columnwise (NVFP4: both RHT, dY SR)

Each GEMM is emulated the way Hopper must (gemm.py: exactly dequantized bf16 operands, float32
accumulation, one float32 alpha).
The weight gradient is accumulated in place into the float32 `weight.main_grad`; `weight.grad`
stays None.

Per-module state mirrors Transformer Engine 2.18 (`transformer_engine/pytorch/module/*.py`), because
the lab's reproduction of TE #3316 depends on it:

- `recipe`: the module's own recipe (Megatron's per-module override binds it);
  `stored_recipe`: what the module last recorded (TE's `fp8_meta["recipe"]`); forward writes it and
  a CUDA-graph wrapper may overwrite it, as TE's `graph.py` does on every replay.
- `workspace`: the cached quantized weight (rowwise part, columnwise part) that fprop and dgrad
  read. It is allocated by the first eager forward that needs it and afterwards only re-quantized
  IN PLACE (gated by the device-side `skip_weight_update` flag), so a captured graph's baked
  addresses stay valid, until something clears it. A `SkipFlag` also tells eager forwards the
  flag's value, so they skip the re-quantization outright, as TE's eager path does for every
  microbatch after the first.
- `state_policy`: "te218" reproduces TE's behaviour (clear the workspace when the stored recipe
  class differs from the active one; an eval forward then rebuilds it rowwise-only), "fixed" never
  clears on a mismatch and leaves the workspace alone when grad is disabled.

These rules are written once, in `QuantModule`, the base of `QuantLinear` and of the routed
experts' `GroupedQuantLinear` (grouped.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from graphsan.lab.choices import STATE_POLICIES, RecipeKind, StatePolicy

from .formats import MXFP8_BLOCK, NVFP4_BLOCK
from .gemm import mm_fp32, quantized_mm
from .recipe import Quantizer, Recipe, get_recipe
from .tensors import QTensor


@dataclass
class WeightWorkspace:
    """The cached quantized weight of one module (TE's `_fp8_workspaces["weight"]`).

    kind: the recipe class the buffers were made for.
    rowwise: the fprop operand (W rowwise).
    columnwise: the dgrad operand (W columnwise); None until a grad-enabled forward builds it.
    """

    kind: RecipeKind
    rowwise: QTensor
    columnwise: QTensor | None = None

    def buffers(self) -> list[torch.Tensor]:
        """Every device tensor of the workspace (what a captured graph may have baked in)."""
        parts = [self.rowwise] + ([self.columnwise] if self.columnwise is not None else [])
        return [t for p in parts for t in p.buffers()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())


class SkipFlag:
    """A weight-update skip flag shared by a model's modules: the 0-dim device tensor that a
    captured graph's masked copy reads (`tensor`), and the value the host last wrote into it
    (`value`). Set it only with `set`, so the two agree. A forward that is not being captured
    reads `value` (no device read, no sync): at 1 it leaves the workspace as it is without
    quantizing, at 0 it re-quantizes with a plain copy; a forward being captured records the
    masked copy, which reads `tensor` on every replay."""

    def __init__(self, device=None):
        self.tensor = torch.zeros((), device=device)
        self.value = 0

    def set(self, value: int) -> None:
        if value not in (0, 1):
            raise ValueError(f"SkipFlag.set({value!r}): expected 0 or 1")
        self.tensor.fill_(value)
        self.value = value


def _skip_state(flag) -> tuple[torch.Tensor | None, int | None]:
    """(the tensor a masked re-quantization reads, or None for an unmasked one; the flag's value
    where the host knows it now, else None)."""
    if flag is None:
        return None, 0
    if isinstance(flag, SkipFlag):
        capturing = flag.tensor.is_cuda and torch.cuda.is_current_stream_capturing()
        return flag.tensor, (None if capturing else flag.value)
    return flag, None


# --- autograd ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    """What one forward call hands to its backward (the autograd context keeps it)."""

    recipe: Recipe
    quantizers: dict[str, Quantizer]
    w_rowwise: QTensor | None
    w_columnwise: QTensor | None  # the workspace's columnwise buffers: dgrad reads them
    main_grad: torch.Tensor
    generator: torch.Generator | None
    save_for_wgrad: bool


class _QuantLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: _Plan):
        if plan.recipe.quantized:
            # TE quantizes the input's columnwise (wgrad) copy in forward and saves it.
            q = plan.quantizers["input"]
            if plan.save_for_wgrad:
                xq, ctx.x_saved = q.quantize_both(x)
            else:
                xq, ctx.x_saved = q.quantize(x, axis=-1), None
            # with a bias the float32 sum is rounded once, below
            rounded = x.dtype if bias is None else torch.float32
            y = quantized_mm(xq, plan.w_rowwise, transpose_b=True, out_dtype=rounded)
        else:
            y = mm_fp32(x.to(torch.bfloat16), weight.to(torch.bfloat16).t())
            ctx.x_saved = x if plan.save_for_wgrad else None
        if bias is not None:
            y = y + bias.to(torch.float32)
        ctx.plan = plan
        ctx.weight = weight if not plan.recipe.quantized else None
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        plan: _Plan = ctx.plan
        dy = dy.contiguous()
        dx = None
        if plan.recipe.quantized:
            q = plan.quantizers["grad_output"]
            need = (ctx.needs_input_grad[0], ctx.x_saved is not None)
            dy_row, dy_col = q.quantize_copies(dy, *need, generator=plan.generator)
            if dy_row is not None:
                dx = quantized_mm(dy_row, plan.w_columnwise, out_dtype=dy.dtype)
            if dy_col is not None:
                quantized_mm(dy_col, ctx.x_saved, transpose_a=True, out=plan.main_grad)
        else:
            dy16 = dy.to(torch.bfloat16)
            if ctx.needs_input_grad[0]:
                dx = mm_fp32(dy16, ctx.weight.to(torch.bfloat16)).to(dy.dtype)
            if ctx.x_saved is not None:
                plan.main_grad.add_(mm_fp32(dy16.t(), ctx.x_saved.to(torch.bfloat16)))
        dbias = dy.to(torch.float32).sum(0).to(dy.dtype) if ctx.has_bias else None
        ctx.x_saved = None
        return dx, None, dbias, None


# --- the module -------------------------------------------------------------------------------


class QuantModule(nn.Module):
    """The per-module state every quantized GEMM module shares (QuantLinear, GroupedQuantLinear).

    weight: the Parameter whose quantized copy the workspace caches; `weight.main_grad` (float32)
    accumulates its gradient in place.
    recipe / set_recipe(r): the module's own recipe (default bf16).
    stored_recipe: the recipe the module last recorded (forward writes it).
    state_policy: "fixed" (default) or "te218".
    workspace: the cached `WeightWorkspace` or None; clear_workspace() drops it.
    skip_weight_update: None, a 0-dim device tensor or a `SkipFlag`; while it holds 1 the
    workspace is not re-quantized (a masked in-place copy, so a captured graph can replay it;
    with a `SkipFlag` an eager forward skips the quantization itself).
    sr_generator: generator for stochastic rounding (None: the device's default generator,
    which CUDA-graph capture handles).

    A subclass creates `weight` (and its `main_grad`) and may override `_weight_source` and
    `_weight_quantizer` (how the weight is laid out and quantized); the workspace rules below are
    written once, here.
    """

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self._recipe = get_recipe("bf16")
        self.quantizers: dict[str, Quantizer] = {}
        self.stored_recipe: Recipe | None = None
        self.state_policy = "fixed"
        self.workspace: WeightWorkspace | None = None
        self.skip_weight_update: torch.Tensor | SkipFlag | None = None
        self.sr_generator: torch.Generator | None = None

    # --- recipe ---

    @property
    def recipe(self) -> Recipe:
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe) -> None:
        self.set_recipe(recipe)

    def set_recipe(self, recipe: Recipe) -> None:
        """Bind a recipe to this module (an eager reconfiguration, before any capture).

        A workspace built for another recipe class has the wrong layout, so it is dropped here;
        one of the same class is kept and refreshed by the next re-quantization.
        """
        if not isinstance(recipe, Recipe):
            raise TypeError(f"set_recipe: expected a Recipe, got {type(recipe).__name__}")
        if self.workspace is not None and self.workspace.kind != recipe.kind:
            self.clear_workspace()
        self._recipe = recipe
        self.quantizers = recipe.quantizers()

    def clear_workspace(self) -> None:
        """Drop the cached quantized weight (its memory is freed once nothing else holds it)."""
        self.workspace = None

    # --- the state rules of one forward ---

    def _plan_fields(self, x: torch.Tensor, grad_enabled: bool) -> dict:
        """Begin a forward and gather what its backward needs (the fields of `_Plan`)."""
        recipe = self._begin_forward()
        w_row, w_col = self._weight_operands(recipe, grad_enabled)
        return dict(
            recipe=recipe,
            quantizers=self.quantizers,
            w_rowwise=w_row,
            w_columnwise=w_col,
            main_grad=self.weight.main_grad,
            generator=self._generator(x) if recipe.quantized else None,
            save_for_wgrad=grad_enabled and self.weight.requires_grad,
        )

    def _begin_forward(self) -> Recipe:
        """Check the state policy, apply its stored-recipe rule; returns the active recipe."""
        if self.state_policy not in STATE_POLICIES:
            raise ValueError(
                f"{type(self).__name__}.state_policy={self.state_policy!r}; expected one of "
                f"{STATE_POLICIES}"
            )
        recipe = self._recipe
        # TE `pytorch/module/base.py` init_fp8_metadata (~1541-1585 at 2.20-dev, the same logic at
        # 2.18): it remembers the recipe recorded in fp8_meta before this forward, and if the active
        # recipe's class is not a subclass either way of the recorded one it warns and clears
        # `_fp8_workspaces`. `stored_recipe` is that recorded recipe; the graph wrapper
        # (`pytorch/graph.py` ~1228-1258) overwrites it with the ambient recipe on replay.
        if (
            self.state_policy == StatePolicy.TE218
            and self.stored_recipe is not None
            and self.stored_recipe.kind != recipe.kind
        ):
            self.clear_workspace()
        self.stored_recipe = recipe
        return recipe

    def _weight_source(self) -> torch.Tensor:
        """The weight as the 2-D tensor its quantizer reads."""
        return self.weight.detach()

    def _weight_quantizer(self):
        """What quantizes the weight: anything with `quantize(w, axis)` and `quantize_both(w)`."""
        return self.quantizers["weight"]

    def _weight_operands(self, recipe: Recipe, grad_enabled: bool):
        """The weight's fprop (rowwise) and dgrad (columnwise) operands for this forward."""
        if not recipe.quantized:
            return None, None  # bf16 reads the weight directly; no workspace
        q = self._weight_quantizer()
        w = self._weight_source()

        # "fixed": an eval (no-grad) forward quantizes the weight on the fly and never touches
        # the workspace, so eager evaluation cannot free or re-point memory a graph uses.
        if self.state_policy == StatePolicy.FIXED and not grad_enabled:
            return q.quantize(w, axis=-1), None

        ws = self.workspace
        if ws is not None and ws.kind != recipe.kind:
            # Buffers of another layout cannot be re-quantized in place; TE likewise builds a new
            # workspace when the cached one does not fit the quantizer (module/base.py ~757-790).
            self.clear_workspace()
            ws = None
        if ws is None:
            # TE `pytorch/module/linear.py` ~455-495 and ~1950-2075: on a cache miss the weight
            # quantizer (rowwise always, columnwise only when grad is enabled) creates a new
            # workspace, which the module stores in `_fp8_workspaces`. Created by an eager
            # forward, so before capture it lives in the default memory pool.
            ws = WeightWorkspace(recipe.kind, _alloc_rowwise(w, q))
            if grad_enabled:
                ws.columnwise = _alloc_columnwise(w, q)
            self.workspace = ws
        else:
            # TE `pytorch/module/base.py` quantize_weight (~847-872): a cache hit re-quantizes
            # into the existing buffers, with the skip flag as the kernel's no-op flag.
            skip, known = _skip_state(self.skip_weight_update)
            mask = None if known == 0 else skip
            if known == 1:
                pass  # the host set the flag: the bytes stay as they are, nothing to quantize
            elif grad_enabled and ws.columnwise is not None:
                fresh_row, fresh_col = q.quantize_both(w)
                _requantize_into(ws.rowwise, fresh_row, mask)
                _requantize_into(ws.columnwise, fresh_col, mask)
            else:
                _requantize_into(ws.rowwise, q.quantize(w, axis=-1), mask)
            if grad_enabled and ws.columnwise is None:
                # The workspace was built by a no-grad (eval) forward: add the columnwise part
                # now. (TE 2.20-dev instead treats the workspace as invalid and builds a whole
                # new one, `_is_weight_workspace_valid`, module/base.py ~757-790.)
                ws.columnwise = _alloc_columnwise(w, q)
        return ws.rowwise, (ws.columnwise if grad_enabled else None)

    def _generator(self, x: torch.Tensor) -> torch.Generator | None:
        if self.sr_generator is not None:
            return self.sr_generator
        if x.is_cuda:
            return torch.cuda.default_generators[x.device.index or 0]
        return torch.default_generator

    def _apply(self, fn, recurse=True):
        # Keep main_grad (a plain attribute) on the parameter's device, always float32.
        main_grad = self.weight.main_grad
        device = self.weight.device
        out = super()._apply(fn, recurse)
        if self.weight.device != device:
            self.clear_workspace()
        self.weight.main_grad = main_grad.to(self.weight.device, torch.float32)
        return out


class QuantLinear(QuantModule):
    """y = x W^T (+ b) with the module's recipe; see the module docstring for the state rules
    and `QuantModule` for the state attributes.

    weight: Parameter [out, in] in `params_dtype`; `weight.main_grad` (float32, allocated here)
    accumulates the weight gradient in place.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        device=None,
        params_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        weight = torch.empty(out_features, in_features, device=device, dtype=torch.float32)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's default
        self.weight = nn.Parameter(weight.to(params_dtype))
        self.weight.main_grad = torch.zeros(
            out_features, in_features, device=device, dtype=torch.float32
        )
        if bias:
            bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
            b = torch.empty(out_features, device=device, dtype=torch.float32).uniform_(
                -bound, bound
            )
            self.bias = nn.Parameter(b.to(params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"QuantLinear: input last dim is {x.shape[-1]}, expected in_features={self.in_features}"
            )
        grad_enabled = torch.is_grad_enabled()
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        _check_tokens(self._recipe, x2.shape[0], grad_enabled and self.weight.requires_grad)
        plan = _Plan(**self._plan_fields(x, grad_enabled))
        y = _QuantLinearFn.apply(x2, self.weight, self.bias, plan)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, recipe={self._recipe.describe()}, "
            f"state_policy={self.state_policy}"
        )


def _alloc_rowwise(w: torch.Tensor, q) -> QTensor:
    """New rowwise workspace buffers (the fprop operand), quantized from `w`."""
    return q.quantize(w, axis=-1)


def _alloc_columnwise(w: torch.Tensor, q) -> QTensor:
    """New columnwise workspace buffers (the dgrad operand), quantized from `w`."""
    return q.quantize(w, axis=0)


def _requantize_into(dst: QTensor, src: QTensor, skip: torch.Tensor | None) -> None:
    """Copy a fresh quantization into existing buffers unless the device flag `skip` holds 1.

    A masked copy (torch.where on device, written in place), so there is no host sync and a
    captured graph can replay it with either flag value.
    """
    keep = None if skip is None else skip.to(torch.bool)
    for d, s in zip(dst.buffers(), src.buffers(), strict=True):
        if keep is None:
            d.copy_(s)
        else:
            torch.where(keep, d, s, out=d)


BLOCKS = {RecipeKind.MXFP8: MXFP8_BLOCK, RecipeKind.NVFP4: NVFP4_BLOCK}  # blocks to align


def _check_tokens(
    recipe: Recipe, tokens: int, wgrad: bool, who: str = "QuantLinear", unit: str = "token"
) -> None:
    """The columnwise (wgrad) copies block along the token dim: it must fit the block size."""
    block = BLOCKS.get(recipe.kind)
    if wgrad and block and tokens % block:
        raise ValueError(
            f"{who}({recipe.kind}): {tokens} {unit}s; with grad enabled the wgrad operands are "
            f"quantized in {block}-{unit} blocks, so expected a multiple of {block}"
        )

"""Recipes (what precision a module runs in) and the per-slot quantizers they make.

A `Recipe` is a frozen dataclass; `kind` is its "recipe class" (TE's recipe type): "bf16", "fp8"
(per-tensor current scaling, E4M3), "mxfp8" or "nvfp4". Options that do not apply to a kind keep
their defaults and are ignored.

    get_recipe("nvfp4")                                   # TE defaults: RHT, SR, 2-D weights, current order
    get_recipe("nvfp4", order="legacy", rht=False, sr=False, weight_2d=False)
    get_recipe("mxfp8", fp8_format="hybrid")              # E5M2 gradients

`Recipe.quantizers()` gives one `Quantizer` per GEMM slot ("weight", "input", "grad_output"); each
knows which direction gets which treatment (docs/numerics.md, "The quantized Linear"):
NVFP4 weights use 16x16 blocks, grad_output uses stochastic rounding in both directions, and the
columnwise (wgrad) copies of input and grad_output get the random Hadamard transform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import fp8, mxfp8, nvfp4
from .options import ORDERS, NVFP4Options
from .tensors import QTensor

KINDS = ("bf16", "fp8", "mxfp8", "nvfp4")
ROLES = ("weight", "input", "grad_output")

# Options that each kind understands (the rest keep their defaults).
OPTIONS = {
    "bf16": (),
    "fp8": (),
    "mxfp8": ("fp8_format",),
    "nvfp4": ("order", "rht", "sr", "weight_2d"),
}
_CHOICES = {
    "fp8_format": ("e4m3", "hybrid"),
    "order": ORDERS,
}


class RecipeError(ValueError):
    """An unknown recipe name or an invalid option."""


@dataclass(frozen=True)
class Recipe:
    """The precision of one module.

    kind: "bf16" | "fp8" | "mxfp8" | "nvfp4" (the recipe class).
    fp8_format: mxfp8 only; "e4m3" for every tensor (TE default) or "hybrid" (E5M2 grad_output).
    order: nvfp4 only; "current" (TE >= 2.15) or "legacy" (TE 2.9-2.14) block-scale op order.
    rht: nvfp4 only; random Hadamard transform on the wgrad copies of input and grad_output.
    sr: nvfp4 only; stochastic rounding of grad_output.
    weight_2d: nvfp4 only; 16x16 weight blocks.
    """

    kind: str = "bf16"
    fp8_format: str = "e4m3"
    order: str = "current"
    rht: bool = True
    sr: bool = True
    weight_2d: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RecipeError(f"unknown recipe {self.kind!r}; expected one of {list(KINDS)}")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise RecipeError(
                    f"recipe {self.kind}: {name}={getattr(self, name)!r}; expected one of {list(choices)}"
                )
        for name in ("rht", "sr", "weight_2d"):
            if not isinstance(getattr(self, name), bool):
                raise RecipeError(
                    f"recipe {self.kind}: {name}={getattr(self, name)!r}; expected true or false"
                )

    @property
    def quantized(self) -> bool:
        return self.kind != "bf16"

    def describe(self) -> str:
        """Short text, e.g. `nvfp4(current, rht, sr, 2d-weights)` or `mxfp8(e4m3)`."""
        if self.kind == "mxfp8":
            parts = [self.fp8_format]
        elif self.kind == "nvfp4":
            parts = [self.order] + [
                name
                for name, on in (("rht", self.rht), ("sr", self.sr), ("2d-weights", self.weight_2d))
                if on
            ]
        else:
            return self.kind
        return f"{self.kind}({', '.join(parts)})"

    def quantizers(self) -> dict[str, Quantizer]:
        """One quantizer per GEMM slot (empty for bf16)."""
        if not self.quantized:
            return {}
        return {role: Quantizer(self, role) for role in ROLES}


def get_recipe(name: str, **options) -> Recipe:
    """A recipe by name ("bf16", "fp8", "mxfp8", "nvfp4") with kind-specific options."""
    if name not in KINDS:
        raise RecipeError(f"unknown recipe {name!r}; expected one of {list(KINDS)}")
    allowed = OPTIONS[name]
    for key in options:
        if key not in allowed:
            raise RecipeError(
                f"recipe {name}: unknown option {key!r}; expected one of {list(allowed) or 'none'}"
            )
    return Recipe(kind=name, **options)


@dataclass(frozen=True)
class RowGroups:
    """The rows of a 2-D tensor split into consecutive groups (the experts of a grouped GEMM).

    index: int64 [rows] device tensor, the group of each row; `count` marks a row in no group
    (padding past the last group). count: the number of groups.

    Quantizing with groups gives each group its own per-tensor factor (NVFP4 global amax, FP8
    scale; the QTensor then holds one per group), so the bytes equal quantizing each group's rows
    alone. MXFP8 has no per-tensor factor and ignores the groups. Blocks along the rows (the
    columnwise direction, 32 rows MXFP8 / 16 NVFP4) must not cross groups: the caller keeps every
    group's row count a multiple of the block.
    """

    index: torch.Tensor
    count: int


@dataclass(frozen=True)
class Quantizer:
    """Quantizes one GEMM slot ("weight", "input" or "grad_output") of a recipe.

    `quantize(x, axis)` gives the rowwise (axis -1) or columnwise (axis 0) copy of a 2-D tensor
    with the treatment the slot gets in that direction; `groups` (a `RowGroups`) gives each row
    group its own per-tensor factor.
    """

    recipe: Recipe
    role: str

    def quantize(
        self,
        x: torch.Tensor,
        axis: int,
        generator: torch.Generator | None = None,
        groups: RowGroups | None = None,
    ) -> QTensor:
        r = self.recipe
        if r.kind == "fp8":
            if groups is not None:
                return fp8.quantize_grouped(x, groups.index, groups.count, axis=axis)
            return fp8.quantize(x, axis=axis)
        if r.kind == "mxfp8":
            fmt = "e5m2" if (self.role == "grad_output" and r.fp8_format == "hybrid") else "e4m3"
            return mxfp8.quantize(x, axis=axis, fmt=fmt)
        if r.kind == "nvfp4":
            options = self.nvfp4_options(generator)
            options = options if axis == 0 else options.for_rowwise()
            if groups is not None:
                return nvfp4.quantize_grouped(x, groups.index, groups.count, axis, options)
            return nvfp4.quantize(x, axis, options)
        raise RecipeError(f"recipe {r.kind} does not quantize")

    def quantize_both(
        self,
        x: torch.Tensor,
        generator: torch.Generator | None = None,
        groups: RowGroups | None = None,
    ) -> tuple[QTensor, QTensor]:
        """(rowwise, columnwise) copies, equal to `quantize(x, -1)` then `quantize(x, 0)`. On
        CUDA MXFP8 uses the fused one-pass kernel, NVFP4 one read for both global amaxes."""
        r = self.recipe
        if r.kind == "mxfp8":
            fmt = "e5m2" if (self.role == "grad_output" and r.fp8_format == "hybrid") else "e4m3"
            return mxfp8.quantize_both(x, fmt=fmt)
        if r.kind == "nvfp4":
            options = self.nvfp4_options(generator)
            if groups is not None:
                return nvfp4.quantize_grouped_both(x, groups.index, groups.count, options)
            return nvfp4.quantize_both(x, options)
        return self.quantize(x, -1, generator, groups), self.quantize(x, 0, generator, groups)

    def quantize_copies(
        self,
        x: torch.Tensor,
        rowwise: bool,
        columnwise: bool,
        generator: torch.Generator | None = None,
        groups: RowGroups | None = None,
    ) -> tuple[QTensor | None, QTensor | None]:
        """The copies asked for (None for the others): both through `quantize_both`, which
        reads x once for what they share, one through `quantize`."""
        if rowwise and columnwise:
            return self.quantize_both(x, generator, groups)
        row = self.quantize(x, -1, generator, groups) if rowwise else None
        return row, self.quantize(x, 0, generator, groups) if columnwise else None

    def nvfp4_options(self, generator: torch.Generator | None = None) -> NVFP4Options:
        """NVFP4's treatment of this slot's columnwise copy (`for_rowwise()` gives the rowwise
        one's: no RHT); `generator` is used where the slot is stochastically rounded."""
        r = self.recipe
        weight = self.role == "weight"
        return NVFP4Options(
            block_2d=weight and r.weight_2d,
            order=r.order,
            rht=r.rht and not weight,
            generator=generator if (r.sr and self.role == "grad_output") else None,
        )

"""Recipes (what precision a module runs in) and the per-slot quantizers they make.

A `Recipe` is a frozen dataclass: its `kind` (a `RecipeKind`: bf16, fp8 (per-tensor current
scaling, E4M3), mxfp8 or nvfp4; a name is parsed into it) and, for the kinds that have some,
its settings as one typed value: `MXFP8Settings` (the FP8 format) or `NVFP4Settings` (the op
order, RHT, stochastic rounding, 2-D weight blocks). BF16 and FP8 have no settings.

    get_recipe("nvfp4")                                   # TE defaults: RHT, SR, 2-D weights, current order
    get_recipe("nvfp4", order="legacy", rht=False, sr=False, weight_2d=False)
    get_recipe("mxfp8", fp8_format="hybrid")              # E5M2 gradients
    Recipe("nvfp4", nvfp4=NVFP4Settings(order="legacy"))  # the same, as values

`Recipe.quantizers()` gives one `Quantizer` per GEMM slot ("weight", "input", "grad_output"); each
knows which direction gets which treatment (docs/numerics.md, "The quantized Linear"):
NVFP4 weights use 16x16 blocks, grad_output uses stochastic rounding in both directions, and the
columnwise (wgrad) copies of input and grad_output get the random Hadamard transform
(`NVFP4Settings.options` makes a slot's `NVFP4Options`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from graphsan.lab.choices import RecipeKind

from . import fp8, mxfp8, nvfp4
from .options import ORDERS, NVFP4Options
from .tensors import QTensor

KINDS = RecipeKind.values()
ROLES = ("weight", "input", "grad_output")
FP8_FORMATS = ("e4m3", "hybrid")


class RecipeError(ValueError):
    """An unknown recipe name or an invalid option."""


def parse_kind(name: str | RecipeKind) -> RecipeKind:
    """The kind a recipe name names; a RecipeError naming the kinds otherwise."""
    try:
        return RecipeKind.parse(name, "recipe")
    except ValueError as err:
        raise RecipeError(str(err)) from None


def _check_choice(kind: RecipeKind, name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise RecipeError(f"recipe {kind}: {name}={value!r}; expected one of {list(choices)}")


def _check_flag(kind: RecipeKind, name: str, value) -> None:
    if not isinstance(value, bool):
        raise RecipeError(f"recipe {kind}: {name}={value!r}; expected true or false")


@dataclass(frozen=True)
class MXFP8Settings:
    """What an MXFP8 recipe sets (its blocks are always 32 elements with an E8M0 scale)."""

    fp8_format: str = "e4m3"
    """"e4m3" for every tensor (TE's default) or "hybrid" (E5M2 grad_output)."""

    def __post_init__(self) -> None:
        _check_choice(RecipeKind.MXFP8, "fp8_format", self.fp8_format, FP8_FORMATS)

    def element_format(self, role: str) -> str:
        """The FP8 format of a slot's elements: E5M2 for grad_output under "hybrid", else E4M3."""
        return "e5m2" if role == "grad_output" and self.fp8_format == "hybrid" else "e4m3"

    def describe(self) -> tuple[str, ...]:
        return (self.fp8_format,)


@dataclass(frozen=True)
class NVFP4Settings:
    """What an NVFP4 recipe sets; `options(role)` is the treatment of one slot's copy."""

    order: str = "current"
    """The block scale's op order: "current" (TE >= 2.15) or "legacy" (TE 2.9-2.14)."""

    rht: bool = True
    """The random Hadamard transform on the wgrad copies of input and grad_output."""

    sr: bool = True
    """Stochastic rounding of grad_output."""

    weight_2d: bool = True
    """16x16 weight blocks."""

    def __post_init__(self) -> None:
        _check_choice(RecipeKind.NVFP4, "order", self.order, ORDERS)
        for name in ("rht", "sr", "weight_2d"):
            _check_flag(RecipeKind.NVFP4, name, getattr(self, name))

    def options(self, role: str, generator: torch.Generator | None = None) -> NVFP4Options:
        """The NVFP4 treatment of `role`'s columnwise copy (`for_rowwise()` gives the rowwise
        one's: no RHT); `generator` is used where the slot is stochastically rounded."""
        weight = role == "weight"
        return NVFP4Options(
            block_2d=weight and self.weight_2d,
            order=self.order,
            rht=self.rht and not weight,
            generator=generator if (self.sr and role == "grad_output") else None,
        )

    def describe(self) -> tuple[str, ...]:
        on = (("rht", self.rht), ("sr", self.sr), ("2d-weights", self.weight_2d))
        return (self.order, *(name for name, flag in on if flag))


# the options `get_recipe` takes for each kind: its settings' fields
OPTIONS = {
    RecipeKind.BF16: (),
    RecipeKind.FP8: (),
    RecipeKind.MXFP8: tuple(f.name for f in fields(MXFP8Settings)),
    RecipeKind.NVFP4: tuple(f.name for f in fields(NVFP4Settings)),
}


@dataclass(frozen=True)
class Recipe:
    """The precision of one module.

    kind: the recipe class (a name such as "nvfp4" is parsed into its `RecipeKind`).
    mxfp8: an MXFP8 recipe's settings (their defaults where not given); None for other kinds.
    nvfp4: an NVFP4 recipe's settings (their defaults where not given); None for other kinds.
    """

    kind: RecipeKind = RecipeKind.BF16
    mxfp8: MXFP8Settings | None = None
    nvfp4: NVFP4Settings | None = None

    def __post_init__(self) -> None:
        kind = parse_kind(self.kind)
        object.__setattr__(self, "kind", kind)
        for name, own, settings_type in (
            ("mxfp8", RecipeKind.MXFP8, MXFP8Settings),
            ("nvfp4", RecipeKind.NVFP4, NVFP4Settings),
        ):
            value = getattr(self, name)
            if kind is not own:
                if value is not None:
                    raise RecipeError(f"recipe {kind}: {name}={value!r}; expected None")
            elif value is None:
                object.__setattr__(self, name, settings_type())
            elif not isinstance(value, settings_type):
                raise RecipeError(
                    f"recipe {kind}: {name}={value!r}; expected {settings_type.__name__}"
                )

    @property
    def quantized(self) -> bool:
        return self.kind is not RecipeKind.BF16

    @property
    def settings(self) -> MXFP8Settings | NVFP4Settings | None:
        """This kind's settings (None for BF16 and FP8, which have none)."""
        return self.mxfp8 or self.nvfp4

    def describe(self) -> str:
        """Short text, e.g. `nvfp4(current, rht, sr, 2d-weights)` or `mxfp8(e4m3)`."""
        if self.settings is None:
            return str(self.kind)
        return f"{self.kind}({', '.join(self.settings.describe())})"

    def quantizers(self) -> dict[str, Quantizer]:
        """One quantizer per GEMM slot (empty for bf16)."""
        if not self.quantized:
            return {}
        return {role: Quantizer(self, role) for role in ROLES}


def get_recipe(name: str | RecipeKind, **options) -> Recipe:
    """A recipe by name ("bf16", "fp8", "mxfp8", "nvfp4") with its kind's options (`OPTIONS`:
    the fields of its settings)."""
    kind = parse_kind(name)
    allowed = OPTIONS[kind]
    for key in options:
        if key not in allowed:
            raise RecipeError(
                f"recipe {kind}: unknown option {key!r}; expected one of {list(allowed) or 'none'}"
            )
    if kind is RecipeKind.MXFP8:
        return Recipe(kind, mxfp8=MXFP8Settings(**options))
    if kind is RecipeKind.NVFP4:
        return Recipe(kind, nvfp4=NVFP4Settings(**options))
    return Recipe(kind)


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
        if r.kind is RecipeKind.FP8:
            if groups is not None:
                return fp8.quantize_grouped(x, groups.index, groups.count, axis=axis)
            return fp8.quantize(x, axis=axis)
        if r.mxfp8 is not None:
            return mxfp8.quantize(x, axis=axis, fmt=r.mxfp8.element_format(self.role))
        if r.nvfp4 is not None:
            options = r.nvfp4.options(self.role, generator)
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
        if r.mxfp8 is not None:
            return mxfp8.quantize_both(x, fmt=r.mxfp8.element_format(self.role))
        if r.nvfp4 is not None:
            options = r.nvfp4.options(self.role, generator)
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

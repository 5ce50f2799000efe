"""NVFP4Options: how one NVFP4 copy of a tensor is quantized, as one value.

A recipe's treatment of a GEMM slot in one direction (docs/numerics.md, "The quantized Linear")
is four choices that every NVFP4 entry point, torch reference and kernel launcher alike, needs
together; `recipe.Quantizer` builds them, the rest pass them on unchanged.

    NVFP4Options()                                     # 1x16 blocks, current order, nearest even
    NVFP4Options(rht=True, generator=g)                # a wgrad copy of grad_output
    NVFP4Options(block_2d=True, order="legacy")        # a weight under TE 2.9-2.14's op order
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

ORDERS = ("current", "legacy")


@dataclass(frozen=True)
class NVFP4Options:
    """The NVFP4 treatment of one copy; checked when made (what needs the tensor, such as the
    axis RHT applies to or the generator's device, is checked by the entry points)."""

    block_2d: bool = False
    """16x16 blocks (weights): one scale per tile, repeated over its 16 rows; else 1x16 blocks."""

    order: str = "current"
    """The block scale's op order: "current" (TE >= 2.15: vec_max * (S_enc * fl(1/6))) or
    "legacy" (TE 2.9-2.14: (vec_max / 6) * S_enc)."""

    rht: bool = False
    """The random Hadamard transform along the token dim before the global amax and the
    quantization; columnwise (wgrad) copies only, never with 2-D blocks."""

    generator: torch.Generator | None = None
    """Stochastic rounding from one seed drawn on this generator (then Philox bytes per block);
    None: round to nearest even."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"NVFP4: order={self.order!r}; expected one of {ORDERS}")
        for name in ("block_2d", "rht"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"NVFP4: {name}={getattr(self, name)!r}; expected True or False")
        if self.rht and self.block_2d:
            raise ValueError("NVFP4: rht=True with block_2d=True; RHT is never used on 2-D weights")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise ValueError(
                f"NVFP4: generator must be a torch.Generator or None, got {self.generator!r}"
            )

    @property
    def sr(self) -> bool:
        """Whether the copy is stochastically rounded."""
        return self.generator is not None

    @property
    def legacy(self) -> bool:
        """Whether the block scale follows the legacy op order."""
        return self.order == "legacy"

    def for_rowwise(self) -> NVFP4Options:
        """These options for the rowwise copy of a pair: the RHT is the columnwise copy's only."""
        return replace(self, rht=False) if self.rht else self


DEFAULT = NVFP4Options()

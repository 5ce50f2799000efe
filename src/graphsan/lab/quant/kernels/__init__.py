"""Triton kernels for MXFP8 and NVFP4 quantization on CUDA, bit-identical to the torch reference.

`mxfp8.quantize` and `nvfp4.quantize` use them for CUDA tensors when Triton is importable and
GRAPHSAN_NO_TRITON does not turn them off; the torch reference stays the fallback and the oracle,
and the tests compare the two byte for byte (compiled on the GPU, in Triton's interpreter on CPU),
and compile every kernel for sm_90 on CPU with the flags its launcher passes on a GPU
(`launch_common.compiled` is where the launchers tell the two apart).

    kernels/__init__.py   this switch: `available()`, `launchers()`, and one typed accessor
                          per launcher (`mxfp8_launcher(x)`, `nvfp4_launcher(x)`,
                          `gemm_launcher(x)`: a Protocol each, of what its callers use);
                          imports no Triton
    kernels/launch_mxfp8.py, launch_nvfp4.py, launch_gemm.py
                          the launchers per format and for the GEMM: which kernel runs for
                          which input, tiles, outputs (launch_common.py: what they share)
    kernels/mxfp8.py      MXFP8 kernels: strided (any input), bf16 words (columnwise, both)
    kernels/nvfp4.py      global amax (also per group); NVFP4 row and column strided kernels;
                          the E2M1 encoders and block scales every NVFP4 kernel shares
    kernels/nvfp4_words.py NVFP4 row and column kernels for bf16 read as 64-bit words
    kernels/nvfp4_col.py  NVFP4 columnwise with the RHT and stochastic rounding fused; the
                          RHT amax pass (the post-RHT and the plain amax from one read)
    kernels/common.py     FP8 bytes from bit fields, bf16 words, NaN-ignoring block maxima
    kernels/gemm.py       the GEMM operands' dequantization and the GEMM epilogue
    kernels/qgemm.py      the fused packed-operand GEMM (off by default)
    kernels/fastlaunch.py launches without Triton's per-call binding (a seen specialization)

Every kernel has a "strided" form for any floating dtype and strides, and the hot directions
also a "words" form for bf16 with unit column stride (read as 64-bit words of 4 bf16); the
launcher picks the words kernel where the input allows it (docs/PERF.md has the times).

Bit-identical to the reference by construction: every float operation is one IEEE operation in
the reference's order (divisions are `div_rn`; the kernels are compiled without fp contraction,
so no multiply-add is fused). FP8 bytes come from the hardware conversion on sm_90 and later
(`cvt.rn.satfinite`: nearest even, saturating, NaN patched), elsewhere (Triton's interpreter,
older GPUs: no FP8 type before sm_89, a conversion through fp16 on sm_89) from bit fields.

Triton is imported lazily, on first use (`launchers()`), and GRAPHSAN_NO_TRITON is read where the kernels are
chosen (not at import): a bad value is a `TritonSettingError`, one line naming the variable and
the values it accepts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from ..options import NVFP4Options
    from ..tensors import MXFP8Tensor, NVFP4Tensor, QTensor

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class TritonSettingError(ValueError):
    """GRAPHSAN_NO_TRITON holds a value that means nothing."""


class MXFP8Launcher(Protocol):
    """What `mxfp8.quantize` and `mxfp8.quantize_both` call (`kernels/launch_mxfp8.py`)."""

    def mxfp8_quantize(self, x: torch.Tensor, axis: int = -1, fmt: str = "e4m3") -> MXFP8Tensor: ...

    def mxfp8_quantize_both(
        self, x: torch.Tensor, fmt: str = "e4m3"
    ) -> tuple[MXFP8Tensor, MXFP8Tensor]: ...


class NVFP4Launcher(Protocol):
    """What `nvfp4.quantize` and its both-copies and grouped forms call
    (`kernels/launch_nvfp4.py`); a grouped call gives None where its kernels do not take the
    input (the caller runs the reference)."""

    def nvfp4_quantize(
        self, x: torch.Tensor, axis: int = -1, options: NVFP4Options = ...
    ) -> NVFP4Tensor: ...

    def nvfp4_quantize_both(
        self, x: torch.Tensor, options: NVFP4Options = ...
    ) -> tuple[NVFP4Tensor, NVFP4Tensor]: ...

    def nvfp4_quantize_grouped(
        self,
        x: torch.Tensor,
        groups: torch.Tensor,
        num_groups: int,
        axis: int = -1,
        options: NVFP4Options = ...,
    ) -> NVFP4Tensor | None: ...

    def nvfp4_quantize_grouped_both(
        self, x: torch.Tensor, groups: torch.Tensor, num_groups: int, options: NVFP4Options = ...
    ) -> tuple[NVFP4Tensor, NVFP4Tensor] | None: ...


class GemmLauncher(Protocol):
    """What the emulated GEMM (`gemm.py`, `grouped.py`) calls (`kernels/launch_gemm.py`): an
    operand's bf16 values, the fused packed-operand GEMM where `FUSED_GEMM` is on, and the
    epilogue; the first two give None where their kernel does not take the operands."""

    FUSED_GEMM: bool

    def gemm_operand(self, q: QTensor) -> torch.Tensor | None: ...

    def quantized_mm(
        self,
        a: QTensor,
        b: QTensor,
        transpose_a: bool,
        transpose_b: bool,
        alpha: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None: ...

    def gemm_epilogue(
        self,
        c: torch.Tensor,
        a: torch.Tensor | None,
        b: torch.Tensor | None,
        mode: int,
        out: torch.Tensor | None = None,
        row_groups: object | None = None,  # a recipe.RowGroups (recipe imports the kernels)
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Launchers:
    """The three launcher modules, once Triton has imported them."""

    mxfp8: MXFP8Launcher
    nvfp4: NVFP4Launcher
    gemm: GemmLauncher


_LOADED: Launchers | None = None
_FAILED = False  # Triton or the launchers did not import: the torch reference runs


def triton_disabled() -> bool:
    """Whether GRAPHSAN_NO_TRITON turns the kernels off: 1/true/yes/on do, 0/false/no/off or
    unset/empty do not (any case); anything else is a `TritonSettingError`."""
    raw = os.environ.get("GRAPHSAN_NO_TRITON", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise TritonSettingError(
        f"GRAPHSAN_NO_TRITON={raw!r}: expected 1, true, yes or on (Triton off: the torch "
        "reference runs) or 0, false, no, off or empty (Triton on)"
    )


def launchers() -> Launchers | None:
    """The launchers when Triton imports and GRAPHSAN_NO_TRITON does not turn them off, else
    None; the first call imports them (and Triton)."""
    global _LOADED, _FAILED
    if triton_disabled() or _FAILED:
        return None
    if _LOADED is None:
        try:
            from . import launch_gemm, launch_mxfp8, launch_nvfp4
        except Exception:  # ImportError, or a Triton without a usable backend
            _FAILED = True
            return None
        _LOADED = Launchers(launch_mxfp8, launch_nvfp4, launch_gemm)
    return _LOADED


def available() -> bool:
    """True when Triton can be imported and GRAPHSAN_NO_TRITON does not turn it off."""
    return launchers() is not None


def _for(x: torch.Tensor) -> Launchers | None:
    """The launchers where x is a CUDA tensor and the kernels are available (else None: the
    caller runs the torch reference); a CPU tensor never reads GRAPHSAN_NO_TRITON."""
    return launchers() if x.is_cuda else None


def mxfp8_launcher(x: torch.Tensor) -> MXFP8Launcher | None:
    """The MXFP8 quantize kernels for x, or None (see `_for`)."""
    found = _for(x)
    return found.mxfp8 if found else None


def nvfp4_launcher(x: torch.Tensor) -> NVFP4Launcher | None:
    """The NVFP4 quantize kernels for x, or None (see `_for`)."""
    found = _for(x)
    return found.nvfp4 if found else None


def gemm_launcher(x: torch.Tensor) -> GemmLauncher | None:
    """The GEMM operand, fused GEMM and epilogue kernels for x, or None (see `_for`)."""
    found = _for(x)
    return found.gemm if found else None

"""Triton kernels for MXFP8 and NVFP4 quantization on CUDA, bit-identical to the torch reference.

`mxfp8.quantize` and `nvfp4.quantize` use them for CUDA tensors when Triton is importable and
GRAPHSAN_NO_TRITON does not turn them off; the torch reference stays the fallback and the oracle,
and the tests compare the two byte for byte (compiled on the GPU, in Triton's interpreter on CPU),
and compile every kernel for sm_90 on CPU with the flags its launcher passes on a GPU
(`launch_common.compiled` is where the launchers tell the two apart).

    kernels/__init__.py   this switch: `available()`, `launcher(x, name)`; imports no Triton
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

Triton is imported lazily, on first use, and GRAPHSAN_NO_TRITON is read where the kernels are
chosen (not at import): a bad value is a `TritonSettingError`, one line naming the variable and
the values it accepts.
"""

from __future__ import annotations

import importlib
import os

import torch

LAUNCHERS = ("mxfp8", "nvfp4", "gemm")  # the launcher modules: kernels/launch_<name>.py
_LAUNCH: dict = {}  # name -> launcher module, once Triton imports
_AVAILABLE: bool | None = None

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class TritonSettingError(ValueError):
    """GRAPHSAN_NO_TRITON holds a value that means nothing."""


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


def available() -> bool:
    """True when Triton can be imported and GRAPHSAN_NO_TRITON does not turn it off."""
    global _AVAILABLE
    if triton_disabled():
        return False
    if _AVAILABLE is None:
        try:
            for name in LAUNCHERS:
                _LAUNCH[name] = importlib.import_module(f".launch_{name}", __name__)
            _AVAILABLE = True
        except Exception:  # ImportError, or a Triton without a usable backend
            _AVAILABLE = False
    return _AVAILABLE


def launcher(x: torch.Tensor, name: str):
    """The launcher module `kernels.launch_<name>` (`name` one of LAUNCHERS) where x is a CUDA
    tensor and the kernels are available, else None (the caller runs the torch reference)."""
    if name not in LAUNCHERS:
        raise ValueError(f"kernels.launcher: {name!r}; expected one of {LAUNCHERS}")
    if not x.is_cuda or not available():
        return None
    return _LAUNCH[name]

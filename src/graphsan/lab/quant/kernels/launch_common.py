"""What every launcher module shares: the compile options, whether the kernels are compiled or
interpreted, whether the FP8 conversion is the hardware's, and whether an input can be read as
bf16 words.

The launchers (`launch_mxfp8`, `launch_nvfp4`, `launch_gemm`) give the same arguments and bytes
as the torch references, which check the arguments; they trust them (`mxfp8.quantize`,
`nvfp4.quantize` and the GEMM emulation check once and call them). Every kernel they launch goes
through `fastlaunch` (compiled kernels only): the same kernels and arguments, without Triton's
per-call binding once a specialization has been seen. Their launch parameters are fixed: the
fastest tiles of bench/tile_sweep.py (docs/PERF.md).
"""

from __future__ import annotations

import functools

import torch

from .fastlaunch import fast

# Compiled without fp contraction: no rounding step of the reference may be fused away.
COMPILE_OPTIONS = {"enable_fp_fusion": False}


def fast_kernels(*kernels):
    """The kernels as the launchers launch them (`fastlaunch.fast`)."""
    return tuple(fast(k) for k in kernels)


@functools.cache
def hw_fp8(device_index: int) -> bool:
    """Whether the kernels convert to FP8 with the hardware instruction on this GPU (sm_90+;
    the tests run both paths against the reference)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def compiled(x: torch.Tensor) -> bool:
    """Whether the kernels for x are compiled for its GPU rather than run in Triton's
    interpreter (CPU tensors, in the tests): what only compiled kernels have (the NaN-ignoring
    maximum, inline PTX, bf16 dots, the GPU's canonical NaN) is asked for only then. The one
    place the launchers tell the two apart, so a CPU check can compile what a GPU runs."""
    return x.is_cuda


def hw_fp8_for(x: torch.Tensor) -> bool:
    """`hw_fp8` for the device of x (False where the kernels are interpreted)."""
    if not compiled(x):
        return False
    return hw_fp8(x.device.index if x.device.index is not None else torch.cuda.current_device())


def words_fit(x: torch.Tensor) -> bool:
    """Whether a words kernel can read x as 64-bit words of 4 bf16."""
    return (
        x.dtype == torch.bfloat16
        and x.stride(1) == 1
        and x.shape[1] % 4 == 0
        and x.stride(0) % 4 == 0
        and x.data_ptr() % 8 == 0
    )

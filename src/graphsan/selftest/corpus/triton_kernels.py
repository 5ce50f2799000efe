"""User Triton kernels captured in a graph: plain pointer arguments, and TMA tensor descriptors
built on the host (a CUtensorMap passed by value) and on the device (scratch memory from the
allocator Triton is given)."""

from __future__ import annotations

import torch

from graphsan.selftest import program
from graphsan.selftest.case import Case, Skip

TRITON = "https://triton-lang.org/main/getting-started/tutorials/"


def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        raise Skip("Triton is not installed") from None
    return triton, tl


_KERNELS: dict[str, object] = {}


def _kernels():
    """The @triton.jit kernels, made on first use (Triton is imported only where it runs)."""
    if _KERNELS:
        return _KERNELS
    triton, tl = _triton()

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, alpha * x + y, mask=mask)

    @triton.jit
    def tma_scale(in_desc, out_desc, BM: tl.constexpr, BN: tl.constexpr):
        m = tl.program_id(0) * BM
        n = tl.program_id(1) * BN
        out_desc.store([m, n], in_desc.load([m, n]) * 2.0)

    @triton.jit
    def device_desc_scale(x_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
        src = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        dst = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        m = tl.program_id(0) * BM
        n = tl.program_id(1) * BN
        dst.store([m, n], src.load([m, n]) * 2.0)

    _KERNELS.update(axpy=axpy, tma_scale=tma_scale, device_desc_scale=device_desc_scale)
    return _KERNELS


def _needs_hopper():
    if torch.cuda.get_device_capability() < (9, 0):
        raise Skip("TMA tensor descriptors need sm_90 or newer")


def _capture_and_break(case: Case, inputs: dict, launch, want, victim: str) -> None:
    g, out = case.warmup_and_capture(launch)
    for t in inputs.values():
        t.mul_(0.5)
    del t  # the loop's name would keep the last input alive
    case.replay(g)
    torch.cuda.synchronize()
    case.close(out, want(), "the Triton kernel's output equals torch's")
    case.drop_and_replay(g, inputs, victim)


@program(
    "triton/pointer-arguments",
    pattern="a user @triton.jit kernel (axpy) with pointer, integer and float arguments",
    source=f"{TRITON}01-vector-add.html",
    bug="an input the kernel reads is dropped after the capture",
)
def pointer_arguments(case: Case) -> None:
    k = _kernels()["axpy"]
    n = 1_000_003
    inputs = {"x": torch.randn(n, device="cuda"), "y": torch.randn(n, device="cuda")}
    out = torch.empty(n, device="cuda")

    def launch():
        k[((n + 1023) // 1024,)](inputs["x"], inputs["y"], out, n, 0.5, BLOCK=1024)
        return out

    _capture_and_break(case, inputs, launch, lambda: 0.5 * inputs["x"] + inputs["y"], "x")


@program(
    "triton/tma-host-descriptor",
    pattern="TMA loads and stores through tensor descriptors made on the host "
    "(triton.tools.tensor_descriptor.TensorDescriptor, a CUtensorMap argument)",
    source=f"{TRITON}09-persistent-matmul.html (host-side descriptors)",
    bug="the tensor a descriptor describes is dropped after the capture",
)
def tma_host_descriptor(case: Case) -> None:
    _needs_hopper()
    k = _kernels()["tma_scale"]
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        raise Skip("this Triton has no host-side TensorDescriptor") from None
    m, n, bm, bn = 512, 256, 64, 64
    inputs = {"x": torch.randn(m, n, device="cuda")}
    out = torch.empty(m, n, device="cuda")
    descs = {
        "in": TensorDescriptor.from_tensor(inputs["x"], [bm, bn]),
        "out": TensorDescriptor.from_tensor(out, [bm, bn]),
    }

    def launch():
        k[(m // bm, n // bn)](descs["in"], descs["out"], BM=bm, BN=bn)
        return out

    want = lambda: inputs["x"] * 2.0  # noqa: E731
    if case.broken:  # the descriptor is the only other holder of the tensor: drop it too
        _capture_and_drop_descriptor(case, inputs, descs, launch, want)
        return
    _capture_and_break(case, inputs, launch, want, "x")


def _capture_and_drop_descriptor(case: Case, inputs, descs, launch, want) -> None:
    g, out = case.warmup_and_capture(launch)
    case.replay(g)
    torch.cuda.synchronize()
    case.victim(inputs["x"])
    del inputs["x"]
    descs["in"] = None
    case.churn()
    case.replay(g)


@program(
    "triton/tma-device-descriptor",
    pattern="TMA through descriptors made inside the kernel (tl.make_tensor_descriptor), "
    "their scratch memory from triton.set_allocator",
    source=f"{TRITON}09-persistent-matmul.html (device-side descriptors)",
    bug="the tensor the kernel describes is dropped after the capture",
)
def tma_device_descriptor(case: Case) -> None:
    _needs_hopper()
    triton, _ = _triton()
    if not hasattr(triton, "set_allocator"):
        raise Skip("this Triton has no triton.set_allocator")
    k = _kernels()["device_desc_scale"]
    triton.set_allocator(
        lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8)
    )
    m, n, bm, bn = 512, 256, 64, 64
    inputs = {"x": torch.randn(m, n, device="cuda")}
    out = torch.empty(m, n, device="cuda")

    def launch():
        k[(m // bm, n // bn)](inputs["x"], out, m, n, BM=bm, BN=bn)
        return out

    _capture_and_break(case, inputs, launch, lambda: inputs["x"] * 2.0, "x")

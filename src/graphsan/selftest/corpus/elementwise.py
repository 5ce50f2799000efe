"""TensorIterator kernels with every operand shape it handles: strided, stepped, transposed,
broadcast and expanded views, many dimensions, casts, and reductions (one and two outputs,
global reductions across blocks). Their kernels take PyTorch's `OffsetCalculator` by value,
whose unused entries hold whatever the host stack held: the precision test of the scan.

Every twin drops the tensor a view was taken from, after the capture, and new tensors take its
memory."""

from __future__ import annotations

import torch

from graphsan.selftest import program
from graphsan.selftest.case import Case

SOURCE = (
    "PyTorch TensorIterator (aten/src/ATen/TensorIterator.cpp) and its CUDA loops "
    "(aten/src/ATen/native/cuda/CUDALoops.cuh, Reduce.cuh); pytorch test/test_cuda.py graph tests"
)


def _run(case: Case, inputs: dict[str, torch.Tensor], fn, victim: str, tol: float = 1e-5):
    """Capture `fn(**inputs)` (a list of tensors), replay it, compare with eager; the twin then
    drops `inputs[victim]` (and every view of it) and replays."""
    with torch.no_grad():
        g, outs = case.warmup_and_capture(lambda: fn(**inputs))
        for t in inputs.values():  # new values, same memory: the replay must see them
            if t.is_floating_point() or t.is_complex():
                t.mul_(1.5)
            else:
                t.add_(1)
        del t
        case.replay(g)
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(outs, fn(**inputs), strict=True)):
            if got.dtype in (torch.bool, torch.int64, torch.int32):
                case.check(torch.equal(got, want), f"output {i} equals eager")
            else:
                case.close(got, want, f"output {i} equals eager", tol)
        case.drop_and_replay(g, inputs, victim)


@program(
    "elementwise/strided-views",
    pattern="stepped, sliced and transposed operands: one to three dimensions left after "
    "coalescing, a power-of-two divisor alone, casts (the dynamic-cast loop)",
    source=SOURCE,
    bug="the base tensor of the captured views is dropped after the capture",
)
def strided_views(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {  # held by the dict alone, so that the twin's `del` frees them
        "base": torch.randn(64, 2048, device="cuda"),
        "other": torch.randn(1024, 64, device="cuda"),
        "line": torch.randn(1 << 16, device="cuda"),
    }

    def fn(base, other, line):
        a = base[:, ::2]  # two dimensions
        step = line[::4]  # one dimension, stride 4: the divisor is a power of two
        cube = base.view(64, 32, 64)[:, ::3, 1::2]  # three dimensions
        return [
            a * 2.0,
            a + other.t(),
            step * 3.0 + 1.0,
            torch.where(a > 0, a, other.t()),
            a.to(torch.bfloat16),
            torch.addcmul(a, a, other.t(), value=0.5),
            cube.clamp(-1.0, 1.0),
            torch.nn.functional.gelu(cube),
            step.to(torch.float64),
        ]

    _run(case, inputs, fn, "base", 1e-3)


@program(
    "elementwise/broadcast-expand",
    pattern="broadcast rows and columns, expanded views, 0-dim device tensors, three-dimensional "
    "broadcasting",
    source=SOURCE,
    bug="the broadcast bias is replaced by a new tensor after the capture",
)
def broadcast_expand(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "m": torch.randn(64, 1024, device="cuda"),
        "bias": torch.randn(1024, device="cuda"),
        "col": torch.randn(64, 1, device="cuda"),
        "scale": torch.tensor(0.75, device="cuda"),
        "a3": torch.randn(8, 1, 128, device="cuda"),
        "b3": torch.randn(1, 16, 128, device="cuda"),
    }

    def fn(m, bias, col, scale, a3, b3):
        return [
            m + bias,
            m * col,
            torch.addcmul(m, bias.expand(64, 1024), col.expand(64, 1024)),
            torch.lerp(m, bias.expand_as(m), 0.3),
            m * scale,
            a3 + b3,
            (a3 * b3).sigmoid(),
        ]

    _run(case, inputs, fn, "bias")


@program(
    "elementwise/many-dimensions",
    pattern="permuted tensors that keep 6 and 10 dimensions, integer, boolean and complex operands",
    source=SOURCE,
    bug="the permuted input is dropped after the capture",
)
def many_dimensions(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(2, 3, 4, 5, 6, 7, device="cuda"),
        "y": torch.randn(*([2] * 10), device="cuda"),
        "n": torch.randint(-100, 100, (48, 80), device="cuda"),
        "z": torch.randn(40, 64, dtype=torch.complex64, device="cuda"),
    }

    def fn(x, y, n, z):
        xp = x.permute(5, 3, 1, 0, 2, 4)
        yp = y.permute(9, 0, 8, 1, 7, 2, 6, 3, 5, 4)
        return [
            xp * 2.0 + 1.0,
            yp.exp(),
            n.t() * 3 + 1,
            (n.t() > 0) & (n.t() < 50),
            z.t() * z.t().conj(),
        ]

    _run(case, inputs, fn, "x", 1e-4)


@program(
    "reduce/strided-and-two-outputs",
    pattern="reductions over strided views: sum, mean, amax, argmax, max with indices and "
    "var_mean (two outputs), norm, logsumexp, a global sum across blocks, cumsum",
    source=SOURCE,
    bug="the reduced tensor is dropped after the capture",
)
def reductions(case: Case) -> None:
    torch.manual_seed(0)
    inputs = {
        "x": torch.randn(256, 1024, device="cuda"),
        "big": torch.randn(1 << 22, device="cuda"),
    }

    def fn(x, big):
        xt = x.t()
        values, indices = xt.max(dim=1)
        var, mean = torch.var_mean(x[:, ::2], dim=0)
        return [
            xt.sum(dim=0),
            x[::2].mean(dim=1),
            xt.amax(dim=1),
            x.argmax(dim=0),
            values,
            indices,
            var,
            mean,
            torch.linalg.vector_norm(xt, dim=0),
            torch.logsumexp(x[:, 1::2], dim=1),
            big.sum(),
            big[::3].abs().amax(),
            torch.cumsum(x, dim=1),
        ]

    _run(case, inputs, fn, "x", 1e-4)

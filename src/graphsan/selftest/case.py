"""What a selftest program is given: whether it is the broken twin, the usual capture steps, and
the means to say which memory the twin breaks and what the correct program must compute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Skip(Exception):
    """The program cannot run here (a feature this torch build or GPU lacks); the message says
    which."""


class Case:
    """One run of a program. `broken` is True for the twin."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.victims: list[tuple[int, int]] = []  # (address, bytes) the twin breaks
        self.kinds: set[str] = set()  # finding kinds that also name the twin's mistake
        self.failed: list[str] = []  # checks of the correct program that did not hold
        self.replays = 0

    # -- the documented capture steps -----------------------------------------------------------
    @staticmethod
    def warmup(fn: Callable[[], Any], iters: int = 3) -> Any:
        """Run `fn` on a side stream first, as PyTorch's CUDA-graph notes ask (lazy
        initialisation, cuBLAS handles and autotuning stay out of the capture)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        out = None
        with torch.cuda.stream(side):
            for _ in range(iters):
                out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    @staticmethod
    def eager_history() -> None:
        """Eager work on small tensors that die right after, as a real process does before it
        captures: the launches leave addresses of memory that is free now in the host stack,
        where the next launches build their argument structs (the slots those do not fill keep
        them). Small tensors, so that the freed blocks stay inside live segments."""
        parts = [torch.randn(17 + i % 5, device="cuda") for i in range(130)]
        torch._foreach_add_(parts, parts)
        torch._foreach_add(parts, parts)
        torch._foreach_addcmul_(parts, parts, parts, value=0.5)
        torch._foreach_mul_(parts, [1.0 + i % 3 for i in range(130)])
        torch._foreach_norm(parts)
        x = torch.randn(5, 6, 7, 8, device="cuda").permute(3, 1, 0, 2)
        torch.addcmul(x, x * 2.0, x + 1.0).sum(dim=(0, 2)).max(dim=0)
        torch.cat(parts)
        torch.cuda.synchronize()

    def capture(
        self, fn: Callable[[], Any], pool=None, stream=None
    ) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Capture `fn` into a new graph (after some eager history, as in any real process);
        its return value holds the graph's static outputs."""
        self.eager_history()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            out = fn()
        return g, out

    def warmup_and_capture(self, fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """`warmup(fn)` then `capture(fn)`, for a function that needs nothing reset between the
        two (no gradients to clear, no state to rewind)."""
        self.warmup(fn)
        return self.capture(fn)

    def replay(self, g: torch.cuda.CUDAGraph, times: int = 1) -> None:
        for _ in range(times):
            g.replay()
            self.replays += 1

    # -- what the twin breaks -------------------------------------------------------------------
    def victim(self, *tensors: torch.Tensor) -> None:
        """The memory behind these tensors is what the twin is about to break: call it before
        the mistake. The twin counts as caught only by a finding on this memory."""
        for t in tensors:
            storage = t.untyped_storage()
            self.victims.append((storage.data_ptr(), max(storage.nbytes(), 1)))

    def drop_and_replay(self, g: torch.cuda.CUDAGraph, inputs: dict, name: str) -> None:
        """The twin's usual mistake, then the replay it must be stopped at: the tensor
        `inputs[name]` is dropped after the capture (the dict held the only reference) and new
        tensors take its memory. The correct program only replays."""
        if self.broken:
            self.victim(inputs[name])
            del inputs[name]
            self.churn()
        self.replay(g)

    def expect(self, kind: str) -> None:
        """A finding of this kind names the twin's mistake wherever it points (the replay-order
        kind points at the re-carved range, not at a tensor the program holds)."""
        self.kinds.add(kind)

    @staticmethod
    def churn(nbytes: int = 1 << 22, count: int = 8) -> list[torch.Tensor]:
        """New tensors filled with values, as the next training step would make them: freed
        memory becomes someone else's (the twin's mistake then corrupts instead of reading
        leftovers)."""
        out = []
        for i in range(count):
            n = max(nbytes >> i, 512) // 4
            out.append(torch.full((n,), float(i + 1), device="cuda"))
        return out

    # -- what the correct program must compute --------------------------------------------------
    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failed.append(what)

    def close(self, got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
        """`got` equals `want` to a relative error of `tol` (of the whole tensor's norm)."""
        if got.is_complex():
            got, want = torch.view_as_real(got), torch.view_as_real(want)
        got, want = got.detach().double(), want.detach().double()
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        self.check(
            err <= tol and bool(torch.isfinite(got).all()), f"{what} (relative error {err:.2e})"
        )

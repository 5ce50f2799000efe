"""kernels/fastlaunch.py: the key of a launch holds what Triton specializes on, a key seen before
launches the compiled kernel with the arguments in parameter order, and anything the key cannot
pin goes through Triton. On CPU against a stand-in kernel; on the installed Triton, a real
quantize kernel compiled for sm_90 without a GPU, both launch paths reaching a stand-in launcher
with the same arguments (launch_convention.py); only on the checked Triton versions does the
fast path run at all; on the GPU (marked gpu) the quantize kernels through both paths, on aligned
and misaligned inputs, byte for byte."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from graphsan.lab.quant import NVFP4Options
from graphsan.lab.quant.kernels import fastlaunch
from tests.lab.compile_kernels import run_compiled
from tests.lab.kernel_checks import launchers


def test_the_key_holds_dtype_alignment_and_integer_classes():
    base = torch.zeros(64, dtype=torch.float32)
    spec = fastlaunch.spec
    assert spec(base) == spec(torch.ones(64))
    assert spec(base) != spec(base[1:])  # 4 bytes off: not 16-byte aligned
    assert spec(base) != spec(base.to(torch.bfloat16))
    assert [spec(v)[1] for v in (1, 16, 32, 17, 0)] == [1, 16, 16, 0, 16]
    assert spec(2**31 - 16) != spec(2**31)  # a 64-bit integer is another specialization
    assert spec(True) is True and spec(None) is None and spec(0.5) is float


@dataclass
class Param:
    name: str
    is_constexpr: bool
    default: object = None


class Compiled:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


class StandIn:
    """A kernel (x, n, BLOCK: constexpr, FLAG: constexpr = 7): its own launches are counted."""

    params = [Param("x", False), Param("n", False), Param("BLOCK", True), Param("FLAG", True, 7)]

    def __init__(self):
        self.launches = 0
        self.compiled = Compiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches += 1
            return self.compiled

        return run


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
    monkeypatch.setattr(fastlaunch, "current_device", lambda: 0)


def test_a_seen_key_launches_the_compiled_kernel_with_every_parameter_in_order(monkeypatch):
    k = StandIn()
    f = fastlaunch.FastKernel(k)
    x = torch.zeros(64)
    f[(4,)](x, 32, BLOCK=128, num_warps=4)
    assert k.launches == 1 and k.compiled.calls == []
    f[(5, 2)](x, 48, BLOCK=128, num_warps=4)  # n: another multiple of 16, the same key
    assert k.launches == 1
    assert k.compiled.calls == [((5, 2, 1), (x, 48, 128, 7))]
    for args, kwargs in (
        ((x, 33), dict(BLOCK=128, num_warps=4)),  # n not a multiple of 16
        ((x, 32), dict(BLOCK=256, num_warps=4)),  # another constexpr
        ((x, 32), dict(BLOCK=128, num_warps=8)),  # another option
        ((x[1:], 32), dict(BLOCK=128, num_warps=4)),  # misaligned
    ):
        before = k.launches
        f[(1,)](*args, **kwargs)
        assert k.launches == before + 1, (args, kwargs)
    monkeypatch.setattr(fastlaunch, "current_device", lambda: 1)  # another GPU's context
    f[(5, 2)](x, 48, BLOCK=128, num_warps=4)
    assert k.launches == 6


def test_what_the_key_cannot_pin_always_goes_through_triton(monkeypatch):
    k = StandIn()
    f = fastlaunch.FastKernel(k)
    x = torch.zeros(64)
    for _ in range(2):
        f[(1,)](x, 32, 128)  # BLOCK by position: the key would hold only its value class
        f[(1,)](x, n=32, BLOCK=128)  # a launch argument by keyword
    assert k.launches == 4 and k.compiled.calls == []
    monkeypatch.setattr(fastlaunch, "ENABLED", False)
    for _ in range(2):
        f[(1,)](x, 32, BLOCK=128)
    assert k.launches == 6 and k.compiled.calls == []


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.gpu
def test_compiled_launches_equal_tritons_on_aligned_and_misaligned_inputs(monkeypatch):
    pytest.importorskip("triton")
    tk = launchers()
    assert isinstance(tk.nv.nvfp4_col_fused_kernel, fastlaunch.FastKernel), (
        "this Triton is outside fastlaunch.CHECKED_TRITON, so the kernels launch through "
        "Triton's own path and there is no fast path to compare: widen the range to check it"
    )

    g = torch.Generator(device="cuda")
    big = torch.randn(
        4096 + 64, 256, device="cuda", dtype=torch.bfloat16, generator=g.manual_seed(1)
    )
    misaligned = big.view(-1)[1 : 1 + 4096 * 256].view(4096, 256)  # 2 bytes off
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(fastlaunch, "ENABLED", enabled)
        out = []
        for rep in range(2):  # the second round hits the keys the first one made
            for x in (big[:4096], misaligned, big[1:4097, 64:192]):
                q = tk.nv.nvfp4_quantize(x, 0, NVFP4Options(rht=True, generator=g.manual_seed(rep)))
                out += [q.data, q.scale, q.amax, tk.gemm.gemm_operand(q)]
                m = tk.mx.mxfp8_quantize(x, 0)
                out += [m.data, m.scale]
        results[enabled] = out
    assert len(tk.nv.nvfp4_col_fused_kernel.cache) > 0  # the fast path ran
    for a, b in zip(results[False], results[True], strict=True):
        assert torch.equal(bits(a), bits(b))


def test_the_installed_triton_is_a_checked_one():
    """The fast path runs only on the versions in CHECKED_TRITON; a newer (or older) Triton, as CI
    installs whatever is newest, falls back to Triton's own launch path, silently slower."""
    triton = pytest.importorskip("triton")
    low, high = (".".join(map(str, v)) for v in fastlaunch.CHECKED_TRITON)
    assert fastlaunch.checked(), (
        f"Triton {triton.__version__} is outside fastlaunch.CHECKED_TRITON ({low} to {high}), so "
        "its kernels launch through Triton's own path: run the launch-convention check on it "
        "(python -m tests.lab.launch_convention, with TRITON_INTERPRET=0) and, on a GPU, "
        "tests/lab/test_fastlaunch.py -m gpu; where both pass, widen CHECKED_TRITON"
    )


def test_the_fence_reads_versions_and_keeps_unchecked_ones_on_tritons_path(monkeypatch, caplog):
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    assert fastlaunch.triton_version("3.6.0") == (3, 6)
    assert fastlaunch.triton_version("3.10.0+git1234") == (3, 10)
    assert fastlaunch.triton_version("nightly") is None
    low, high = fastlaunch.CHECKED_TRITON
    assert fastlaunch.checked(f"{low[0]}.{low[1]}.0") and fastlaunch.checked(
        f"{high[0]}.{high[1]}.1"
    )
    assert not fastlaunch.checked(f"{high[0]}.{high[1] + 1}.0")
    assert not fastlaunch.checked(f"{low[0]}.{low[1] - 1}.0") and not fastlaunch.checked("dev")

    class Jit(JITFunction):  # a JITFunction without a function behind it
        def __init__(self):
            self.params = []

    monkeypatch.setattr(fastlaunch, "checked", lambda version=None: False)
    monkeypatch.setattr(fastlaunch, "_told", False)
    kernels = [Jit(), Jit()]
    with caplog.at_level(logging.DEBUG, logger=fastlaunch.__name__):
        assert [fastlaunch.fast(k) for k in kernels] == kernels  # Triton's own launch path
    lines = [r for r in caplog.records if r.name == fastlaunch.__name__]
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG
    message = lines[0].getMessage()
    import triton

    assert triton.__version__ in message and f"{low[0]}.{low[1]} to {high[0]}.{high[1]}" in message
    monkeypatch.setattr(fastlaunch, "checked", lambda version=None: True)
    assert isinstance(fastlaunch.fast(Jit()), fastlaunch.FastKernel)


@pytest.mark.slow
def test_the_launch_convention_holds_on_the_installed_triton():
    """Triton's own launch and FastKernel's reach the launcher with the same grid, stream and
    every argument in parameter order (launch_convention.py, compiled for sm_90 on CPU, in its
    own process: the kernels must not be interpreted). A Triton whose internals moved so that
    the stand-in driver cannot be installed fails here, naming the step."""
    pytest.importorskip("triton")
    proc = run_compiled("tests.lab.launch_convention")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("launch convention:")]
    assert proc.returncode == 0 and lines and " ok on Triton " in lines[-1], (
        (lines[-1] if lines else "no verdict") + "\n" + proc.stderr[-3000:]
    )

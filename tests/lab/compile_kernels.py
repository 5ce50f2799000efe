"""Every Triton kernel of the lab compiled for sm_90 on CPU, the way its launcher launches it on
a GPU: the compiler's own checks (types, constexprs, inline PTX, layouts) run on every machine
with Triton, not only where a GPU runs the kernels.

Triton's interpreter, which the CPU tests run the kernels in, never compiles them: a kernel that
computes the right bytes there can still fail to compile for the GPU. This program installs the
stand-in sm_90 driver of `tests/lab/launch_convention.py` (it records launches, runs nothing),
makes the launchers take the GPU's choices (`launch_common.compiled` and `hw_fp8_for` say yes),
and calls them on CPU tensors over the configurations the training uses: both MXFP8 formats,
NVFP4 with every option (2-D blocks, the legacy op order, RHT, stochastic rounding, row groups),
the GEMM operand kernels, the fused GEMM and the epilogue, on tiles that divide the shapes and
on ragged ones. Every `*_kernel` in `graphsan/lab/quant/kernels` must have been compiled at least
once, so a new kernel without a launch here fails too.

Run by tests/lab/test_kernels_compile.py in its own process (TRITON_INTERPRET must be off before
Triton is imported):

    TRITON_INTERPRET=0 PYTHONPATH=src python3 -m tests.lab.compile_kernels [--digest FILE]

Prints a line per kernel (its name and how many specializations were compiled), then
`kernels compile: ok on Triton X (...)` or `kernels compile: FAILED on Triton X: <launch>:
<the error and the source line it points at>`, and exits 0 or 1. Another Triton is checked by
putting it first on the path (`pip install --target DIR triton==3.6.*`, then
`PYTHONPATH=DIR:src`), as CI does for the GPU machine's. What compiled is kept in Triton's
cache under ~/.cache/graphsan/compile-kernels: a kernel whose source, options, target and
Triton are unchanged is not compiled again (with `--digest`, a fresh cache of this run).

The launches run lean by default: not every combination of shape, source dtype, option and path,
but rows chosen so that every compile-time parameter of every kernel takes each value the full
set gives it. `--full` compiles every combination; `--lean-gaps` compiles both and lists what
only the full set reached (run it when a kernel gains a flag). `--digest FILE` writes one line
per specialization, the kernel's name and a hash of its PTX without line information, sorted:
two trees whose kernels compile to the same code write the same file (with `--full`, a check for
refactors of the kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path

SM90 = "sm_90"


def run_compiled(module: str, *args: str, triton_home: str = "") -> subprocess.CompletedProcess:
    """`python -m module args` in its own process with the kernels compiled, not interpreted
    (the CPU tests set TRITON_INTERPRET=1 for their own process), from the repository root;
    `triton_home`: a folder holding another Triton to put first on the path."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0")
    paths = [triton_home] if triton_home else []
    paths += [str(root / "src"), str(root), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


class CompileFailed(Exception):
    """A launch whose kernels did not compile, or a kernel that no launch compiled."""


def _what_failed(err: BaseException) -> str:
    """The innermost error in one line: for Triton's compile errors, the error and the source
    line it points at (its message is the source, a `^` under the column, then the error)."""
    while err.__cause__ is not None:
        err = err.__cause__
    lines = [ln.rstrip() for ln in str(err).splitlines() if ln.strip()]
    marks = [i for i, ln in enumerate(lines) if ln.strip() == "^"]
    if marks and marks[-1] > 0:
        at = marks[-1]
        why = " ".join(ln.strip() for ln in lines[at + 1 :]) or type(err).__name__
        return f"{why} at `{lines[at - 1].strip()}`"[:400]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


def gpu_choices() -> None:
    """The launchers take the GPU's choices for CPU tensors: compiled kernels, the hardware
    FP8 conversion of sm_90."""
    from graphsan.lab.quant.kernels import (
        fastlaunch,
        launch_common,
        launch_gemm,
        launch_mxfp8,
        launch_nvfp4,
    )

    for mod in (launch_common, launch_gemm, launch_mxfp8, launch_nvfp4):
        if hasattr(mod, "compiled"):
            mod.compiled = lambda x: True
        if hasattr(mod, "hw_fp8_for"):
            mod.hw_fp8_for = lambda x: True
    fastlaunch.current_device = lambda: 0  # torch has no CUDA device here


EVEN_MX, RAGGED_MX = (128, 256), (96, 160)  # MXFP8: every tile divides the first, none the second
EVEN_NV, RAGGED_NV = (128, 256), (48, 80)  # NVFP4 likewise


def _source(shape, dtype):
    import torch

    m, k = shape
    if dtype == "bf16-transposed":  # a column stride other than one: the strided kernels
        return torch.randn(k, m).to(torch.bfloat16).t()
    return torch.randn(m, k).to(torch.bfloat16 if dtype == "bf16" else torch.float32)


def _two_groups(rows: int):
    """Each row's group, int64: the first half of the rows in group 0, the rest in group 1."""
    import torch

    return (torch.arange(rows) >= rows // 2).to(torch.int64)


def _nvfp4_options() -> dict:
    import torch

    from graphsan.lab.quant import NVFP4Options

    g = torch.Generator().manual_seed(0)
    return {
        "1d": NVFP4Options(),
        "1d legacy": NVFP4Options(order="legacy"),
        "2d": NVFP4Options(block_2d=True),
        "2d legacy": NVFP4Options(block_2d=True, order="legacy"),
        "rht": NVFP4Options(rht=True),
        "sr": NVFP4Options(generator=g),
        "rht+sr": NVFP4Options(rht=True, generator=g),
        "rht+sr legacy": NVFP4Options(rht=True, generator=g, order="legacy"),
    }


def _plans(full: bool, even, ragged, names, lean):
    """(shape, source dtype, names, strided values, with the joint launches) to launch: every
    combination with `full`, else the `lean` rows, which reach every kernel and every value of
    each of its compile-time flags at least once."""
    if not full:
        return lean
    dtypes = ("bf16", "fp32", "bf16-transposed")
    return [(s, d, names, (False, True), True) for s in (even, ragged) for d in dtypes]


def _mxfp8_launches(full: bool):
    from graphsan.lab.quant.kernels import launch_mxfp8 as lm

    lean = [
        (EVEN_MX, "bf16", ("e4m3",), (False,), True),
        (RAGGED_MX, "fp32", ("e5m2",), (False,), True),
        (EVEN_MX, "bf16", ("e5m2",), (True,), False),
    ]
    for shape, dtype, fmts, strided_values, joint in _plans(
        full, EVEN_MX, RAGGED_MX, ("e4m3", "e5m2"), lean
    ):
        x = _source(shape, dtype)
        for fmt in fmts:
            for strided in strided_values:
                tag = f"mxfp8 {fmt} {dtype} {shape}{' strided' if strided else ''}"
                yield f"{tag} rowwise", partial(lm.mxfp8_quantize, x, -1, fmt, _strided=strided)
                yield f"{tag} columnwise", partial(lm.mxfp8_quantize, x, 0, fmt, _strided=strided)
                if joint:
                    yield f"{tag} both", partial(lm.mxfp8_quantize_both, x, fmt, _strided=strided)


def _nvfp4_launches(full: bool):
    import torch

    from graphsan.lab.quant.kernels import launch_nvfp4 as ln

    options = _nvfp4_options()
    lean = [
        (EVEN_NV, "bf16", tuple(options), (False,), True),
        (EVEN_NV, "bf16", ("1d", "2d", "sr"), (True,), False),
        (RAGGED_NV, "fp32", ("1d", "2d legacy", "sr", "rht+sr"), (False,), True),
        (RAGGED_NV, "bf16-transposed", ("1d", "sr"), (False,), True),
    ]
    for shape, dtype, names, strided_values, joint in _plans(
        full, EVEN_NV, RAGGED_NV, tuple(options), lean
    ):
        x = _source(shape, dtype)
        groups = _two_groups(shape[0])
        for name in names:
            opt = options[name]
            tag = f"nvfp4 {name} {dtype} {shape}"
            for axis in (-1, 0) if not opt.rht else (0,):  # RHT: columnwise (wgrad) copies only
                d = "rowwise" if axis else "columnwise"
                for strided in strided_values:
                    label = f"{tag} {d}{' strided' if strided else ''}"
                    yield label, partial(ln.nvfp4_quantize, x, axis, opt, _strided=strided)
                if joint:
                    yield (
                        f"{tag} {d} grouped",
                        partial(ln.nvfp4_quantize_grouped, x, groups, 2, axis, opt),
                    )
            if joint and not opt.block_2d:
                yield f"{tag} both", partial(ln.nvfp4_quantize_both, x, opt)
                yield (
                    f"{tag} both grouped",
                    partial(ln.nvfp4_quantize_grouped_both, x, groups, 2, opt),
                )
    big = torch.empty(4096 * 16 * 64, dtype=torch.bfloat16)  # global_amax's many-rounds tile
    yield "nvfp4 global amax, large", partial(ln.global_amax, big)


def _gemm_launches(full: bool):
    """The operand kernels for each kind and direction, contiguous and strided; the fused GEMM;
    the epilogue in its modes, written, added into main_grad, per row group, per group of a
    grouped weight gradient."""
    import torch

    from graphsan.lab.quant.kernels import launch_gemm as lg
    from graphsan.lab.quant.kernels import launch_mxfp8 as lm
    from graphsan.lab.quant.kernels import launch_nvfp4 as ln
    from graphsan.lab.quant.recipe import RowGroups

    m, k, n = 128, 256, 192
    x, w = _source((m, k), "bf16"), _source((n, k), "bf16")
    operands = {
        "nvfp4 rowwise": ln.nvfp4_quantize(x, -1),
        "nvfp4 columnwise": ln.nvfp4_quantize(x, 0),
        "mxfp8 e4m3 rowwise": lm.mxfp8_quantize(x, -1, "e4m3"),
        "mxfp8 e4m3 columnwise": lm.mxfp8_quantize(x, 0, "e4m3"),
        "mxfp8 e5m2 columnwise": lm.mxfp8_quantize(x, 0, "e5m2"),
    }
    for name, q in operands.items():
        yield f"gemm operand {name}", partial(lg.gemm_operand, q)
        yield f"gemm operand {name} strided", partial(lg.gemm_operand, q, _strided=True)
    alpha = torch.ones((), dtype=torch.float32)
    for fmt, a, b in (
        ("nvfp4", ln.nvfp4_quantize(x, -1), ln.nvfp4_quantize(w, -1)),
        ("mxfp8", operands["mxfp8 e4m3 rowwise"], lm.mxfp8_quantize(w, -1, "e4m3")),
    ):
        yield f"fused gemm {fmt}", partial(lg.quantized_mm, a, b, False, True, None)
        acc = torch.zeros(m, n)
        yield (
            f"fused gemm {fmt}, alpha, accumulated",
            partial(lg.quantized_mm, a, b, False, True, alpha, acc),
        )
    c, one = torch.randn(m, n), torch.ones(())
    rows, per_group = RowGroups(_two_groups(m), 2), torch.ones(2)
    offsets = torch.tensor([m // 2, m], dtype=torch.int32)
    grouped_c = c.view(2, m // 2, n)
    for mode in (0, 1, 2):
        yield f"gemm epilogue mode {mode}", partial(lg.gemm_epilogue, c, one, one, mode)
        if full or mode == 2:
            yield (
                f"gemm epilogue mode {mode} into main_grad",
                partial(lg.gemm_epilogue, c, one, one, mode, torch.zeros(m, n)),
            )
            yield (
                f"gemm epilogue mode {mode} row groups",
                partial(lg.gemm_epilogue, c, per_group, per_group, mode, None, rows),
            )
            wgrad = torch.zeros(2, m // 2, n)
            yield (
                f"gemm epilogue mode {mode} grouped wgrad",
                partial(
                    lg.gemm_epilogue, grouped_c, per_group, per_group, mode, wgrad, None, offsets
                ),
            )


def launches(full: bool = False):
    """(label, call) for every launch this check makes; each call compiles what it launches.
    `full`: every combination of shape, source dtype, option and path (for `--digest`)."""
    yield from _mxfp8_launches(full)
    yield from _nvfp4_launches(full)
    yield from _gemm_launches(full)


def lab_kernels() -> set[str]:
    """The names of every `*_kernel` JIT function in the lab's kernel modules."""
    from triton.runtime.jit import JITFunction

    from graphsan.lab.quant.kernels import gemm, mxfp8, nvfp4, nvfp4_col, nvfp4_words, qgemm

    names = set()
    for mod in (mxfp8, nvfp4, nvfp4_words, nvfp4_col, gemm, qgemm):
        for name, obj in vars(mod).items():
            if name.endswith("_kernel") and isinstance(obj, JITFunction):
                names.add(name)
    return names


class Compiles:
    """What the stand-in driver saw compiled: specializations per kernel, and the values each
    compile-time parameter of each kernel took."""

    def __init__(self) -> None:
        self.count: Counter = Counter()
        self.values: dict[tuple[str, str], set] = {}

    def add(self, src, name: str) -> None:
        self.count[name] += 1
        fn = getattr(src, "fn", None)
        constants = getattr(src, "constants", None) or {}
        if fn is None:
            return
        constexpr = {p.name for p in fn.params if p.is_constexpr}
        for key, value in constants.items():
            arg = fn.arg_names[key[0]] if isinstance(key, tuple) else key
            if arg in constexpr:
                self.values.setdefault((name, arg), set()).add(repr(value))

    def snapshot(self) -> dict[tuple[str, str], set]:
        return {k: set(v) for k, v in self.values.items()}


def check(full: bool = False, compiles: Compiles | None = None) -> Compiles:
    """Compile every launch (all combinations with `full`) into `compiles`."""
    from tests.lab.launch_convention import Recorder, StandInDriver, install_stand_in

    seen = compiles or Compiles()

    class Compiled(Recorder):
        def __init__(self, src, metadata):
            super().__init__(src, metadata)
            seen.add(src, self.name)

    StandInDriver.launcher_cls = Compiled
    install_stand_in()
    gpu_choices()
    for label, call in launches(full):
        try:
            call()
        except Exception as err:
            raise CompileFailed(f"{label}: {_what_failed(err)}") from err
    missing = lab_kernels() - set(seen.count)
    if missing:
        raise CompileFailed(
            f"no launch here compiled {', '.join(sorted(missing))}: add one to launches()"
        )
    return seen


def lean_gaps() -> list[str]:
    """The compile-time values that only the full set reaches (`kernel FLAG=value`): what the
    lean rows of `launches` miss. Compiles both sets (a few minutes)."""
    seen = check(full=False)
    lean = seen.snapshot()
    check(full=True, compiles=seen)  # the lean rows are among the full set's combinations
    return sorted(
        f"{kernel} {arg}={value}"
        for (kernel, arg), values in seen.values.items()
        for value in values - lean.get((kernel, arg), set())
    )


def digest(cache_dir: str) -> list[str]:
    """`name sha256` of every PTX in Triton's cache, line information left out, sorted."""
    lines = []
    for ptx in Path(cache_dir).rglob("*.ptx"):
        text = ptx.read_text()
        body = "\n".join(
            ln for ln in text.splitlines() if not ln.lstrip().startswith((".loc", ".file", "//"))
        )
        lines.append(f"{ptx.stem} {hashlib.sha256(body.encode()).hexdigest()[:16]}")
    return sorted(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--digest", help="write each specialization's PTX hash to this file")
    ap.add_argument(
        "--lean-gaps",
        action="store_true",
        help="compile the lean set and then every combination, and list the compile-time "
        "values only the latter reached (run it when a kernel gains a flag)",
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="every combination of shape, source dtype, option and path, not only enough to "
        "reach every compile-time flag (a few minutes)",
    )
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("kernels compile: FAILED: TRITON_INTERPRET is on, the kernels would be interpreted")
        return 1
    if args.digest or args.lean_gaps:  # the digest reads every PTX of this run's cache only
        cache = tempfile.mkdtemp(prefix="compile-kernels-")
    else:
        # Triton keys its cache on the kernel's source, the options, the target and its own
        # version: a kernel found there compiled from the same inputs, and need not again
        cache = os.path.join(os.path.expanduser("~"), ".cache", "graphsan", "compile-kernels")
    os.environ["TRITON_CACHE_DIR"] = cache
    os.environ.setdefault("TRITON_DISABLE_LINE_INFO", "1")
    try:
        import triton
    except ImportError as err:
        print(f"kernels compile: FAILED: Triton does not import ({err})")
        return 1
    try:
        if args.lean_gaps:
            gaps = lean_gaps()
            print("\n".join(gaps) or "the lean set reaches every compile-time value")
            return 1 if gaps else 0
        compiled = check(args.full).count
    except CompileFailed as err:
        print(f"kernels compile: FAILED on Triton {triton.__version__}: {err}")
        return 1
    for name, count in sorted(compiled.items()):
        print(f"{name}: {count} specializations")
    if args.digest:
        Path(args.digest).write_text("\n".join(digest(cache)) + "\n")
    total = sum(compiled.values())
    print(
        f"kernels compile: ok on Triton {triton.__version__} ({len(compiled)} kernels, "
        f"{total} specializations, {SM90})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

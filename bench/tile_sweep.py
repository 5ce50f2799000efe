"""Sweep the quantize kernels' fixed launch parameters on one size x size bf16 tensor (CUDA only).

    PYTHONPATH=src python3 bench/tile_sweep.py [--size 8192] [--iters 10]

For the NVFP4 column kernels (bf16 words, strided, and the fused RHT/SR kernel of the wgrad
operands), the MXFP8 row+col words kernel and the GEMM-operand dequantization kernels
(`gemm_operand`, the "dequant" rows), the current parameters (the `kernels.launch_*` modules'
`NVFP4_COL_WORDS_TILE`, `MXFP8_WORDS_BOTH_TILE`, `DEQUANT_NVFP4_TILE`, ...) and a few
alternatives, timed the way bench_quant times them (device time, calls replayed from a CUDA
graph) and checked byte for byte against the current parameters' output; prints the time and the
fraction of the device copy bandwidth of each, and the ratio to the current parameters. The
bytes do not depend on the tile (every reduction stays inside one block), so the fastest correct
row is a safe default; bench_quant then times the kernel families side by side. The stochastic
rounding rows draw their seed from the device's default generator, reset to one state before
each byte comparison (outside the timing, which replays the calls from a CUDA graph). The
dequant rows also time the strided kernel every operand ran before ("strided (before)") and
compare every row's bits with the torch dequantization itself; their bytes per element are the
packed operand read and the bf16 written. `--only dequant` runs those rows alone.
"""

from __future__ import annotations

import argparse

import torch
from quant_timing import amax_pass_both, bench_device, launchers, same_bytes

from graphsan.lab.quant import NVFP4Options, kernels

NVFP4_BYTES = 2 + 0.5 + 1 / 16  # per element: the bf16 read, the nibble and the scale written
NV_COL_WORDS_TILES = [
    {"NB": 8, "CW": 32, "num_warps": 4},
    {"NB": 4, "CW": 32, "num_warps": 2},
    {"NB": 4, "CW": 64, "num_warps": 4},
    {"NB": 2, "CW": 64, "num_warps": 2},
    {"NB": 8, "CW": 16, "num_warps": 2},
    {"NB": 16, "CW": 16, "num_warps": 4},
    {"NB": 8, "CW": 64, "num_warps": 4},
    {"NB": 16, "CW": 32, "num_warps": 8},
]

# The fused column kernel's quantize pass (RHT and/or SR): the launch tile has 64 values a thread
# (about 128 registers); 128 a thread needs 227-255 registers (half the warps per SM).
NV_COL_FUSED_TILES = [
    {"NB": 8, "BK": 64, "num_warps": 2},
    {"NB": 8, "BK": 64, "num_warps": 4},
    {"NB": 4, "BK": 64, "num_warps": 2},
    {"NB": 8, "BK": 32, "num_warps": 2},
    {"NB": 4, "BK": 32, "num_warps": 1},
    {"NB": 16, "BK": 64, "num_warps": 4},
    {"NB": 8, "BK": 128, "num_warps": 4},
    {"NB": 4, "BK": 32, "num_warps": 2},
]
# Its RHT amax pass (NVFP4_COL_AMAX_TILE: loads, the transform and a maximum; 128 registers at
# 128 values a thread, 56-64 at 64, 40 at 32; ITERS tiles a program, one atomic at the end):
# the whole RHT operation is timed, the quantize pass on its current tile.
# The same tiles with a register cap (`maxnreg`), so that more programs fit an SM: 96 gives 5
# programs of 4 warps where 121 registers give 4 (spilling a little).
NV_COL_FUSED_CAPPED = [
    {"NB": 8, "BK": 64, "num_warps": 4, "maxnreg": 96},
    {"NB": 4, "BK": 64, "num_warps": 2, "maxnreg": 96},
]
NV_COL_AMAX_TILES = [
    {"NB": 8, "BK": 64, "ITERS": 4, "num_warps": 4},
    {"NB": 8, "BK": 64, "ITERS": 8, "num_warps": 4},
    {"NB": 8, "BK": 64, "ITERS": 4, "num_warps": 2},
    {"NB": 4, "BK": 64, "ITERS": 8, "num_warps": 2},
    {"NB": 8, "BK": 128, "ITERS": 4, "num_warps": 4},
    {"NB": 4, "BK": 64, "num_warps": 2},
    {"NB": 8, "BK": 64, "num_warps": 4},
    {"NB": 8, "BK": 32, "num_warps": 2},
    {"NB": 4, "BK": 32, "num_warps": 2},
    {"NB": 16, "BK": 64, "num_warps": 4},
    {"NB": 8, "BK": 128, "num_warps": 4},
]


# gemm_operand's contiguous dequantization kernels (kernels/gemm.py). NVFP4 BLOCK: data bytes
# a program (4 a thread per 16-byte store); MXFP8 rowwise BLOCK: elements (8 a thread); MXFP8
# columnwise: R rows (a divisor of 32) by 256 x num_warps columns a program.
DEQUANT_NVFP4_TILES = [
    {"BLOCK": 2048, "num_warps": 4},
    {"BLOCK": 1024, "num_warps": 4},
    {"BLOCK": 4096, "num_warps": 4},
    {"BLOCK": 512, "num_warps": 4},
    {"BLOCK": 2048, "num_warps": 8},
    {"BLOCK": 4096, "num_warps": 8},
    {"BLOCK": 1024, "num_warps": 2},
]
DEQUANT_ROW_TILES = [
    {"BLOCK": 4096, "num_warps": 4},
    {"BLOCK": 2048, "num_warps": 4},
    {"BLOCK": 8192, "num_warps": 4},
    {"BLOCK": 1024, "num_warps": 4},
    {"BLOCK": 4096, "num_warps": 8},
    {"BLOCK": 8192, "num_warps": 8},
    {"BLOCK": 2048, "num_warps": 2},
]
DEQUANT_COL_TILES = [
    {"R": 8, "num_warps": 4},
    {"R": 4, "num_warps": 4},
    {"R": 16, "num_warps": 4},
    {"R": 2, "num_warps": 4},
    {"R": 8, "num_warps": 2},
    {"R": 8, "num_warps": 8},
    {"R": 16, "num_warps": 8},
]
NVFP4_OPERAND_BYTES = 0.5 + 1 / 16 + 2  # per element: the nibble and scale read, the bf16 written
MXFP8_OPERAND_BYTES = 1 + 1 / 32 + 2


# name: (operand, parameter dict in kernels.launch_gemm, alternatives, bytes moved per element)
DEQUANT_SWEEPS = {
    "dequant nvfp4 (every kind)": (
        "nvfp4",
        "DEQUANT_NVFP4_TILE",
        DEQUANT_NVFP4_TILES,
        NVFP4_OPERAND_BYTES,
    ),
    "dequant mxfp8 e4m3 rowwise": (
        "e4m3 row",
        "DEQUANT_MXFP8_ROW_TILE",
        DEQUANT_ROW_TILES,
        MXFP8_OPERAND_BYTES,
    ),
    "dequant mxfp8 e5m2 rowwise": (
        "e5m2 row",
        "DEQUANT_MXFP8_ROW_TILE",
        DEQUANT_ROW_TILES[:3],
        MXFP8_OPERAND_BYTES,
    ),
    "dequant mxfp8 e4m3 columnwise": (
        "e4m3 col",
        "DEQUANT_MXFP8_COL_TILE",
        DEQUANT_COL_TILES,
        MXFP8_OPERAND_BYTES,
    ),
}


def _operand(name: str, x: torch.Tensor):
    """The packed operand a dequantization row reads (QuantLinear's kinds), made untimed."""
    from graphsan.lab.quant import mxfp8, nvfp4

    if name == "nvfp4":
        return nvfp4.quantize(x, -1)
    fmt, direction = name.split()
    return mxfp8.quantize(x, -1 if direction == "row" else 0, fmt)


def sweep_dequant(tk, x, copy_bw, iters, names) -> None:
    """`gemm_operand` at each tile of its contiguous kernels and with the strided kernel that
    every operand ran before (`_strided=True`), each checked bit for bit against the torch
    dequantization (`gemm_operand_reference`), not only against the current tile."""
    from graphsan.lab.quant.gemm import gemm_operand_reference

    for name in names:
        key, attr, alts, per_elem = DEQUANT_SWEEPS[name]
        q = _operand(key, x)
        ref = gemm_operand_reference(q)
        current = dict(getattr(tk.gemm, attr))
        runs = [(None, current, False), ("strided (before)", current, True)]
        runs += [(None, cfg, False) for cfg in alts if cfg != current]
        t_cur = None
        for label, cfg, strided in runs:
            setattr(tk.gemm, attr, cfg)
            try:
                out = tk.gemm.gemm_operand(q, _strided=strided)
                t = bench_device(
                    lambda q=q, strided=strided: tk.gemm.gemm_operand(q, _strided=strided), iters
                )
            except Exception as err:
                print(
                    f"| {name} | {label or cfg} | - | - | - | {type(err).__name__}: {str(err)[:80]} |"
                )
                continue
            finally:
                setattr(tk.gemm, attr, current)
            t_cur = t_cur or t
            frac = per_elem * x.numel() / t / copy_bw
            tag = " (current)" if cfg == current and not strided else ""
            print(
                f"| {name} | {label or cfg}{tag} | {t * 1e3:.3f} | {frac:.0%} | {t_cur / t:.2f}x | "
                f"{'yes' if same_bytes(out, ref) else 'NO'} |"
            )
        del ref


def _default_generator() -> torch.Generator:
    return torch.cuda.default_generators[torch.cuda.current_device()]


def _reseed() -> None:
    _default_generator().manual_seed(1234)


def _sr(rht: bool = False) -> NVFP4Options:
    """Stochastic rounding on the device's default generator (and the RHT where asked)."""
    return NVFP4Options(rht=rht, generator=_default_generator())


_GIVEN = {}  # the post-RHT amax of the input, taken once in main


SWEEPS = {
    # name: (parameter dict in a kernels.launch_* module, alternatives, call, bytes per element)
    "nvfp4 columnwise 1D": (
        "NVFP4_COL_WORDS_TILE",
        NV_COL_WORDS_TILES,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, amax=amax),
        NVFP4_BYTES,
    ),
    "nvfp4 columnwise 2D": (
        "NVFP4_COL_WORDS_TILE",
        NV_COL_WORDS_TILES,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, NVFP4Options(block_2d=True), amax=amax),
        NVFP4_BYTES,
    ),
    "nvfp4 columnwise 1D, strided": (
        "NVFP4_COL_STRIDED_TILE",
        [
            {"BM": 256, "BK": 64, "num_warps": 4},
            {"BM": 128, "BK": 64, "num_warps": 4},
            {"BM": 256, "BK": 128, "num_warps": 8},
            {"BM": 256, "BK": 32, "num_warps": 2},
            {"BM": 512, "BK": 64, "num_warps": 8},
            {"BM": 128, "BK": 128, "num_warps": 4},
        ],
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, amax=amax, _strided=True),
        NVFP4_BYTES,
    ),
    "nvfp4 col RHT+SR fused (wgrad dY)": (
        "NVFP4_COL_FUSED_TILE",
        NV_COL_FUSED_TILES,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, _sr(rht=True)),
        NVFP4_BYTES,
        _reseed,
    ),
    "nvfp4 col RHT+SR quantize pass, post-RHT amax given": (
        "NVFP4_COL_FUSED_TILE",
        NV_COL_FUSED_TILES + NV_COL_FUSED_CAPPED,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, _sr(rht=True), _GIVEN["post"]),
        NVFP4_BYTES,
        _reseed,
    ),
    "nvfp4 RHT amax pass, plain amax too": (
        "NVFP4_COL_AMAX_TILE",
        NV_COL_AMAX_TILES,
        lambda tk, x, amax: amax_pass_both(tk, x),
        2,
    ),
    "nvfp4 col RHT fused (wgrad X)": (
        "NVFP4_COL_FUSED_TILE",
        NV_COL_FUSED_TILES,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, NVFP4Options(rht=True)),
        NVFP4_BYTES,
    ),
    "nvfp4 col RHT fused, amax pass tile (wgrad X)": (
        "NVFP4_COL_AMAX_TILE",
        NV_COL_AMAX_TILES,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, NVFP4Options(rht=True)),
        NVFP4_BYTES,
    ),
    "nvfp4 col SR fused": (
        "NVFP4_COL_FUSED_TILE",
        NV_COL_FUSED_TILES,
        lambda tk, x, amax: tk.nv.nvfp4_quantize(x, 0, _sr()),
        NVFP4_BYTES,
        _reseed,
    ),
    "mxfp8 row+col": (
        "MXFP8_WORDS_BOTH_TILE",
        [
            {"SPLIT": 4, "G": 2, "CW": 32, "num_warps": 2},
            {"SPLIT": 8, "G": 2, "CW": 16, "num_warps": 2},
            {"SPLIT": 4, "G": 4, "CW": 16, "num_warps": 4},
            {"SPLIT": 2, "G": 2, "CW": 32, "num_warps": 2},
        ],
        lambda tk, x, amax: tk.mx.mxfp8_quantize_both(x),
        2 + 2 + 2 / 32,
    ),
}


def _tile_home(tk, attr: str):
    """The launcher module that holds the launch parameters `attr`."""
    return next(m for m in (tk.nv, tk.mx, tk.gemm) if hasattr(m, attr))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--only",
        nargs="+",
        metavar="PREFIX",
        help="sweep only the rows whose name starts with one of these (e.g. dequant)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tile_sweep: needs CUDA")
    if not kernels.available():
        raise SystemExit("tile_sweep: needs Triton")
    tk = launchers()

    torch.manual_seed(0)
    x = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(x)
    copy_bw = 4 * x.numel() / bench_device(lambda: dst.copy_(x), args.iters)
    amax = tk.nv.global_amax(x)
    _GIVEN["post"] = tk.nv.nvfp4_quantize(x, 0, NVFP4Options(rht=True)).amax
    print(
        f"# {torch.cuda.get_device_name()}, {args.size}x{args.size} bf16, copy {copy_bw / 1e9:.0f} GB/s"
    )
    print("| kernel | parameters | ms | of copy bw | vs current | bytes equal |")
    print("|---|---|---|---|---|---|")
    wanted = lambda name: not args.only or any(name.startswith(p) for p in args.only)  # noqa: E731
    for name, (attr, alts, call, per_elem, *prepare) in SWEEPS.items():
        if not wanted(name):
            continue
        reset = prepare[0] if prepare else (lambda: None)
        home = _tile_home(tk, attr)
        current = dict(getattr(home, attr))
        reset()
        ref = call(tk, x, amax)
        t_cur = None
        for cfg in [current] + [c for c in alts if c != current]:
            setattr(home, attr, cfg)
            try:
                reset()
                out = call(tk, x, amax)
                t = bench_device(lambda call=call: call(tk, x, amax), args.iters)
            except Exception as err:  # a tile Triton cannot compile (too many registers, ...)
                print(f"| {name} | {cfg} | - | - | - | {type(err).__name__}: {str(err)[:80]} |")
                continue
            finally:
                setattr(home, attr, current)
            t_cur = t_cur or t
            frac = per_elem * x.numel() / t / copy_bw
            tag = " (current)" if cfg == current else ""
            print(
                f"| {name} | {cfg}{tag} | {t * 1e3:.3f} | {frac:.0%} | {t_cur / t:.2f}x | "
                f"{'yes' if same_bytes(out, ref) else 'NO'} |"
            )
    sweep_dequant(tk, x, copy_bw, args.iters, [n for n in DEQUANT_SWEEPS if wanted(n)])


if __name__ == "__main__":
    main()

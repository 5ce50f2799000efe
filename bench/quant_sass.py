"""Instruction counts of the quantize kernels, compiled offline for sm_90 (no GPU needed).

    PYTHONPATH=src python3 bench/quant_sass.py [--size 8192] [--kernels strided words fused
        dequant] [--mix] [--fused-tile NB BK WARPS] [--amax-tile NB BK WARPS]
        [--dequant-tiles] [--dump DIR]

Each Triton quantize kernel (the strided family, the bf16-words family, and "fused": the NVFP4
column kernel with RHT and/or SR, both of its passes, next to the rowwise SR words kernel and the
plain column words kernel), and with `--kernels dequant` the GEMM-operand dequantization kernels
(`launch_gemm.gemm_operand`: the contiguous NVFP4, MXFP8 rowwise and columnwise kernels next to the
strided one every operand ran before; "elements" there are output bf16 values), is compiled the way a launch on a size x size bf16 tensor specialises
it (integer arguments divisible by 16 marked so, a unit stride made a constant, fp contraction off
as the launcher asks), disassembled with Triton's bundled cuobjdump, and summarised: SASS
instructions per element (static count x threads per program / elements per program: the kernels
have no loops, so this is what every thread issues; "without slow path" leaves out the code after
the last EXIT, which only the IEEE division's rare slow path reaches), registers per thread, shared memory, and the
memory instructions (load/store widths, shared-memory round trips, shuffles, barriers). A proxy
for the GPU time of instruction-bound kernels, and a check of the access pattern; not a timing.
--mix adds each kernel's instruction mix per element, grouped by the unit or the purpose the
opcodes mostly serve (float arithmetic, integer multiply and logic for Philox and bit fields,
conversions, which run at a quarter or less of the float rate on sm_90); --dump writes each
kernel's SASS to DIR.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from graphsan.lab.quant.formats import FP8_BITS, INV_6, fp32_reciprocal
from graphsan.lab.quant.kernels import gemm as gemm_kernels
from graphsan.lab.quant.kernels import launch_gemm, launch_mxfp8, launch_nvfp4
from graphsan.lab.quant.kernels import mxfp8 as mx_kernels
from graphsan.lab.quant.kernels import nvfp4 as nv_kernels
from graphsan.lab.quant.kernels import nvfp4_words as nv_words
from graphsan.lab.quant.kernels.nvfp4_col import nvfp4_col_amax_kernel, nvfp4_col_fused_kernel

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
MEMORY_OPS = re.compile(r"(LDG|STG|LDS|STS|LDSM|STSM|LDL|STL|ATOM|RED|BAR|SHFL)")
# Opcode groups of the --mix table; an opcode in none of them counts as "other".
MIX = {
    "FADD/FMUL/FFMA": ("FADD", "FMUL", "FFMA"),
    "FSETP/FSEL/FMNMX": ("FSETP", "FSEL", "FMNMX"),
    "IMAD": ("IMAD",),
    "IADD3/LEA": ("IADD3", "LEA", "IABS", "IMNMX", "VIMNMX"),
    "LOP3/SHF/PRMT": ("LOP3", "SHF", "PRMT", "SHL", "SHR", "BMSK"),
    "ISETP/SEL": ("ISETP", "SEL"),
    "MOV": ("MOV", "S2R", "S2UR", "CS2R", "ULDC", "UMOV", "R2UR"),
    "I2F/F2I/FRND/F2F": ("I2F", "F2I", "FRND", "F2F", "F2FP", "I2FP", "F2IP"),
    "memory": ("LDG", "STG", "LDS", "STS", "ATOM", "RED", "SHFL", "BAR", "LDL", "STL"),
}


def compile_sm90(fn, args, consts, num_warps, maxnreg=None):
    """args: (name, type, value) per runtime argument, value as at launch (for specialisation);
    maxnreg: the register cap a launch tile may set."""
    signature, constexprs, attrs = {}, {}, {}
    for name, ty, value in args:
        idx = (fn.arg_names.index(name),)
        if ty == "i32" and value == 1:  # Triton makes an integer 1 a constant
            signature[name], constexprs[idx] = "constexpr", 1
            continue
        signature[name] = ty
        if ty.startswith("*") or value % 16 == 0:
            attrs[idx] = [["tt.divisibility", 16]]
    for name, value in consts.items():
        signature[name] = "constexpr"
        constexprs[(fn.arg_names.index(name),)] = value
    options = {"num_warps": num_warps, "enable_fp_fusion": False, "maxnreg": maxnreg}
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options
    )


def _group(op):
    base = op.split(".")[0]
    for group, names in MIX.items():
        if base in names:
            return group
    return "other"


def summarise(name, kernel, elements, num_warps, dump, mix=None):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True)
    lines = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", line).split()[0] for line in lines]
    ops = [op for op in ops if op != "NOP"]
    mem = collections.Counter(op for op in ops if MEMORY_OPS.match(op))
    regs = re.search(r"REG:(\d+)", res.stdout)
    stack = re.search(r"STACK:(\d+)", res.stdout)
    per_elem = len(ops) * num_warps * 32 / elements
    # code after the last EXIT is reached only by CALL: the IEEE division's slow path (a
    # denominator out of the fast path's range), so the rest is what every thread issues
    last_exit = max((i for i, op in enumerate(ops) if op == "EXIT"), default=len(ops) - 1)
    main_per_elem = (last_exit + 1) * num_warps * 32 / elements
    print(
        f"| {name} | {per_elem:.1f} | {main_per_elem:.1f} | {elements // (num_warps * 32)} | "
        f"{regs.group(1) if regs else '?'} | {stack.group(1) if stack else '?'} | "
        f"{kernel.metadata.shared} | {', '.join(f'{k} {v}' for k, v in sorted(mem.items()))} |"
    )
    if mix is not None:
        groups = collections.Counter(_group(op) for op in ops)
        mix.append((name, {g: v * num_warps * 32 / elements for g, v in groups.items()}))
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
            f.write("\n".join(lines) + "\n")


def dequant_jobs(n, sweep=False):
    """`gemm_operand`'s kernels as they launch for n x n operands on sm_90: the contiguous ones
    (`dequant_nvfp4_kernel`: every NVFP4 kind, rowwise and columnwise store the same [n, n/2]
    bytes and [n, n/16] scales, so they are one specialisation; `dequant_mxfp8_rows_kernel`,
    `dequant_mxfp8_cols_kernel`, hardware FP8) and the strided fallback `dequant_kernel` (the
    kernel every operand ran before: its sm_90 code is the old one's, the NaN select it gained
    being interpreter-only). sweep: also the contiguous kernels at every tile of
    bench/tile_sweep.py's dequant rows."""
    from tile_sweep import DEQUANT_COL_TILES, DEQUANT_NVFP4_TILES, DEQUANT_ROW_TILES

    nn = n * n
    jobs = []
    strided = dict(launch_gemm.DEQUANT_TILE)
    out = [("out_ptr", "*i16", 0), ("P", "i32", n), ("Q", "i32", n)]
    kinds = (
        ("nvfp4 rowwise", 0, 1, 16, n // 2, n // 16),
        ("nvfp4 columnwise", 0, 1, 16, n // 2, n // 16),
        ("mxfp8 e4m3 rowwise", 1, 1, 32, n, n // 32),
        ("mxfp8 e4m3 columnwise", 1, 32, 1, n, n),
        ("mxfp8 e5m2 rowwise", 2, 1, 32, n, n // 32),
        ("mxfp8 e5m2 columnwise", 2, 32, 1, n, n),
    )
    for name, fmt, sp, sq, data_cols, scale_cols in kinds:
        args = [("d_ptr", "*u8", 0), ("s_ptr", "*u8", 0), *out, ("sd_p", "i32", data_cols)]
        args += [("ss_p", "i32", scale_cols), ("ss_q", "i32", 1)]
        flags = {"FMT": fmt, "SP": sp, "SQ": sq, "NAN16": 0}
        elems = strided["BP"] * strided["BQ"]
        fn = gemm_kernels.dequant_kernel
        jobs.append(("dequant", f"{name}, strided (before)", fn, args, flags, strided, elems))
        io = [("d_ptr", "*u8", 0), ("s_ptr", "*u8", 0)]
        if fmt == 0:
            tiles = [launch_gemm.DEQUANT_NVFP4_TILE] + (DEQUANT_NVFP4_TILES if sweep else [])
            args = [*io, ("out_ptr", "*i32", 0), ("N", "i32", nn // 2)]
            fn, flags = gemm_kernels.dequant_nvfp4_kernel, {"NAN16": 0, "EVEN": True}
            per = [(t, t["BLOCK"] * 2) for t in tiles]
        elif sp == 1:
            tiles = [launch_gemm.DEQUANT_MXFP8_ROW_TILE] + (DEQUANT_ROW_TILES if sweep else [])
            args = [*io, ("out_ptr", "*i16", 0), ("N", "i32", nn)]
            fn = gemm_kernels.dequant_mxfp8_rows_kernel
            flags = {"FMT": fmt, "HW": True, "NAN16": 0, "EVEN": True}
            per = [(t, t["BLOCK"]) for t in tiles]
        else:
            tiles = [launch_gemm.DEQUANT_MXFP8_COL_TILE] + (DEQUANT_COL_TILES if sweep else [])
            args = [*io, ("out_ptr", "*i16", 0), ("Q", "i32", n)]
            fn = gemm_kernels.dequant_mxfp8_cols_kernel
            flags = {"FMT": fmt, "HW": True, "NAN16": 0, "EVEN": True}
            tiles = [dict(t, BQ=256 * t["num_warps"]) for t in tiles]
            per = [(t, t["R"] * t["BQ"]) for t in tiles]
        seen = []
        for k, (tile, elems) in enumerate(per):
            if tile in seen:
                continue
            seen.append(tile)
            label = name if k == 0 else f"{name}, {tile}"
            jobs.append(("dequant", label, fn, args, flags, tile, elems))
    return jobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["strided", "words", "fused"],
        choices=["strided", "words", "fused", "dequant"],
    )
    ap.add_argument("--mix", action="store_true", help="also print the instruction mix")
    ap.add_argument(
        "--fused-tile",
        nargs=3,
        type=int,
        metavar=("NB", "BK", "WARPS"),
        help="compile the fused column kernel's quantize passes with this tile instead of the "
        "launcher's (NVFP4_COL_FUSED_TILE)",
    )
    ap.add_argument(
        "--amax-tile",
        nargs=3,
        type=int,
        metavar=("NB", "BK", "WARPS"),
        help="and its RHT amax pass with this one (instead of NVFP4_COL_AMAX_TILE)",
    )
    ap.add_argument(
        "--dequant-tiles",
        action="store_true",
        help="with --kernels dequant: also every tile bench/tile_sweep.py sweeps",
    )
    ap.add_argument("--dump", help="write each kernel's SASS here")
    args = ap.parse_args()
    n = args.size
    mbits, emin, sub = FP8_BITS["e4m3"]
    mx = {"INV_MAX": fp32_reciprocal(448.0), "MAX": 448.0, "MBITS": mbits, "EMIN": emin}
    mx |= {"SUB": sub, "HW_FP8": True}
    nv = {"INV_6": INV_6, "LEGACY": False, "SR": False, "HW_FP8": True}
    u8 = [("row_data_ptr", "*u8", 0), ("row_scale_ptr", "*u8", 0)]
    u8 += [("col_data_ptr", "*u8", 0), ("col_scale_ptr", "*u8", 0)]
    mx_strided = [("x_ptr", "*bf16", 0), ("M", "i32", n), ("K", "i32", n), ("stride_m", "i32", n)]
    mx_strided += [("stride_k", "i32", 1), *u8]
    mx_words = [("xw_ptr", "*i64", 0), ("M", "i32", n), ("KW", "i32", n // 4)]
    mx_words += [
        ("stride_mw", "i32", n // 4),
        ("row_data_ptr", "*i32", 0),
        ("row_scale_ptr", "*u8", 0),
    ]
    mx_words += [("col_data_ptr", "*i32", 0), ("col_scale_ptr", "*i32", 0)]
    out = [("amax_ptr", "*fp32", 0), ("rbits_ptr", "*u8", 0), ("data_ptr", "*u8", 0)]
    out += [("scale_ptr", "*u8", 0)]
    nv_row = [("src_ptr", "*bf16", 0), ("R", "i32", n), ("C", "i32", n), ("stride_r", "i32", n)]
    nv_row += [("stride_c", "i32", 1), *out]
    nv_col = [("x_ptr", "*bf16", 0), ("M", "i32", n), ("K", "i32", n), ("stride_m", "i32", n)]
    nv_col += [("stride_k", "i32", 1), *out]
    nv_row_words = [("xw_ptr", "*i64", 0), ("R", "i32", n), ("CWT", "i32", n // 4)]
    nv_row_words += [
        ("stride_rw", "i32", n // 4),
        ("amax_ptr", "*fp32", 0),
        ("seed_ptr", "*i64", 0),
    ]
    nv_row_words += [("data_ptr", "*i16", 0), ("scale_ptr", "*u8", 0)]
    nv_col_words = [("xw_ptr", "*i64", 0), ("M", "i32", n), ("KW", "i32", n // 4)]
    nv_col_words += [("stride_mw", "i32", n // 4), ("amax_ptr", "*fp32", 0)]
    nv_col_words += [("data_ptr", "*i64", 0), ("scale_ptr", "*u8", 0)]

    jobs = []  # name, kernel fn, args, constexprs, launch parameters, elements per program
    directions = [("row+col", True, True), ("rowwise", True, False), ("columnwise", False, True)]
    for name, row, col in directions:
        flags = {**mx, "DO_ROW": row, "DO_COL": col}
        p = dict(launch_mxfp8.MXFP8_STRIDED_TILE)
        fn = mx_kernels.mxfp8_strided_kernel
        jobs.append(("strided", f"mxfp8 {name}", fn, mx_strided, flags, p, p["BM"] * p["BN"]))
        if col:
            both, col = launch_mxfp8.MXFP8_WORDS_BOTH_TILE, launch_mxfp8.MXFP8_WORDS_COL_TILE
            p = dict(both if row else col)
            flags = {**mx, "MAXNUM": True, "DO_ROW": row}
            elems = 32 * p["G"] * p["CW"] * 4
            fn = mx_kernels.mxfp8_words_kernel
            jobs.append(("words", f"mxfp8 {name}", fn, mx_words, flags, p, elems))
    for block_2d in (False, True):
        d = "2D" if block_2d else "1D"
        flags = {**nv, "BLOCK_2D": block_2d}
        p = dict(launch_nvfp4.NVFP4_ROW_STRIDED_TILE)
        fn = nv_kernels.nvfp4_row_strided_kernel
        jobs.append(("strided", f"nvfp4 rowwise {d}", fn, nv_row, flags, p, p["BR"] * p["BC"]))
        p = dict(launch_nvfp4.NVFP4_COL_STRIDED_TILE)
        fn = nv_kernels.nvfp4_col_strided_kernel
        jobs.append(("strided", f"nvfp4 columnwise {d}", fn, nv_col, flags, p, p["BM"] * p["BK"]))
        p = dict(launch_nvfp4.NVFP4_ROW_WORDS_TILE)
        fn = nv_words.nvfp4_row_words_kernel
        flags = {**flags, "MAXNUM": True, "PER_ROW": False}
        elems = p["BR"] * p["CW"] * 4
        jobs.append(("words", f"nvfp4 rowwise {d}", fn, nv_row_words, flags, p, elems))
        p = dict(launch_nvfp4.NVFP4_COL_WORDS_TILE)
        fn = nv_words.nvfp4_col_words_kernel
        flags = {k: v for k, v in flags.items() if k != "SR"}  # the column kernel has no SR
        elems = p["NB"] * 16 * p["CW"] * 4
        jobs.append(("words", f"nvfp4 columnwise {d}", fn, nv_col_words, flags, p, elems))

    # the fused column kernel's two passes as `launch_nvfp4._nvfp4_col_fused` runs them on bf16
    # (int16 bits), not grouped: the amax pass (`nvfp4_col_amax_kernel`), then the quantize pass
    head = [("x_ptr", "*i16", 0), ("M", "i32", n), ("K", "i32", n), ("stride_m", "i32", n)]
    head += [("stride_k", "i32", 1), ("amax_ptr", "*fp32", 0)]
    amax_args = head + [("pre_amax_ptr", "*fp32", 0), ("group_ptr", "*i64", 0), ("G", "i32", 0)]
    fused = head + [("seed_ptr", "*i64", 0), ("data_ptr", "*i64", 0), ("scale_ptr", "*u8", 0)]
    tiles = {}  # the quantize passes' tile and the amax pass's, the launcher's unless given
    for key, attr, given in (
        ("quantize", "NVFP4_COL_FUSED_TILE", args.fused_tile),
        ("amax", "NVFP4_COL_AMAX_TILE", args.amax_tile),
    ):
        tiles[key] = dict(getattr(launch_nvfp4, attr))
        if given:
            if any(v < 1 or v & (v - 1) for v in given):
                ap.error(f"tile {given}: NB, BK and WARPS must be powers of two")
            tiles[key] |= dict(zip(("NB", "BK", "num_warps"), given, strict=True))
    common = {"BF16_BITS": True, "GROUPED": False, "MAXNUM": True, "PTX": True, "EVEN": True}
    p = {"ITERS": 1, **tiles["amax"]}
    elems = p["NB"] * 16 * p["BK"] * p["ITERS"]
    for name, pre in (("RHT amax pass", False), ("RHT amax pass, plain amax too", True)):
        flags = {**common, "PRE_AMAX": pre}
        fn = nvfp4_col_amax_kernel
        jobs.append(("fused", f"nvfp4 fused col, {name}", fn, amax_args, flags, p, elems))
    base = {**common, "INV_6": INV_6, "LEGACY": False, "HW_FP8": True}
    for name, rht, sr in (
        ("RHT+SR quantize pass", True, True),
        ("RHT quantize pass", True, False),
        ("SR (no RHT)", False, True),
    ):
        p = tiles["quantize"]
        elems = p["NB"] * 16 * p["BK"]
        flags = {**base, "RHT": rht, "SR": sr}
        fn = nvfp4_col_fused_kernel
        jobs.append(("fused", f"nvfp4 fused col, {name}", fn, fused, flags, p, elems))
    p = dict(launch_nvfp4.NVFP4_ROW_WORDS_TILE)
    flags = {**nv, "SR": True, "BLOCK_2D": False, "MAXNUM": True, "PER_ROW": False}
    elems = p["BR"] * p["CW"] * 4
    fn = nv_words.nvfp4_row_words_kernel
    jobs.append(("fused", "nvfp4 rowwise SR words", fn, nv_row_words, flags, p, elems))
    p = dict(launch_nvfp4.NVFP4_COL_WORDS_TILE)
    flags = {k: v for k, v in nv.items() if k != "SR"} | {
        "BLOCK_2D": False,
        "MAXNUM": True,
        "PER_ROW": False,
    }
    elems = p["NB"] * 16 * p["CW"] * 4
    fn = nv_words.nvfp4_col_words_kernel
    jobs.append(("fused", "nvfp4 columnwise words (plain)", fn, nv_col_words, flags, p, elems))

    if "dequant" in args.kernels:
        jobs += dequant_jobs(n, args.dequant_tiles)

    print(f"# sm_90 SASS, {n}x{n} bf16 specialisation, triton {triton.__version__}")
    print(
        "| kernel | instr/elem | without slow path | elem/thread | regs | stack B | smem B | "
        "memory per thread |"
    )
    print("|---|---|---|---|---|---|---|---|")
    mix = [] if args.mix else None
    for family, name, fn, fn_args, flags, params, elems in jobs:
        if family not in args.kernels:
            continue
        params = dict(params)
        warps = params.pop("num_warps")
        maxnreg = params.pop("maxnreg", None)
        kernel = compile_sm90(fn, fn_args, {**flags, **params}, warps, maxnreg)
        label = name if family in ("fused", "dequant") else f"{name} {family}"
        summarise(label, kernel, elems, warps, args.dump, mix)
    if mix:
        print("\n# instruction mix, SASS instructions per element")
        print(f"| kernel | {' | '.join(MIX)} | other |")
        print("|---|" + "---|" * (len(MIX) + 1))
        for name, groups in mix:
            cells = [f"{groups.get(g, 0.0):.1f}" for g in (*MIX, "other")]
            print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

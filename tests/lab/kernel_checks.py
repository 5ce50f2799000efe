"""What the quantize-kernel tests check, shared by the compiled kernels on the GPU
(test_quant_triton_gpu.py, test_quant_gemm_gpu.py) and Triton's interpreter on CPU
(test_quant_triton_interpret.py).

`tk` holds the launcher modules (`launchers()`: tk.mx, tk.nv and tk.gemm are
`graphsan.lab.quant.kernels.launch_mxfp8`, `launch_nvfp4` and `launch_gemm`, tk.common their
`launch_common`); `strided=True` runs the strided kernels even where the launcher would pick the
bf16-word kernels, so both families are checked on the same inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

from graphsan.lab.quant import NVFP4Options, mxfp8, nvfp4

# Each kernel test runs twice: the kernels the launcher picks (bf16 words where the input allows)
# and the strided kernels on the same input.
STRIDED = pytest.mark.parametrize("strided", [False, True], ids=["picked", "strided"])

# (axis, block_2d, rht) of every NVFP4 operand kind: rowwise and columnwise, 1D and 2D blocks,
# and the Hadamard-transformed columnwise wgrad operand
NVFP4_KINDS = [(-1, False, False), (0, False, False), (-1, True, False), (0, True, False)]
NVFP4_KINDS += [(0, False, True)]
ROWWISE_KINDS = [kind for kind in NVFP4_KINDS if kind[0] != 0]

# The FP8 conversions the kernels can use: the hardware one (sm_90 on) and bit fields.
FP8_PATHS = ["hardware fp8", "bit fields"]


@dataclass(frozen=True)
class Launchers:
    """The launcher modules the kernel tests drive (and monkeypatch)."""

    mx: ModuleType
    nv: ModuleType
    gemm: ModuleType
    common: ModuleType


def use_fp8_path(tk, path, monkeypatch):
    """Force the bit-field FP8 encoding (used before sm_90), or skip where the hardware one is not
    used; MXFP8 elements and NVFP4 block scales take this path."""
    if path == "bit fields":
        monkeypatch.setattr(tk.common, "hw_fp8", lambda index: False)
    elif not tk.common.hw_fp8(torch.cuda.current_device()):
        pytest.skip("the hardware FP8 conversion is used from sm_90 on")


def launchers() -> Launchers:
    """The launcher modules, once the kernels are known to import (`kernels.launchers()`): the
    very ones its accessors hand the quantize and GEMM entry points, so what a test patches on
    them is what those run."""
    from graphsan.lab.quant import kernels

    found = kernels.launchers()
    assert found is not None, "triton imports but the kernels do not"
    from graphsan.lab.quant.kernels import launch_common, launch_gemm, launch_mxfp8, launch_nvfp4

    assert (found.mxfp8, found.nvfp4, found.gemm) == (launch_mxfp8, launch_nvfp4, launch_gemm)
    return Launchers(launch_mxfp8, launch_nvfp4, launch_gemm, launch_common)


def edge_inputs(shape, seed, device):
    """Random bf16 with wide row/col ranges, plus NaN, -inf, -0.0, a subnormal and a zero tile."""
    g = torch.Generator(device=device).manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, device=device, generator=g)
    x *= torch.exp(torch.randn(m, 1, device=device, generator=g) * 4)
    x *= torch.exp(torch.randn(1, k, device=device, generator=g) * 2)
    x = x.to(torch.bfloat16)
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (4,), device=device, generator=g)
    flat[idx[0]] = math.nan
    flat[idx[1]] = -math.inf
    flat[idx[2]] = -0.0
    flat[idx[3]] = 1e-40
    x[:32, :32] = 0
    return x


def nvfp4_edge_cases(device):
    """64x64 float32 inputs with named edges: every E2M1 tie (global amax 2688 and block max 6
    make the encode factor exactly 1, so the elements are the values the encoder sees), zeros,
    inf, tiny, scale underflow, subnormal scales."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat((ties, ties - 1e-3, ties + 1e-3, torch.linspace(0, 6, 32)))
    values = torch.cat((near, -near))
    values = torch.cat((values, torch.linspace(-12, 12, 4096 - values.numel())))
    tie = values[torch.randperm(4096)].reshape(64, 64)
    tie.view(64, 4, 16)[:, :, 0] = 6.0  # every block's max is 6
    tie[5, 17] = 2688.0
    cases = {
        "ties": tie,
        "zeros": torch.zeros(64, 64),
        "inf": torch.randn(64, 64).index_put_(
            (torch.tensor([3]), torch.tensor([7])), torch.tensor(math.inf)
        ),
        "tiny": torch.randn(64, 64) * 1e-40,
        "underflow": torch.randn(64, 64) * 1e-3,
        "subnormal-scales": torch.randn(64, 64)
        * 2.0 ** -torch.randint(12, 22, (64, 4, 1)).float().repeat(1, 1, 16).reshape(64, 64),
    }
    cases["underflow"][0, 0] = 1e4
    cases["subnormal-scales"][0, 0] = 1.0
    return {name: x.to(device) for name, x in cases.items()}


def assert_nvfp4_edges_match(tk, order, strided, device):
    """`nvfp4_edge_cases` in both directions, 1D and 2D blocks, byte for byte."""
    for name, x in nvfp4_edge_cases(device).items():
        for axis in (-1, 0):
            for block_2d in (False, True):
                a = tk.nv.nvfp4_quantize(x, axis, NVFP4Options(block_2d, order), _strided=strided)
                b = nvfp4.quantize_reference(x, axis, NVFP4Options(block_2d, order))
                where = (name, strided, axis, block_2d)
                assert torch.equal(a.amax, b.amax), where
                assert torch.equal(a.scale, b.scale), where
                assert torch.equal(a.data, b.data), where


def mxfp8_inputs(shape, seed, device):
    """edge_inputs, in float32 for seeds >= 2: no bf16 rounding ahead of the FP8 conversion."""
    x = edge_inputs(shape, seed, device)
    if seed >= 2:
        g = torch.Generator(device=device).manual_seed(seed)
        noise = torch.rand(x.shape, device=device, generator=g)
        x = x.float() * (1 + noise * 2**-10)
    return x


def assert_mxfp8_matches(tk, x, fmt, strided=False):
    """Both directions from one pass, and each alone, equal the reference byte for byte."""
    row, col = tk.mx.mxfp8_quantize_both(x, fmt, _strided=strided)
    for q, axis in ((row, -1), (col, 0)):
        ref = mxfp8.quantize_reference(x, axis, fmt)
        assert torch.equal(q.scale, ref.scale), (strided, axis)
        assert torch.equal(q.data, ref.data), (strided, axis)
        single = tk.mx.mxfp8_quantize(x, axis, fmt, _strided=strided)
        assert torch.equal(single.data, ref.data), (strided, axis)
        assert torch.equal(single.scale, ref.scale), (strided, axis)
    return row, col


def assert_nvfp4_matches(tk, x, order, seed, strided=False, kinds=NVFP4_KINDS):
    """Every operand kind (or those of `kinds`), with and without stochastic rounding (same seed,
    same bits), and the global amax kernel alone."""
    assert torch.equal(tk.nv.global_amax(x), nvfp4.global_amax(x.float()))
    for axis, block_2d, use_rht in kinds:
        if use_rht and x.shape[0] % 16:
            continue
        for sr in (False, True):
            g1 = torch.Generator(device=x.device).manual_seed(seed) if sr else None
            g2 = torch.Generator(device=x.device).manual_seed(seed) if sr else None
            a = tk.nv.nvfp4_quantize(
                x, axis, NVFP4Options(block_2d, order, use_rht, g1), _strided=strided
            )
            b = nvfp4.quantize_reference(x, axis, NVFP4Options(block_2d, order, use_rht, g2))
            where = (strided, axis, block_2d, use_rht, sr)
            assert torch.equal(a.amax, b.amax), where
            assert torch.equal(a.scale, b.scale), where
            assert torch.equal(a.data, b.data), where


def quantized_gemm_cases(recipe, m, k, n, device, seed=0):
    """The three GEMMs of a quantized Linear with x [m, k], weight [n, k] and dy [m, n], as
    (name, a, b, transpose_a, transpose_b) with the operands the table names."""
    from tests.lab.quant_oracles import skewed

    g = torch.Generator().manual_seed(seed)
    x, w, dy = (skewed(r, c, g).to(device) for r, c in ((m, k), (n, k), (m, n)))
    qw, qx, qg = (recipe.quantizers()[r] for r in ("weight", "input", "grad_output"))
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    w_row, w_col = qw.quantize(w, -1), qw.quantize(w, 0)
    x_row, x_col = qx.quantize(x, -1), qx.quantize(x, 0)
    dy_row, dy_col = qg.quantize(dy, -1, generator=gen), qg.quantize(dy, 0, generator=gen)
    return [
        ("fprop", x_row, w_row, False, True),
        ("dgrad", dy_row, w_col, False, False),
        ("wgrad", dy_col, x_col, True, False),
    ]


def assert_quantized_mm_matches(tk, recipe, m, k, n, device, seed=0):
    """`tk.gemm.quantized_mm` (the packed-operand GEMM) against dequantize-then-GEMM in float64:
    |C - C64| <= R * 2^-23 * (|A||B|)_ij * alpha, the float32 accumulation bound over the
    reduction length R with a factor 2 to spare; also with accumulation into a float32 output.
    Returns the largest error as a fraction of that bound."""
    from graphsan.lab.quant.gemm import gemm_alpha, gemm_operand
    from tests.lab.quant_oracles import ref_mm

    worst = 0.0
    for name, a, b, ta, tb in quantized_gemm_cases(recipe, m, k, n, device, seed):
        av, bv = gemm_operand(a), gemm_operand(b)
        av, bv = (av.t() if ta else av), (bv.t() if tb else bv)
        alpha = gemm_alpha(a, b)
        ref, mag = ref_mm(av, bv, alpha)
        bound = av.shape[1] * 2.0**-23 * mag + 1e-30
        got = tk.gemm.quantized_mm(a, b, ta, tb, alpha)
        assert got is not None and got.dtype == torch.float32, name
        assert got.shape == ref.shape, name
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), (name, (err / bound).max().item())
        worst = max(worst, (err / bound).max().item())
        base = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)).to(device)
        out = base.clone()
        assert tk.gemm.quantized_mm(a, b, ta, tb, alpha, out) is out
        assert ((out.double() - base.double() - ref).abs() <= bound + 2.0**-23).all(), name
    return worst


def assert_gemm_operands_match(tk, device, shape):
    """`tk.gemm.gemm_operand` (one pass over the packed data) equals the torch dequantization bit for
    bit: NVFP4 of every operand kind, MXFP8 E4M3 and E5M2 in both directions, on `edge_inputs`
    (NaN, -inf, a subnormal, a zero tile) with one block scaled to 2^-130 (scale bytes below 3,
    where the bf16 values round)."""
    from graphsan.lab.quant.gemm import gemm_operand_reference

    x = edge_inputs(shape, 12, device).float()
    x[32:64, 64:96] *= 2.0**-130
    ops = []
    for axis, block_2d, use_rht in NVFP4_KINDS:
        g = torch.Generator(device=device).manual_seed(2)
        ops.append(
            nvfp4.quantize(x.bfloat16(), axis, NVFP4Options(block_2d, "current", use_rht, g))
        )
    for fmt in ("e4m3", "e5m2"):
        ops += [mxfp8.quantize(x, -1, fmt), mxfp8.quantize(x, 0, fmt)]
    assert any((q.scale < 3).any() for q in ops[-4:])
    for q in ops:
        got, ref = tk.gemm.gemm_operand(q), gemm_operand_reference(q)
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), type(q).__name__


# --- gemm_operand on chosen bytes ---------------------------------------------------------------


def _bytes(shape, g, low=0, high=256):
    return torch.randint(low, high, shape, generator=g, dtype=torch.int32).to(torch.uint8)


def _e8m0_mix(shape, g):
    """E8M0 scale bytes: uniform, with about a third below 13 (where the bf16 values round),
    a tenth 240-254 (products that overflow to inf) and a twentieth 0xFF (NaN)."""
    s = _bytes(shape, g)
    pick = torch.rand(shape, generator=g)
    s = torch.where(pick < 0.33, _bytes(shape, g, 0, 13), s)
    s = torch.where((pick >= 0.33) & (pick < 0.43), _bytes(shape, g, 240, 255), s)
    return torch.where(pick >= 0.95, torch.full_like(s, 255), s)


def random_byte_operands(device, seed, shape):
    """NVFP4 and MXFP8 (E4M3, E5M2) operands of logical shape `shape` in both directions whose
    data and scale bytes are random over all 256 values (not what a quantizer makes): every E2M1
    code pair, E4M3 scales with NaN (0x7F, 0xFF), sign and subnormals, FP8 elements with NaN,
    E5M2 inf and subnormals, E8M0 scales from `_e8m0_mix`; and for each format one operand
    whose data rows are a slice of a wider buffer (not contiguous: the strided kernel)."""
    from graphsan.lab.quant.tensors import MXFP8Tensor, NVFP4Tensor

    g = torch.Generator().manual_seed(seed)
    m, k = shape
    ops = []
    amax = torch.ones((), device=device)
    for axis in (-1, 0):
        rows, cols = (m, k) if axis != 0 else (k, m)
        data, scale = _bytes((rows, cols // 2), g), _bytes((rows, cols // 16), g)
        ops.append(NVFP4Tensor(data.to(device), scale.to(device), amax, axis, False, False))
    wide = _bytes((m, k // 2 + 8), g).to(device)
    scale = _bytes((m, k // 16), g).to(device)
    ops.append(NVFP4Tensor(wide[:, 8:], scale, amax, -1, False, False))
    for fmt in ("e4m3", "e5m2"):
        data = _bytes((m, k), g).to(device)
        ops.append(MXFP8Tensor(data, _e8m0_mix((m, k // 32), g).to(device), -1, fmt))
        ops.append(MXFP8Tensor(data, _e8m0_mix((m // 32, k), g).to(device), 0, fmt))
        wide = _bytes((m, k + 32), g).to(device)
        ops.append(MXFP8Tensor(wide[:, :k], _e8m0_mix((m // 32, k), g).to(device), 0, fmt))
    return ops


def exhaustive_operands(device):
    """Every element byte against every scale byte: NVFP4 with row r's 512 elements the 256
    data bytes (all code pairs) and scale byte r; MXFP8 rowwise the same, 256 elements a row;
    MXFP8 columnwise with column c's scale byte c and its 256 rows the 256 element bytes."""
    from graphsan.lab.quant.tensors import MXFP8Tensor, NVFP4Tensor

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    rows = every.repeat(256, 1)  # [256, 256], row r = 0 .. 255
    by_row = every[:, None]  # scale byte r for row r
    amax = torch.ones((), device=device)
    ops = [
        NVFP4Tensor(
            rows.to(device), by_row.expand(256, 32).contiguous().to(device), amax, -1, False, False
        )
    ]
    for fmt in ("e4m3", "e5m2"):
        ops.append(
            MXFP8Tensor(rows.to(device), by_row.expand(256, 8).contiguous().to(device), -1, fmt)
        )
        cols = rows.t().contiguous().to(device)  # column c = the 256 bytes
        ops.append(MXFP8Tensor(cols, every.repeat(8, 1).to(device), 0, fmt))
    return ops


def assert_gemm_operand_bits(tk, ops, where=""):
    """`tk.gemm.gemm_operand` of each operand, with the kernel the launcher picks and with the
    strided one, equals `gemm_operand_reference` bit for bit (NaN bits included)."""
    from graphsan.lab.quant.gemm import gemm_operand_reference

    for n, q in enumerate(ops):
        ref = gemm_operand_reference(q)
        for strided in (False, True):
            got = tk.gemm.gemm_operand(q, _strided=strided)
            label = (where, n, type(q).__name__, getattr(q, "fmt", "e2m1"), q.axis, strided)
            assert got.dtype == torch.bfloat16 and got.shape == ref.shape, label
            bad = got.view(torch.int16) != ref.view(torch.int16)
            if bad.any():
                idx = bad.nonzero()[0].tolist()
                g, r = got.view(torch.int16)[tuple(idx)], ref.view(torch.int16)[tuple(idx)]
                raise AssertionError(
                    f"{label}: {int(bad.sum())} elements differ, first at {idx}: "
                    f"got 0x{int(g) & 0xFFFF:04x}, reference 0x{int(r) & 0xFFFF:04x}"
                )

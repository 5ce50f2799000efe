"""The Triton quantize kernels under Triton's interpreter (TRITON_INTERPRET=1) on CPU, byte for
byte against the torch reference: the kernels' logic is checked on every machine with Triton,
GPU or not. The compiled kernels (and the hardware FP8 conversion, which the interpreter only
emulates) are checked on the GPU by test_quant_triton_gpu.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from graphsan.lab.quant import NVFP4Options, mxfp8, nvfp4
from tests.lab.grouped_checks import check_nvfp4_grouped_kernels
from tests.lab.kernel_checks import (
    ROWWISE_KINDS,
    STRIDED,
    assert_mxfp8_matches,
    assert_nvfp4_edges_match,
    assert_nvfp4_matches,
    edge_inputs,
    launchers,
    mxfp8_inputs,
    nvfp4_edge_cases,
)

# Triton is imported here, after tests/conftest.py set TRITON_INTERPRET where CUDA is absent.
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from graphsan.lab.quant.kernels.nvfp4 import _e2m1_lane, _e2m1_rne_field  # noqa: E402
from tests.lab.test_sr_encoder_math import rne_values  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="this machine has CUDA: the compiled kernels are tested (test_quant_triton_gpu)",
    ),
    # the kernels divide by zero on purpose (an all-zero block) and clamp the inf; numpy says so
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning"),
]


@triton.jit
def _sr_encode_kernel(v_ptr, r_ptr, out_ptr, N: tl.constexpr, J: tl.constexpr):
    """The kernels' E2M1 encoder with SR, element by element (the random byte in lane J of a
    word whose other bytes are set, so a lane that reads beyond its byte shows)."""
    i = tl.arange(0, N)
    v = tl.load(v_ptr + i)
    r = (tl.load(r_ptr + i).to(tl.uint32) << (8 * J)) | (0xA5A5A5A5 & ~(0xFF << (8 * J)))
    tl.store(out_ptr + i, (_e2m1_lane(v, r, J, True) >> (4 * J)) & 0xF)


@triton.jit
def _rne_field_kernel(v_ptr, out_ptr, N: tl.constexpr):
    """The fused kernel's nearest-even encoder (`_e2m1_rne_field`), its code read off bits
    22-24 as the kernel reads it."""
    i = tl.arange(0, N)
    tl.store(out_ptr + i, ((_e2m1_rne_field(tl.load(v_ptr + i)) >> 22) ^ 4) & 7)


@pytest.fixture(scope="module")
def tk():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py)")
    pytest.importorskip("triton")
    return launchers()


@STRIDED
@pytest.mark.parametrize("shape", [(32, 32), (64, 160), (96, 64)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_kernel_matches_reference(tk, shape, fmt, strided):
    for seed in range(3):
        assert_mxfp8_matches(tk, mxfp8_inputs(shape, seed, "cpu"), fmt, strided)


@STRIDED
@pytest.mark.parametrize("shape", [(32, 128), (48, 64)])
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_kernel_matches_reference(tk, shape, order, strided):
    assert_nvfp4_matches(tk, edge_inputs(shape, 3, "cpu"), order, 5, strided)


@STRIDED
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_kernel_edge_inputs(tk, order, strided):
    assert_nvfp4_edges_match(tk, order, strided, "cpu")


def test_launcher_picks_the_words_kernels_where_they_fit(tk, monkeypatch):
    """bf16 with unit column stride goes to the bf16-word kernels (MXFP8 with a columnwise part,
    NVFP4 rowwise and columnwise without RHT or SR); NVFP4 columnwise with RHT or SR (1D blocks)
    to the fused column kernel, any stride; float32, a column stride of 2, 2D blocks with SR,
    MXFP8 rowwise alone and `_strided=True` go to the strided kernels."""
    calls = []
    for home, name in (
        (tk.mx, "_mxfp8_words"),
        (tk.mx, "_mxfp8_strided"),
        (tk.nv, "_nvfp4_row_words"),
        (tk.nv, "_nvfp4_col_words"),
        (tk.nv, "_nvfp4_col_fused"),
    ):
        monkeypatch.setattr(home, name, lambda *a, name=name: calls.append(name))
    monkeypatch.setattr(tk.nv, "_nvfp4_strided", lambda *a: calls.append("_nvfp4_strided"))
    monkeypatch.setattr(tk.nv, "global_amax", lambda x: torch.zeros(()))
    bf16 = torch.zeros(32, 64, dtype=torch.bfloat16)
    g = torch.Generator()

    def picked(fn, *args, **kwargs):
        calls.clear()
        fn(*args, **kwargs)
        return calls[0]

    assert picked(tk.mx.mxfp8_quantize_both, bf16) == "_mxfp8_words"
    assert picked(tk.mx.mxfp8_quantize, bf16, 0) == "_mxfp8_words"
    assert picked(tk.mx.mxfp8_quantize, bf16, -1) == "_mxfp8_strided"
    assert picked(tk.mx.mxfp8_quantize_both, bf16.float()) == "_mxfp8_strided"
    assert picked(tk.mx.mxfp8_quantize_both, bf16, _strided=True) == "_mxfp8_strided"
    wide = torch.zeros(32, 128, dtype=torch.bfloat16)[:, ::2]
    assert picked(tk.mx.mxfp8_quantize_both, wide) == "_mxfp8_strided"
    nv = tk.nv.nvfp4_quantize
    rht, sr = NVFP4Options(rht=True), NVFP4Options(generator=g)
    rht_sr = NVFP4Options(rht=True, generator=g)
    assert picked(nv, bf16, -1) == "_nvfp4_row_words"
    assert picked(nv, bf16, -1, sr) == "_nvfp4_row_words"
    assert picked(nv, bf16, 0, rht_sr) == "_nvfp4_col_fused"
    assert picked(nv, bf16, 0, rht) == "_nvfp4_col_fused"
    assert picked(nv, wide, 0, sr) == "_nvfp4_col_fused"
    assert picked(nv, bf16, 0) == "_nvfp4_col_words"
    assert picked(nv, bf16, 0, NVFP4Options(block_2d=True, generator=g)) == "_nvfp4_strided"
    assert picked(nv, bf16, 0, rht, _strided=True) == "_nvfp4_strided"
    assert picked(nv, bf16.float(), -1) == "_nvfp4_strided"
    assert picked(nv, wide, 0) == "_nvfp4_strided"
    assert picked(nv, bf16, -1, _strided=True) == "_nvfp4_strided"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_words_kernel_tiles_and_fallbacks(tk, fmt):
    """The words kernel (bf16, unit column stride) over several programs in both dimensions,
    blocks with NaN and an all-NaN block, a column slice of a wider tensor, columnwise with
    K = 100 (not a multiple of 32); and the inputs it leaves to the strided kernel (float32, a
    column stride of 2)."""
    x = mxfp8_inputs((64, 544), 1, "cpu")
    x[:32, 40:45] = math.nan
    x[32:, 64:96] = math.nan
    assert_mxfp8_matches(tk, x, fmt)
    assert_mxfp8_matches(tk, mxfp8_inputs((64, 256), 0, "cpu")[:, 32:160], fmt)
    x = mxfp8_inputs((64, 100), 1, "cpu")
    q, ref = tk.mx.mxfp8_quantize(x, 0, fmt), mxfp8.quantize_reference(x, 0, fmt)
    assert torch.equal(q.data, ref.data) and torch.equal(q.scale, ref.scale)
    assert_mxfp8_matches(tk, mxfp8_inputs((64, 96), 2, "cpu"), fmt)  # float32
    assert_mxfp8_matches(tk, mxfp8_inputs((64, 192), 0, "cpu")[:, ::2], fmt)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_row_words_kernel(tk, order):
    """The row words kernel (bf16, unit column stride): several programs along the row, a
    partial row tile (1D and 2D blocks, with and without SR), and the named edge cases rounded
    to bf16 (given the reference global amax: the interpreter loads bf16 subnormals inexactly in
    the amax kernel)."""
    # the rowwise kinds alone: the columnwise kernels' tiles are the column tests' below
    assert_nvfp4_matches(tk, edge_inputs((48, 544), 3, "cpu"), order, 5, kinds=ROWWISE_KINDS)
    x = edge_inputs((40, 288), 4, "cpu")
    for block_2d in (False, True):
        for sr in (False, True):
            g1 = torch.Generator().manual_seed(1) if sr else None
            g2 = torch.Generator().manual_seed(1) if sr else None
            a = tk.nv.nvfp4_quantize(x, -1, NVFP4Options(block_2d, order, generator=g1))
            b = nvfp4.quantize_reference(x, -1, NVFP4Options(block_2d, order, generator=g2))
            assert torch.equal(a.scale, b.scale), (block_2d, sr)
            assert torch.equal(a.data, b.data), (block_2d, sr)
    for name, x in nvfp4_edge_cases("cpu").items():
        x = x.to(torch.bfloat16)
        amax = nvfp4.global_amax(x.float())
        for block_2d in (False, True):
            a = tk.nv.nvfp4_quantize(x, -1, NVFP4Options(block_2d, order), amax=amax)
            b = nvfp4.quantize_reference(x, -1, NVFP4Options(block_2d, order))
            assert torch.equal(a.scale, b.scale), (name, block_2d)
            assert torch.equal(a.data, b.data), (name, block_2d)


@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_col_words_kernel(tk, order):
    """The column words kernel (bf16, unit column stride, no RHT, no SR): two programs down the
    rows (the second partial), three across the columns (the last partial), a column slice of a
    wider tensor, 1D and 2D blocks, NaN in a block and an all-NaN block (given the reference
    global amax, as above); and the input it leaves to the strided kernel (a column stride of
    2)."""
    x = edge_inputs((144, 160), 6, "cpu")  # 2 x 3 programs of 8 blocks x 16 words
    x[16:32, 7] = math.nan
    x[40, 9] = math.nan
    cases = {"random": x, "slice": edge_inputs((32, 320), 7, "cpu")[:, 64:256]}
    cases["strided"] = edge_inputs((32, 256), 8, "cpu")[:, ::2]
    for name, x in cases.items():
        amax = nvfp4.global_amax(x.float())
        for block_2d in (False, True):
            a = tk.nv.nvfp4_quantize(x, 0, NVFP4Options(block_2d, order), amax=amax)
            b = nvfp4.quantize_reference(x, 0, NVFP4Options(block_2d, order))
            assert torch.equal(a.scale, b.scale), (name, block_2d)
            assert torch.equal(a.data, b.data), (name, block_2d)


def _col_fused_cases(seed, small=True):
    """bf16 over 2 x 3 programs of the default tiles (8 blocks x 64 columns; the second row and
    the third column program partial) with NaN in a block and an all-NaN block, float32, a
    column slice and a column stride of 2. `small`: float32 and the slice over one program down
    and two across (each partial), as the index arithmetic is bf16's."""
    x = edge_inputs((144, 160), seed, "cpu")
    x[16:32, 7] = math.nan
    x[40, 9] = math.nan
    cases = {"bf16": x, "float32": (x[:48, :96] if small else x).float()}
    wide = edge_inputs((32, 160 if small else 320), seed + 1, "cpu")
    cases["slice"] = wide[:, 64:160] if small else wide[:, 64:256]
    cases["stride2"] = edge_inputs((32, 256), seed + 2, "cpu")[:, ::2]
    return cases


def _assert_col_fused_matches(tk, cases, order, modes):
    for name, x in cases.items():
        for use_rht, sr in modes:
            g1 = torch.Generator().manual_seed(3) if sr else None
            g2 = torch.Generator().manual_seed(3) if sr else None
            a = tk.nv.nvfp4_quantize(x, 0, NVFP4Options(False, order, use_rht, g1))
            b = nvfp4.quantize_reference(x, 0, NVFP4Options(False, order, use_rht, g2))
            where = (name, use_rht, sr)
            assert torch.equal(a.amax, b.amax), where
            assert torch.equal(a.scale, b.scale), where
            assert torch.equal(a.data, b.data), where


@pytest.mark.slow
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_col_fused_kernel(tk, order):
    """The fused columnwise kernel (RHT and/or SR): two programs down the rows (the second
    partial), three across the columns (the last partial), float32 (a partial program each way),
    a column slice and a column stride of 2, NaN in a block and an all-NaN block; bytes and the
    post-RHT amax equal the reference's, the SR bits drawn from equally seeded generators."""
    modes = ((True, False), (True, True), (False, True))
    _assert_col_fused_matches(tk, _col_fused_cases(9), order, modes)


@pytest.mark.slow
def test_nvfp4_col_amax_pass_with_two_tiles_a_program(tk, monkeypatch):
    """The RHT amax pass with two tiles a program (its running maximum; 9 block rows: the last
    program's second tile past the end) on the fused kernel's cases, float32 and the slice at
    full size too: the post-RHT amax and the bytes equal the reference's. RHT without SR alone:
    SR and the order do not reach the amax pass, and test_nvfp4_col_fused_kernel runs them with
    the default tile."""
    tile = {"NB": 2, "BK": 64, "ITERS": 2, "num_warps": 1}
    monkeypatch.setattr(tk.nv, "NVFP4_COL_AMAX_TILE", tile)
    cases = _col_fused_cases(9, small=False)
    _assert_col_fused_matches(tk, cases, "current", ((True, False),))


def _same_nvfp4(a, b, where):
    assert torch.equal(a.amax, b.amax), where
    assert torch.equal(a.scale, b.scale), where
    assert torch.equal(a.data, b.data), where


@pytest.mark.slow
@pytest.mark.parametrize("order", ["current", "legacy"])
def test_nvfp4_quantize_both_reads_both_amaxes_once(tk, order, monkeypatch):
    """`nvfp4_quantize_both`: the rowwise and columnwise copies equal the reference's two calls
    (the SR seed drawn for the row copy first), with RHT both amaxes from the amax pass alone:
    neither the global amax kernel nor a second amax pass runs. NaN in a block, an all-NaN
    block, -0.0, bf16 and float32 (two programs down the rows, two across, each second one
    partial), a column slice and a column stride of 2."""
    x = edge_inputs((144, 96), 12, "cpu")
    x[16:32, 7] = math.nan
    x[40, 9] = math.nan
    x[64:80, 3] = -0.0
    cases = {"bf16": x, "float32": x.float()}
    cases["slice"] = edge_inputs((32, 320), 13, "cpu")[:, 64:256]
    cases["stride2"] = edge_inputs((32, 256), 14, "cpu")[:, ::2]
    passes = []
    real_pass = tk.nv._col_amax_pass

    def counted(*args, **kw):
        passes.append(args[2] is not None)  # whether the plain amax was asked for too
        return real_pass(*args, **kw)

    monkeypatch.setattr(tk.nv, "_col_amax_pass", counted)
    monkeypatch.setattr(tk.nv, "global_amax", lambda t: pytest.fail("a second amax read"))
    for name, x in cases.items():
        for sr in (False, True):
            g1 = torch.Generator().manual_seed(5) if sr else None
            g2 = torch.Generator().manual_seed(5) if sr else None
            passes.clear()
            row, col = tk.nv.nvfp4_quantize_both(x, NVFP4Options(False, order, True, g1))
            assert passes == [True], (name, sr)
            ref_row = nvfp4.quantize_reference(x, -1, NVFP4Options(False, order, False, g2))
            ref_col = nvfp4.quantize_reference(x, 0, NVFP4Options(False, order, True, g2))
            _same_nvfp4(row, ref_row, (name, sr, "rowwise"))
            _same_nvfp4(col, ref_col, (name, sr, "columnwise"))
            assert row.amax.shape == col.amax.shape == ()


def test_nvfp4_quantize_both_without_rht_shares_one_amax(tk, monkeypatch):
    """Without RHT both copies (2-D weight blocks too) take one global amax, and equal the
    reference's two calls."""
    calls = []
    real = tk.nv.global_amax
    monkeypatch.setattr(tk.nv, "global_amax", lambda t: calls.append(1) or real(t))
    x = edge_inputs((64, 96), 15, "cpu")
    for block_2d in (False, True):
        calls.clear()
        row, col = tk.nv.nvfp4_quantize_both(x, NVFP4Options(block_2d, "current", False, None))
        assert len(calls) == 1, block_2d
        _same_nvfp4(
            row, nvfp4.quantize_reference(x, -1, NVFP4Options(block_2d)), ("rowwise", block_2d)
        )
        _same_nvfp4(
            col, nvfp4.quantize_reference(x, 0, NVFP4Options(block_2d)), ("columnwise", block_2d)
        )


def test_nvfp4_grouped_both(tk, monkeypatch):
    """`nvfp4_quantize_grouped_both` against the reference's two grouped calls: per-group
    amaxes before and after the RHT from one amax pass (an empty group, padding rows), with and
    without SR; without RHT (1D blocks with and without SR, 2D weights) one group amax pass and
    no RHT pass; float32 input: None (the caller quantizes each copy alone)."""
    from tests.lab.grouped_checks import grouped_rows, row_groups

    counts = (32, 0, 16, 48)
    g = torch.Generator().manual_seed(7)
    x = grouped_rows(counts, 64, g, pad=16)
    groups = row_groups(counts, x.shape[0])
    ids, count = groups.index.to(torch.int64), groups.count
    passes, group_passes = [], []
    real_pass, real_group = tk.nv._col_amax_pass, tk.nv._group_amax
    monkeypatch.setattr(
        tk.nv, "_col_amax_pass", lambda *a, **k: passes.append(1) or real_pass(*a, **k)
    )
    monkeypatch.setattr(
        tk.nv, "_group_amax", lambda *a, **k: group_passes.append(1) or real_group(*a, **k)
    )
    monkeypatch.setattr(
        tk.nv, "NVFP4_COL_AMAX_TILE", {"NB": 2, "BK": 32, "ITERS": 2, "num_warps": 1}
    )
    modes = [(True, False, False), (True, True, False), (False, False, False), (False, True, False)]
    for use_rht, sr, block_2d in [*modes, (False, False, True)]:
        g1 = torch.Generator().manual_seed(8) if sr else None
        g2 = torch.Generator().manual_seed(8) if sr else None
        passes.clear()
        group_passes.clear()
        row, col = tk.nv.nvfp4_quantize_grouped_both(
            x, ids, count, NVFP4Options(block_2d, "current", use_rht, g1)
        )
        assert (len(passes), len(group_passes)) == ((1, 0) if use_rht else (0, 1))
        ref = nvfp4.quantize_grouped_reference
        ref_row = ref(x, ids, count, -1, NVFP4Options(block_2d, "current", False, g2))
        ref_col = ref(x, ids, count, 0, NVFP4Options(block_2d, "current", use_rht, g2))
        _same_nvfp4(row, ref_row, (use_rht, sr, "rowwise"))
        _same_nvfp4(col, ref_col, (use_rht, sr, "columnwise"))
    assert tk.nv.nvfp4_quantize_grouped_both(x.float(), ids, count, NVFP4Options(rht=True)) is None


@pytest.mark.slow
def test_nvfp4_grouped_kernels(tk, monkeypatch):
    """Grouped NVFP4 (one amax per row group, from device-side groups): every operand kind
    against the reference, with an empty group and padding rows; the group amax over several
    programs along the columns, tiles whose rows span groups (rowwise counts not multiples of
    16) and tiles within one group; inputs the kernels do not take (float32 rowwise, columnwise
    SR with 2D blocks) left to the reference."""
    monkeypatch.setitem(tk.nv.GROUP_AMAX_TILE, "BC", 32)
    monkeypatch.setitem(tk.nv.GROUP_AMAX_TILE, "ITERS", 2)
    assert check_nvfp4_grouped_kernels(tk, (32, 0, 16, 48), "cpu") == 8
    assert check_nvfp4_grouped_kernels(tk, (8, 0, 24, 40), "cpu", "legacy") == 3
    x = torch.zeros(32, 64)
    groups = torch.zeros(32, dtype=torch.int64)
    assert tk.nv.nvfp4_quantize_grouped(x, groups, 1, -1) is None
    assert tk.nv.nvfp4_quantize_grouped(x, groups, 1, 0, NVFP4Options(rht=True)) is not None
    g = torch.Generator()
    assert (
        tk.nv.nvfp4_quantize_grouped(
            x.bfloat16(), groups, 1, 0, NVFP4Options(block_2d=True, generator=g)
        )
        is None
    )


def test_sr_code_matches_the_reference_for_every_random_byte(tk):
    """The kernels' stochastic-rounding encoder (`_e2m1_lane` with SR) against
    `elements.e2m1_stochastic` for values at and next to every grid point and step boundary,
    past 6, NaN, -0.0 and tiny ones, and a dense sweep of [0, 6.5] (so the sums t land on both
    sides of every code boundary), each with all 256 random bytes, in each byte of the word."""
    from graphsan.lab.quant.elements import e2m1_stochastic

    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    near = torch.cat((grid, grid.nextafter(torch.tensor(9.0)), grid.nextafter(torch.tensor(-1.0))))
    base = torch.cat((near, torch.tensor([0.25, 1.75, 3.5, 5.0, 7.0, 1e30, math.nan, 1e-40])))
    sweep = torch.linspace(0.0, 6.5, 1301)
    values = torch.cat((base, -base, torch.tensor([-0.0, -1e-40]), sweep, -sweep))
    v = values.repeat_interleave(256)
    r = torch.arange(256, dtype=torch.int32).repeat(values.numel())
    n = triton.next_power_of_2(v.numel())
    vp = torch.cat((v, torch.zeros(n - v.numel())))
    rp = torch.cat((r, torch.zeros(n - r.numel(), dtype=torch.int32)))
    ref = e2m1_stochastic(v.clamp(-6, 6), r.to(torch.uint8))
    for lane in range(4):
        out = torch.empty(n, dtype=torch.int32)
        _sr_encode_kernel[(1,)](vp, rp, out, N=n, J=lane)
        assert torch.equal(out[: v.numel()].to(torch.uint8), ref), lane


def test_rne_field_matches_nearest_even(tk):
    """`_e2m1_rne_field` under the interpreter (its NaN select, not the GPU's maximum) against
    `elements.e2m1_rne` on every E2M1 tie and grid point with their neighbours, the SR code
    boundaries and a dense sweep of [0, 6], tiny, past 6, inf and NaN, both signs."""
    from graphsan.lab.quant.elements import e2m1_rne

    v = rne_values()
    n = triton.next_power_of_2(v.numel())
    vp = torch.cat((v, torch.zeros(n - v.numel())))
    out = torch.empty(n, dtype=torch.int32)
    _rne_field_kernel[(1,)](vp, out, N=n)
    ref = (e2m1_rne(v.clamp(-6, 6)) & 7).to(torch.int32)
    assert torch.equal(out[: v.numel()], ref)

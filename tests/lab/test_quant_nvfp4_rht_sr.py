"""NVFP4's Random Hadamard Transform and stochastic rounding on CPU: the RHT matrix and its
post-transform amax and layout, the wgrad it feeds, and stochastic rounding unbiased,
reproducible, drawn per block from Philox, and by the formula of docs/numerics.md."""

from __future__ import annotations

import math

import pytest
import torch

from graphsan.lab.quant import NVFP4Options, nvfp4, rht
from tests.lab.test_quant_nvfp4 import codes_of


def test_rht_matrix_and_transform():
    m = rht.rht_matrix()
    assert torch.equal(m @ m.t(), torch.eye(16, dtype=torch.float64))
    assert torch.equal(rht.hadamard16().abs(), torch.ones(16, 16, dtype=torch.float64))
    g = torch.Generator().manual_seed(5)
    # exact where the float32 sums are exact (small integers): equals the bf16 block matmul
    xi = torch.randint(-64, 64, (32, 64), generator=g).to(torch.bfloat16)
    ref = (xi.double().reshape(-1, 16) @ m).reshape(32, 64).to(torch.bfloat16)
    assert torch.equal(rht.rht(xi), ref)
    # random bf16: within one bf16 rounding of the exact float64 result
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    exact = (x.double().reshape(-1, 16) @ m).reshape(64, 256)
    got = rht.rht(x).double()
    assert ((got - exact).abs() <= exact.abs() * 2.0**-8 + 1e-30).all()
    assert torch.equal(rht.rht(x), (x.reshape(-1, 16) @ m.to(torch.bfloat16)).reshape(64, 256))


def test_rht_quantize_uses_post_rht_amax_and_transposed_layout():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    x[3, 7] = 40.0  # an outlier: RHT spreads it over its 16-token block
    q = nvfp4.quantize(x, 0, NVFP4Options(rht=True))
    t = rht.rht(x.t())
    assert q.amax.item() == t.float().abs().max().item()
    assert q.amax.item() < 40.0
    q_ref = nvfp4.quantize(t.t().contiguous(), axis=0)  # same bytes as quantizing the transform
    assert torch.equal(q.data, q_ref.data) and torch.equal(q.scale, q_ref.scale)
    assert q.data.shape == (32, 32) and q.scale.shape == (32, 4)


def test_wgrad_with_rht_close_to_without():
    g = torch.Generator().manual_seed(13)
    dy = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    xx = torch.randn(256, 96, generator=g).to(torch.bfloat16)
    xx[17, 5] = 60.0  # outlier
    exact = dy.double().t() @ xx.double()

    def wgrad(use_rht):
        a = nvfp4.dequantize(nvfp4.quantize(dy, 0, NVFP4Options(rht=use_rht))).double()
        b = nvfp4.dequantize(nvfp4.quantize(xx, 0, NVFP4Options(rht=use_rht))).double()
        return a.t() @ b

    e_rht = (wgrad(True) - exact).norm() / exact.norm()
    e_plain = (wgrad(False) - exact).norm() / exact.norm()
    assert e_rht < 0.2 and e_plain < 0.2
    assert e_rht < e_plain * 1.5


@pytest.mark.parametrize("axis", [-1, 0], ids=["rowwise", "columnwise"])
def test_stochastic_rounding_is_unbiased_and_reproducible(axis):
    g = torch.Generator().manual_seed(21)
    v = torch.rand(32, generator=g) * 5.5 + 0.1
    v[0] = 6.0  # the row max, so the scale is exactly amax-derived and equal for every row
    v[1] = -2.7
    x = v.repeat(4096, 1)  # 4096 independent draws of the same 32 values
    if axis == 0:  # the columnwise copy of x^T quantizes x's rows
        x = x.t().contiguous()

    def values(q):  # dequantized, one row per draw
        out = nvfp4.dequantize(q).double()
        return out.t() if axis == 0 else out

    gen = torch.Generator().manual_seed(1)
    q = nvfp4.quantize(x, axis, NVFP4Options(generator=gen))
    sr = values(q)
    rn = values(nvfp4.quantize(x, axis))[0]
    target = v.double()
    mean = sr.mean(0)
    std = sr.std(0) / math.sqrt(sr.shape[0])
    assert ((mean - target).abs() <= 5 * std + 1e-6).all()
    assert (mean - target).pow(2).mean().sqrt() < (rn - target).pow(2).mean().sqrt()
    # SR outputs are neighbours of the value on the grid: at most two distinct codes per column
    codes = codes_of(q)  # one row per draw either way: columnwise stores the copy of x.t()
    assert all(codes[:, j].unique().numel() <= 2 for j in range(32))

    a = nvfp4.quantize(x, axis, NVFP4Options(generator=torch.Generator().manual_seed(5)))
    b = nvfp4.quantize(x, axis, NVFP4Options(generator=torch.Generator().manual_seed(5)))
    c = nvfp4.quantize(x, axis, NVFP4Options(generator=torch.Generator().manual_seed(6)))
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


def test_sr_bits_are_philox_per_block():
    """Philox4x32-10 gives the published known answer (key 0, counter 0); block b of an
    [R, C] source takes the 16 bytes of counter b, lowest byte of word 0 first; the reference
    draws one seed and uses exactly these bits (columnwise: for the source x^T)."""
    from graphsan.lab.quant.elements import (
        block_random_bits,
        e2m1_stochastic,
        philox4x32,
        random_seed,
    )

    zero = torch.zeros(1, dtype=torch.int64)
    words = [int(w) for w in philox4x32(torch.tensor(0), zero)]
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    seed = torch.tensor(0x0123456789ABCDEF)
    bits = block_random_bits(seed, 3, 32)
    for row, blk in ((0, 0), (1, 1), (2, 1)):
        w = philox4x32(seed, torch.tensor([row * 2 + blk]))
        want = [(int(w[j // 4]) >> (8 * (j % 4))) & 0xFF for j in range(16)]
        assert bits[row, blk * 16 : blk * 16 + 16].tolist() == want
    many = block_random_bits(seed, 256, 256).double()
    assert abs(many.mean().item() - 127.5) < 1.0  # 65536 bytes: standard error 0.29

    x = torch.randn(64, 48) * 3  # columnwise: the source is x^T [48, 64], 4 blocks per row
    q = nvfp4.quantize_reference(x, 0, NVFP4Options(generator=torch.Generator().manual_seed(9)))
    r = block_random_bits(random_seed(torch.Generator().manual_seed(9), "cpu"), 48, 64)
    plain = nvfp4.quantize_reference(x, 0)  # the same scales; only the rounding differs
    s_dec = nvfp4.global_scales(plain.amax)[1]
    v = x.t().reshape(48, 4, 16) * nvfp4.encode_factor(plain.scale, s_dec).unsqueeze(-1)
    codes = e2m1_stochastic(v.reshape(48, 64).clamp(-6, 6), r)
    assert torch.equal(q.scale, plain.scale)
    assert torch.equal(codes_of(q), codes)
    q = nvfp4.quantize_reference(x, -1, NVFP4Options(generator=torch.Generator().manual_seed(9)))
    r = block_random_bits(random_seed(torch.Generator().manual_seed(9), "cpu"), 64, 48)
    plain = nvfp4.quantize_reference(x, -1)
    s_dec = nvfp4.global_scales(plain.amax)[1]
    v = x.reshape(64, 3, 16) * nvfp4.encode_factor(plain.scale, s_dec).unsqueeze(-1)
    assert torch.equal(codes_of(q), e2m1_stochastic(v.reshape(64, 48).clamp(-6, 6), r))


def test_stochastic_rounding_formula():
    """Compare with the spec's SR formula on explicit random bits."""
    from graphsan.lab.quant.elements import e2m1_decode, e2m1_stochastic

    v = torch.tensor([0.1, 0.3, 1.9, 2.2, 3.9, 4.5, 5.9, 6.0, -1.3, -0.0, math.nan])
    for r in (0, 1, 64, 128, 200, 255):
        bits = torch.full(v.shape, r, dtype=torch.uint8)
        got = e2m1_decode(e2m1_stochastic(v, bits))
        for val, out in zip(v.tolist(), got.tolist(), strict=True):
            if math.isnan(val):
                assert out == 6.0
                continue
            a = abs(val)
            step = 0.5 if a < 2 else (1.0 if a < 4 else 2.0)
            t = a + r / 256 * step
            st_ = 0.5 if t < 2 else (1.0 if t < 4 else 2.0)
            exp = min(math.floor(t / st_) * st_, 6.0)
            assert out == math.copysign(exp, -1.0 if val < 0 else 1.0) or (exp == 0 and out == 0)

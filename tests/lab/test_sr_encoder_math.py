"""The arithmetic of the fused column kernel's E2M1 encoders, modelled in torch on CPU operation
for operation: the compiled SR encoder (`kernels.nvfp4._e2m1_sr_field`) against the reference
`elements.e2m1_stochastic` for every value near each code boundary and each rounding boundary
of the reference's sum, with every random byte, a dense strided sweep of [0, 6] and the tiny
and special values; the nearest-even one (`_e2m1_rne_field`) against `elements.e2m1_rne` on
every tie and its neighbours and the same sweep. The compiled kernels themselves are compared
on the GPU (test_quant_triton_gpu.py), the nearest-even one also under the interpreter; this
checks the identities they use, on every machine."""

from __future__ import annotations

import math

import torch

from graphsan.lab.quant.elements import e2m1_rne, e2m1_stochastic

KS = torch.arange(256, dtype=torch.int32)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _float(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def _fma_rz_half(t: torch.Tensor) -> torch.Tensor:
    """fl32 toward zero of t / 2 + 1 / 2 for float32 t in [0, 8): in float64 the sum is exact
    for t >= 2^-28, and below that it lies in [0.5, 0.5 + 2^-29], which rounds to 0.5 either
    way, so rounding the float64 to float32 and stepping down where it went up is exact."""
    g64 = t.double() * 0.5 + 0.5
    g = g64.float()
    down = g.double() > g64
    return torch.where(down, g.nextafter(torch.zeros_like(g)), g)


def sr_field_code(v: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The magnitude code `_e2m1_sr_field` gives for float32 v and bytes k (int32)."""
    a = torch.minimum(v.abs(), torch.tensor(6.0))
    a = torch.where(torch.isnan(a), torch.tensor(6.0), a)  # the GPU's NaN-ignoring minimum
    k16 = k << 16
    c = _float(k16) * 2.0**124  # k * 2^-133 (subnormal below 128) times 2^124: exact
    assert torch.equal(c, k.float() / 512)
    t = a + c  # the fused multiply-add of an exact product: one rounding of a + k / 512
    g = _fma_rz_half(t)
    m = torch.maximum(_bits(a) + (k16 >> 2), _bits(g))
    return ((m >> 22) ^ 4) & 7


def _check(values: torch.Tensor) -> int:
    """values x all 256 bytes (in chunks, to bound the memory); returns the pairs checked."""
    for chunk in values.float().split(8192):
        v = chunk.repeat_interleave(256)
        k = KS.repeat(chunk.numel())
        got = sr_field_code(v, k)
        ref = (e2m1_stochastic(v.clamp(-6, 6), k.to(torch.uint8)) & 7).to(torch.int32)
        bad = (got != ref).nonzero()[:8, 0]
        assert bad.numel() == 0, [
            (v[i].item(), k[i].item(), got[i].item(), ref[i].item()) for i in bad
        ]
    return values.numel() * 256


def _neighbours(x: torch.Tensor, n: int) -> torch.Tensor:
    """The float32 values within n units in the last place of each non-negative x, in [0, 6]."""
    b = _bits(x.float()).unique()
    b = (b[:, None] + torch.arange(-n, n + 1, dtype=torch.int32)).flatten().unique()
    return _float(b[(b >= 0) & (b <= _bits(torch.tensor(6.0)))])


def boundary_values() -> torch.Tensor:
    """Every float32 a within 40 units in the last place of a value whose sum a + u * step(a)
    is a code boundary (the grid points 0.5 ... 8) for some byte u, and of the grid itself."""
    c = KS.double() / 256
    centres = []
    for step, lo, hi in ((0.5, 0.0, 2.0), (1.0, 2.0, 4.0), (2.0, 4.0, 6.0)):
        for edge in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0):
            a = edge - c * step
            centres.append(a[(a >= lo) & (a <= hi)])
    centres.append(torch.tensor([0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0]))
    return _neighbours(torch.cat(centres), 40)


def window_values() -> torch.Tensor:
    """Below 1 the reference rounds a + k / 512 to float32 before reading the code, so a sum in
    [0.5 - 2^-26, 0.5) counts as 0.5 (and [1 - 2^-25, 1) as 1): every float32 a whose sum with
    some byte k falls within 2^-24 of either boundary."""
    windows = []
    for k in range(256):
        for edge in (0.5, 1.0):
            lo = edge - k / 512 - 2.0**-24
            hi = edge - k / 512 + 2.0**-24
            if hi < 0 or lo >= 1:
                continue
            a0 = _bits(torch.tensor(max(lo, 0.0), dtype=torch.float32)).item()
            a1 = _bits(torch.tensor(min(hi, 1.0), dtype=torch.float32)).item()
            windows.append(torch.arange(a0, a1 + 1, dtype=torch.int32))
    return _float(torch.cat(windows).unique())


def sweep_values() -> torch.Tensor:
    """Every 65521st float32 in [0, 6], every power of two and its neighbours down to the
    smallest subnormal, and the values the encoder clamps (past 6, inf, NaN), both signs."""
    dense = _float(torch.arange(0, _bits(torch.tensor(6.0)).item() + 1, 65521, dtype=torch.int32))
    powers = _neighbours(torch.tensor([2.0**e for e in range(-149, 3)]), 3)
    special = torch.tensor([6.5, 7.0, 8.0, 1e30, math.inf, math.nan, 0.0])
    values = torch.cat((dense, powers, special))
    return torch.cat((values, -values, torch.tensor([-0.0])))


def test_sr_field_at_every_code_boundary_for_every_byte():
    assert _check(boundary_values()) > 10_000_000


def test_sr_field_in_the_rounding_windows_below_half_and_one():
    assert _check(window_values()) > 1_000_000


def test_sr_field_dense_sweep_and_special_values():
    assert _check(sweep_values()) > 1_000_000


def rne_field_code(v: torch.Tensor) -> torch.Tensor:
    """The magnitude code `_e2m1_rne_field` gives for float32 v."""
    a = torch.minimum(v.abs(), torch.tensor(6.0))
    a = torch.where(torch.isnan(a), torch.tensor(6.0), a)
    bits = _bits(a)
    hi = bits + 0x1FFFFF + ((bits >> 22) & 1)
    lo = (a + 4194304.0) * 0.5 + (0.5 - 2097152.0)  # both steps exact: the fma's one rounding
    return ((torch.maximum(hi, _bits(lo)) >> 22) ^ 4) & 7


def rne_values() -> torch.Tensor:
    """Every grid point and tie of E2M1 with the 5000 float32 either side, the code boundaries
    of the SR sweep (boundary_values) and the dense sweep."""
    ties = torch.tensor(
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]
    )
    return torch.cat((_neighbours(ties, 5000), boundary_values(), sweep_values()))


def test_rne_field_matches_nearest_even():
    v = rne_values()
    got = rne_field_code(v)
    ref = (e2m1_rne(v.clamp(-6, 6)) & 7).to(torch.int32)
    bad = (got != ref).nonzero()[:8, 0]
    assert bad.numel() == 0, [(v[i].item(), got[i].item(), ref[i].item()) for i in bad]
    assert v.numel() > 100_000

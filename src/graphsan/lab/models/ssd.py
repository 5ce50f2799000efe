"""Mamba-2 state-space duality (SSD) scan in pure torch, plus a sequential reference.

Shapes: x (b, seq, h, p), dt (b, seq, h) after softplus, A (h,) negative, B and C (b, seq, g, n) with
h % g == 0. The recurrence is, per head,

    state_t = exp(dt_t * A) * state_{t-1} + dt_t * x_t (outer) B_t,      y_t = C_t . state_t

`ssd_chunked` evaluates it in chunks of `chunk` steps (fp32, static shapes, no host sync): an
exact quadratic form inside each chunk, chunk-final states, a scan over chunk states, and the
contribution of the carried state to each chunk. Decays come from differences of cumulative sums
taken only inside the lower triangle ("stable segment sums"), so nothing is exponentiated that
could overflow. `ssd_sequential` is the literal recurrence, used as the fp64 test reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, and -inf above the diagonal."""
    t = a.shape[-1]
    rows = a.unsqueeze(-1).expand(*a.shape, t)  # rows[..., i, j] = a[..., i]
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~strict, 0.0).cumsum(dim=-2)
    return sums.masked_fill(
        ~strict.logical_or(torch.eye(t, dtype=torch.bool, device=a.device)), -torch.inf
    )


def ssd_chunked(x, dt, A, B, C, chunk: int) -> torch.Tensor:
    """Chunked SSD scan; returns y (b, seq, h, p) in fp32 (fp64 if x is fp64). Pads l up to a
    multiple of `chunk` (the padded tail cannot affect earlier outputs)."""
    b, seq, h, p = x.shape
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    pad = (-seq) % chunk
    x, dt, B, C = (F.pad(t.to(dtype), (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    reps = h // B.shape[-2]
    B = B.repeat_interleave(reps, dim=2)  # (b, L, h, n)
    C = C.repeat_interleave(reps, dim=2)
    nc = (seq + pad) // chunk
    # (b, c, T, ...) chunk views; decays per head in (b, h, c, T)
    xc, Bc, Cc = (t.reshape(b, nc, chunk, h, -1) for t in (x * dt.unsqueeze(-1), B, C))
    a = (dt * A.to(dtype)).reshape(b, nc, chunk, h).permute(0, 3, 1, 2)
    a_cum = a.cumsum(dim=-1)

    # 1. inside each chunk: y_i = sum_{j<=i} (C_i . B_j) exp(a_{j+1..i}) dt_j x_j
    decay = torch.exp(segment_sum(a))  # (b, h, c, T, T)
    scores = torch.einsum("bcihn,bcjhn->bhcij", Cc, Bc) * decay
    y = torch.einsum("bhcij,bcjhp->bcihp", scores, xc)

    # 2. state at the end of each chunk from that chunk's inputs
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (b, h, c, T)
    states = torch.einsum("bcjhn,bhcj,bcjhp->bchpn", Bc, to_end, xc)

    # 3. carry states across chunks: state entering chunk c = sum_{k<c} exp(A_{k+1..c-1}) s_k
    chunk_a = F.pad(a_cum[..., -1], (1, 0))  # (b, h, c+1)
    carry = torch.exp(segment_sum(chunk_a))  # (b, h, c+1, c+1)
    states = F.pad(states, (0, 0, 0, 0, 0, 0, 1, 0))  # zero initial state, (b, c+1, h, p, n)
    entering = torch.einsum("bhzc,bchpn->bzhpn", carry, states)[:, :-1]

    # 4. the carried state seen from each position of the chunk
    y = y + torch.einsum("bcihn,bchpn,bhci->bcihp", Cc, entering, torch.exp(a_cum))
    return y.reshape(b, nc * chunk, h, p)[:, :seq]


def ssd_sequential(x, dt, A, B, C) -> torch.Tensor:
    """The literal recurrence, one time step at a time (reference; use fp64)."""
    b, seq, h, p = x.shape
    reps = h // B.shape[-2]
    B = B.repeat_interleave(reps, dim=2)
    C = C.repeat_interleave(reps, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(seq):
        da = torch.exp(dt[:, t] * A)  # (b, h)
        state = state * da[..., None, None] + (dt[:, t, :, None] * x[:, t]).unsqueeze(-1) * B[
            :, t
        ].unsqueeze(-2)
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    return torch.stack(ys, dim=1)

"""Pure-PyTorch Cut Cross-Entropy: the CPU path, and the oracle the kernels are checked against.

It processes rows in chunks, so at most ``chunk x V`` logits exist at a time (never ``B x V``).
Inputs and outputs mirror :mod:`cce_autotune.strategies`: rows of E are picked by ``rows`` (row
indices into ``e.reshape(-1, D)``). Computation is in float32, or float64 for float64 inputs.
"""

from __future__ import annotations

import torch

__all__ = ["forward", "backward", "chunk_rows"]

# Logits per chunk: 64 MiB of fp32 on the CPU, 1 GiB on a GPU (where small chunks starve the matmul).
_CHUNK_ELEMENTS = {"cpu": 1 << 24, "cuda": 1 << 28}


def chunk_rows(V: int, device: torch.device | str = "cpu") -> int:
    per = _CHUNK_ELEMENTS.get(torch.device(device).type, 1 << 24)
    return max(1, per // max(1, V))


def _compute_dtype(e: torch.Tensor) -> torch.dtype:
    return torch.float64 if e.dtype == torch.float64 else torch.float32


def _classifier(c: torch.Tensor, e: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """C in the compute dtype, rounded to e's dtype first when it is wider (an fp32 classifier with
    16-bit embeddings: the logits are those of the 16-bit operands, as under autocast)."""
    if c.dtype != e.dtype and c.element_size() > e.element_size():
        c = c.to(e.dtype)
    return c.to(dt)


def _logits(e_rows, c, bias, softcap):
    z = e_rows @ c.T
    if bias is not None:
        z = z + bias
    t = None
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    return z, t


def forward(e, c, bias, rows, targets, softcap=None, row_sums: bool = False):
    """(lse, target logit, sum of the logits or None unless ``row_sums``) of each selected row, in
    the compute dtype."""
    dt = _compute_dtype(e)
    e2 = e.reshape(-1, e.shape[-1])
    cc = _classifier(c, e, dt)
    bb = bias.to(dt) if bias is not None else None
    n = rows.shape[0]
    lse = torch.empty(n, dtype=dt, device=e.device)
    zt = torch.empty(n, dtype=dt, device=e.device)
    zsum = torch.empty(n, dtype=dt, device=e.device) if row_sums else None
    step = chunk_rows(c.shape[0], e.device)
    for lo in range(0, n, step):
        r = rows[lo : lo + step]
        z, _ = _logits(e2[r].to(dt), cc, bb, softcap)
        lse[lo : lo + step] = torch.logsumexp(z, dim=1)
        zt[lo : lo + step] = z.gather(1, targets[lo : lo + step, None]).squeeze(1)
        if row_sums:
            zsum[lo : lo + step] = z.sum(1)
    return lse, zt, zsum


def backward(e, c, bias, rows, targets, lse, coef_s, coef_t, softcap=None, coef_u=None):
    """Gradients of sum_i coef_s[i] * lse_i - coef_t[i] * z_{i, target_i} [- coef_u[i] * sum_j z_ij]
    w.r.t. e, c, bias.

    Returns (dE shaped like ``e``, dC like ``c``, dbias like ``bias`` or None), in the inputs'
    dtypes.
    """
    dt = _compute_dtype(e)
    D = e.shape[-1]
    e2 = e.reshape(-1, D)
    cc = _classifier(c, e, dt)
    bb = bias.to(dt) if bias is not None else None
    de = torch.zeros(e2.shape, dtype=dt, device=e.device)
    dc = torch.zeros(c.shape, dtype=dt, device=e.device)
    dbias = torch.zeros(c.shape[0], dtype=dt, device=e.device) if bias is not None else None
    step = chunk_rows(c.shape[0], e.device)
    for lo in range(0, rows.shape[0], step):
        sl = slice(lo, lo + step)
        r = rows[sl]
        er = e2[r].to(dt)
        z, t = _logits(er, cc, bb, softcap)
        g = torch.exp(z - lse[sl, None].to(dt)) * coef_s[sl, None].to(dt)
        g.scatter_add_(1, targets[sl, None], -coef_t[sl, None].to(dt))
        if coef_u is not None:
            g -= coef_u[sl, None].to(dt)
        if t is not None:
            g = g * (1 - t * t)
        de.index_add_(0, r, g @ cc)
        dc += g.T @ er
        if dbias is not None:
            dbias += g.sum(0)
    return (
        de.reshape(e.shape).to(e.dtype),
        dc.to(c.dtype),
        dbias.to(bias.dtype) if dbias is not None else None,
    )

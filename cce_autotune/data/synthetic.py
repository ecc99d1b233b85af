"""Synthetic inputs for tuning, benchmarks and tests.

``lm_like``: what a trained language model's last layer looks like to the loss.
  - Token frequencies are Zipfian (exponent 1.1) over a random ranking of the vocabulary; the
    classifier carries that prior along one shared direction ``u`` (a frequent token's row has a
    larger component on ``u``, and every embedding has a positive one), so frequent tokens get
    larger logits for every row, as in a real LM head.
  - Each embedding points towards its target's classifier row plus noise, so the softmax is peaked.
  - Finally the embeddings are scaled (bisection on one global factor) until the mean softmax
    entropy over a sample of rows is ``entropy`` nats (default 4.0, in the 3.5-4.8 nats measured
    on trained LMs), so that gradient filtering and vocabulary sorting see realistic sparsity.
``random``: e, c ~ N(0, 1) / D^(1/4) (flat softmax, filtering skips almost nothing), uniform targets.
(``real``, the hidden states of a small GPT trained on real text, is :mod:`cce_autotune.data.real`;
activation files saved from a user's run are :mod:`cce_autotune.data.captured`.)
"""

from __future__ import annotations

import math

import torch

__all__ = ["lm_like", "random_data", "mean_entropy"]


def mean_entropy(e: torch.Tensor, c: torch.Tensor, rows: int = 256) -> float:
    """Mean softmax entropy (nats) of the first ``rows`` rows of e @ c.T (fp32)."""
    z = e[:rows].float() @ c.float().T
    logp = torch.log_softmax(z, dim=1)
    return float(-(logp.exp() * logp).sum(1).mean())


def lm_like(B: int, V: int, D: int, dtype=torch.bfloat16, device="cpu", seed: int = 0, entropy: float = 4.0):
    """(e (B, D), c (V, D), targets (B,)) with LM-like statistics; see the module docstring."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    rank = torch.randperm(V, **kw)  # rank[k]: frequency rank of token k
    logp_prior = -1.1 * torch.log1p(rank.double())
    prior = torch.softmax(logp_prior, 0)
    targets = torch.multinomial(prior.float(), B, replacement=True, generator=g)
    u = torch.randn(D, **kw)
    u /= u.norm()
    c = torch.randn(V, D, **kw) / math.sqrt(D)
    c += (logp_prior - logp_prior.mean()).float()[:, None] * 0.15 * u[None, :]
    noise = torch.randn(B, D, **kw) / math.sqrt(D)
    e = c[targets] / c[targets].norm(dim=1, keepdim=True) + 0.8 * noise + 0.5 * u[None, :]
    # Calibrate the global scale of e to the requested mean entropy (entropy falls as scale grows).
    lo, hi = 0.01, 1000.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if mean_entropy(e * mid, c) > entropy:
            lo = mid
        else:
            hi = mid
    e = e * math.sqrt(lo * hi)
    return e.to(dtype).contiguous(), c.to(dtype).contiguous(), targets


def random_data(B: int, V: int, D: int, dtype=torch.bfloat16, device="cpu", seed: int = 0):
    """(e, c, targets) with e, c ~ N(0, 1) / D^(1/4) and uniform targets."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    s = D**-0.25
    e = torch.randn(B, D, **kw) * s
    c = torch.randn(V, D, **kw) * s
    t = torch.randint(0, V, (B,), **kw)
    return e.to(dtype), c.to(dtype), t

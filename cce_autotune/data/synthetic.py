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
``sampled``: LM-like data of another construction, which the tuner never sees (a check that what was
  tuned on ``lm`` holds elsewhere):
  - the vocabulary falls into 64 topics; a classifier row is its topic's centre plus noise, with a
    Zipfian prior (exponent 1.0, another random ranking) along a shared direction;
  - a hidden state is one topic's centre (topics drawn Zipfian) plus noise and the shared direction;
  - the targets are drawn from the model's own softmax, as a calibrated model's next tokens are,
    instead of each embedding pointing at its target: a target may sit anywhere in its row's
    distribution, in a tile a filter would drop;
  - the scale is set (bisection) for a mean softmax entropy of ``entropy`` nats (default 3.5).
``random``: e, c ~ N(0, 1) / D^(1/4) (flat softmax, filtering skips almost nothing), uniform targets.
(``real``, the hidden states of a small GPT trained on real text, is :mod:`cce_autotune.data.real`;
activation files saved from a user's run are :mod:`cce_autotune.data.captured`.)
"""

from __future__ import annotations

import math

import torch

__all__ = ["lm_like", "lm_sampled", "random_data", "mean_entropy"]


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
    e = e * _calibrate(e, c, entropy)  # the global scale of e for the requested mean entropy
    return e.to(dtype).contiguous(), c.to(dtype).contiguous(), targets


def _calibrate(e: torch.Tensor, c: torch.Tensor, entropy: float) -> float:
    """The factor of e that gives a mean softmax entropy of ``entropy`` nats (bisection; entropy
    falls as the factor grows)."""
    lo, hi = 0.01, 1000.0
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if mean_entropy(e * mid, c) > entropy:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def lm_sampled(B: int, V: int, D: int, dtype=torch.bfloat16, device="cpu", seed: int = 0, entropy: float = 3.5,
               topics: int = 64):
    """(e (B, D), c (V, D), targets (B,)): LM-like data of another construction than :func:`lm_like`,
    with targets drawn from the model's own softmax; see the module docstring."""
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    K = max(1, min(topics, V))
    centres = torch.randn(K, D, **kw) / math.sqrt(D)
    topic = torch.randint(0, K, (V,), **kw)
    logp_prior = -1.0 * torch.log1p(torch.randperm(V, **kw).float())
    u = torch.randn(D, **kw)
    u /= u.norm()
    c = 0.6 * centres[topic] + torch.randn(V, D, **kw) / math.sqrt(D)
    c += (logp_prior - logp_prior.mean())[:, None] * 0.1 * u[None, :]
    topic_prior = torch.softmax(-1.0 * torch.log1p(torch.arange(K, device=device).float()), 0)
    rows_topic = torch.multinomial(topic_prior, B, replacement=True, generator=g)
    e = centres[rows_topic] + 0.7 * torch.randn(B, D, **kw) / math.sqrt(D) + 0.8 * u[None, :]
    e = e * _calibrate(e, c, entropy)
    targets = torch.empty(B, dtype=torch.int64, device=device)
    step = max(1, (1 << 26) // V)  # rows per draw: 256 MiB of fp32 probabilities
    for i in range(0, B, step):
        p = torch.softmax(e[i:i + step] @ c.T, dim=1)
        targets[i:i + step] = torch.multinomial(p, 1, generator=g).squeeze(1)
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

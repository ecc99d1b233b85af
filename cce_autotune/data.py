"""Synthetic inputs for tuning and benchmarks.

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
``real``: hidden states and classifier of a small language model trained on the Python standard
  library's source (:func:`cce_autotune.realdata.real_data`; trains on first use, then cached on disk).
"""

from __future__ import annotations

import functools
import math
import os

import torch

__all__ = ["DATA_KINDS", "TORCH_DTYPES", "lm_like", "random_data", "make_data", "mean_entropy", "is_file_kind",
           "load_file"]

DATA_KINDS = ("lm", "random", "real")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # short name -> dtype


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


def is_file_kind(kind: str) -> bool:
    """True when ``kind`` names an activation file rather than a generated kind."""
    return kind not in DATA_KINDS and (kind.endswith(".pt") or os.path.sep in kind or os.path.isfile(kind))


def load_file(path: str):
    """The :class:`~cce_autotune.activations.Activations` of ``path`` (loaded once per file version)."""
    st = os.stat(path) if os.path.isfile(path) else None
    return _load_cached(os.path.abspath(path), st.st_mtime_ns if st else 0, st.st_size if st else 0)


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, mtime: int, size: int):
    """(``mtime`` and ``size`` only key the cache: a rewritten file is read again.)"""
    from .activations import load_activations

    return load_activations(path)


def make_data(kind: str, B: int, V: int, D: int, dtype=torch.bfloat16, device="cpu", seed: int = 0, **options):
    """(e, c, targets) of kind ``lm``, ``random`` or ``real``, or read from an activation file
    (``kind`` is its path: :mod:`cce_autotune.activations`; V and D must be the file's, B rows are
    its first B, repeated in order if it holds fewer); ``options`` go to that kind's generator
    (e.g. ``entropy`` for ``lm``, ``steps`` for ``real``)."""
    if is_file_kind(kind):
        from .activations import rows_for

        acts = load_file(kind)
        if (acts.V, acts.D) != (V, D):
            raise ValueError(f"data: {kind} holds V={acts.V}, D={acts.D}, not the V={V}, D={D} asked for")
        return rows_for(acts, B, dtype, device)[:3]
    if kind == "lm":
        return lm_like(B, V, D, dtype, device, seed, **options)
    if kind == "random":
        return random_data(B, V, D, dtype, device, seed, **options)
    if kind == "real":
        from .realdata import real_data  # imported here: only this kind needs the corpus and the model

        return real_data(B, V, D, dtype, device, seed, **options)
    raise ValueError(f"data: {kind!r} is not one of {list(DATA_KINDS)} nor an activation file")

"""The data the loss is tuned, benchmarked and tested on: synthetic (:mod:`.synthetic`: LM-like, LM-like
of another construction with sampled targets, and random), real (:mod:`.real`: hidden states of a small GPT trained on real text) and captured
(:mod:`.captured`: activations saved from a user's own training step).

:func:`make_data` gives ``(e, c, targets)`` of any kind by name, or read from an activation file.
"""

from __future__ import annotations

import functools
import os

import torch

from . import captured, real
from .synthetic import lm_like, lm_sampled, mean_entropy, random_data

__all__ = ["DATA_KINDS", "TORCH_DTYPES", "lm_like", "lm_sampled", "random_data", "make_data", "mean_entropy", "is_file_kind",
           "load_file", "resolve_data", "file_dtype"]

DATA_KINDS = ("lm", "sampled", "random", "real")
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # short name -> dtype


def is_file_kind(kind: str) -> bool:
    """True when ``kind`` names an activation file rather than a generated kind."""
    return kind not in DATA_KINDS and (kind.endswith(".pt") or os.path.sep in kind or os.path.isfile(kind))


def resolve_data(value: str, kinds=DATA_KINDS, flag: str = "--data") -> str:
    """``value`` when it is one of ``kinds`` or an existing file (an activation file: loading checks
    it). Otherwise ValueError naming ``flag``, which says ``no such file: <path>``: a mistyped path
    and a mistyped kind look alike, and the user needs to know nothing is there."""
    if value in kinds or os.path.isfile(value):
        return value
    if os.path.exists(value):
        raise ValueError(f"{flag}: {value}: not a file (an activation file written by "
                         "cce_autotune.data.captured.save_activations or capture)")
    if is_file_kind(value):
        raise ValueError(f"{flag}: no such file: {value}")
    raise ValueError(f"{flag}: {value!r} is none of {', '.join(kinds)} and no such file: {value}")


def file_dtype(path: str) -> str:
    """The short dtype name (``bf16``, ``fp16``, ``fp32``: :data:`TORCH_DTYPES`) of the embeddings in
    activation file ``path``: what the captured call ran in (inside autocast, the autocast dtype),
    hence the dtype to tune for on it."""
    dtype = load_file(path).e.dtype
    return next(name for name, dt in TORCH_DTYPES.items() if dt == dtype)


def load_file(path: str):
    """The :class:`~cce_autotune.data.captured.Activations` of ``path`` (loaded once per file version)."""
    st = os.stat(path) if os.path.isfile(path) else None
    return _load_cached(os.path.abspath(path), st.st_mtime_ns if st else 0, st.st_size if st else 0)


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, mtime: int, size: int):
    """(``mtime`` and ``size`` only key the cache: a rewritten file is read again.)"""
    return captured.load_activations(path)


def make_data(kind: str, B: int, V: int, D: int, dtype=torch.bfloat16, device="cpu", seed: int = 0, **options):
    """(e, c, targets) of kind ``lm``, ``sampled``, ``random`` or ``real``, or read from an activation file
    (``kind`` is its path: :mod:`cce_autotune.data.captured`; V and D must be the file's, B rows are
    its first B, repeated in order if it holds fewer); ``options`` go to that kind's generator
    (e.g. ``entropy`` for ``lm``, ``steps`` for ``real``)."""
    if kind not in DATA_KINDS:
        acts = load_file(resolve_data(kind, DATA_KINDS, "data"))
        if (acts.V, acts.D) != (V, D):
            raise ValueError(f"data: {kind} holds V={acts.V}, D={acts.D}, not the V={V}, D={D} asked for")
        return captured.rows_for(acts, B, dtype, device)[:3]
    if kind == "lm":
        return lm_like(B, V, D, dtype, device, seed, **options)
    if kind == "sampled":
        return lm_sampled(B, V, D, dtype, device, seed, **options)
    if kind == "random":
        return random_data(B, V, D, dtype, device, seed, **options)
    return real.real_data(B, V, D, dtype, device, seed, **options)

"""Vocabulary orders remembered between calls, one per classifier.

The backward sorts the vocabulary by descending average logit so that the few tiles with any
gradient cluster.  A training step's classifier is the previous step's plus a small update, so the
order a backward computed is a good order for the next forward too: walking it, the forward can
record where the live tiles are (see :mod:`cce_autotune.tile_map`) and the next backward launches
only those instead of recomputing every tile.

An order is only ever a performance hint: any permutation gives exact results, a stale or foreign
one only makes more tiles look live.  Orders are keyed by the classifier's storage (device, data
pointer, shape, dtype), so an optimiser's in-place update keeps the key; at most
:data:`MAX_ENTRIES` classifiers are remembered (least recently used goes first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

__all__ = ["sort_order", "lookup", "remember", "pause", "paused", "clear", "classifier_key", "MAX_ENTRIES"]

MAX_ENTRIES = 8

_lock = threading.Lock()
_orders: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_pauses: dict = {}  # classifier key -> calls left without walking (filtering cannot pay)


def sort_order(e_rows: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """The vocabulary by descending average logit over the rows of ``e_rows`` (n, D), counting row i
    with ``weights[i]`` (0 for ignored rows; default 1): the order the backward sorts by.  The mean of
    the rows times C is one matrix-vector product in the inputs' dtype (softcap, monotonic, is left
    out of the key).  Returns an int32 (V,) permutation."""
    n = max(1, e_rows.shape[0])
    if weights is None:
        mean = e_rows.sum(0) / n
    else:
        mean = (weights.to(e_rows.dtype) @ e_rows) / n
    key = torch.mv(c, mean.to(c.dtype)).float()
    if bias is not None:
        key = key + bias.float()
    return torch.argsort(key, descending=True).to(torch.int32)


def classifier_key(c: torch.Tensor) -> tuple:
    """What per-classifier state is keyed by: its storage (device, data pointer, shape, strides, dtype),
    which an optimiser's in-place update keeps."""
    return (str(c.device), c.data_ptr(), tuple(c.shape), tuple(c.stride()), c.dtype)


def lookup(c: torch.Tensor) -> torch.Tensor | None:
    """The order (int32 (V,) permutation) last remembered for classifier ``c``, or None."""
    key = classifier_key(c)
    with _lock:
        perm = _orders.get(key)
        if perm is not None:
            _orders.move_to_end(key)
        return perm


def remember(c: torch.Tensor, perm: torch.Tensor) -> None:
    """Keep ``perm`` as the vocabulary order of classifier ``c``."""
    if perm.shape != (c.shape[0],):
        raise ValueError(f"perm: expected shape ({c.shape[0]},), got {tuple(perm.shape)}")
    key = classifier_key(c)
    with _lock:
        _orders[key] = perm
        _orders.move_to_end(key)
        while len(_orders) > MAX_ENTRIES:
            _orders.popitem(last=False)


def pause(c: torch.Tensor, calls: int) -> None:
    """The next ``calls`` calls of classifier ``c`` do not use its order (see :func:`paused`)."""
    with _lock:
        _pauses[classifier_key(c)] = calls
        while len(_pauses) > MAX_ENTRIES:
            _pauses.pop(next(iter(_pauses)))


def paused(c: torch.Tensor) -> bool:
    """True (and one call fewer left) while classifier ``c`` is paused: the planner found that its
    tile map and sort cost more than they skip, so this call neither walks nor sorts."""
    key = classifier_key(c)
    with _lock:
        left = _pauses.get(key, 0)
        if left <= 0:
            return False
        if left == 1:
            del _pauses[key]
        else:
            _pauses[key] = left - 1
        return True


def clear() -> None:
    """Forget every remembered order and pause (the next call of each classifier sorts afresh)."""
    with _lock:
        _orders.clear()
        _pauses.clear()

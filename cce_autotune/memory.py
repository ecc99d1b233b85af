"""What is remembered about each classifier between calls: one record per classifier, one cache.

A training step's classifier is the previous step's plus a small update, so what one call learned
about it serves the next:

- the vocabulary order the backward sorted (the next forward walks it and records where the live
  tiles are: :mod:`cce_autotune.tile_map`);
- a pause: for a number of calls the forward neither walks nor maps (the planner found that
  filtering cannot pay for this classifier now);
- the accuracy check's verdict: which candidate filter passed at the call's filter, for how many more
  calls, and the dead-tile correction's direction when the filter needs it
  (:mod:`cce_autotune.planning.accuracy`).

Records are keyed by the classifier's storage (device, data pointer, shape, strides, dtype), which an
optimiser's in-place update keeps. At most :data:`MAX_ENTRIES` classifiers are remembered; the least
recently used record goes first. The planner reads and writes the records
(:mod:`cce_autotune.planning.planner`); :func:`clear` forgets everything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_ENTRIES", "classifier_key", "order", "remember_order", "pause", "take_pause", "verdict",
           "remember_verdict", "clear"]

MAX_ENTRIES = 8


@dataclass
class _Record:
    order: Any = None  # (V,) int32 permutation: the vocabulary by descending average logit
    pause_left: int = 0  # calls left that neither walk nor map
    verdict: list | None = None  # [filter_eps asked, candidate chosen, calls left, correction direction]


_lock = threading.Lock()
_records: "OrderedDict[tuple, _Record]" = OrderedDict()


def classifier_key(c) -> tuple:
    """What a classifier's record is keyed by: its storage (device, data pointer, shape, strides,
    dtype), which an optimiser's in-place update keeps."""
    return (str(c.device), c.data_ptr(), tuple(c.shape), tuple(c.stride()), c.dtype)


def _record(c, create: bool) -> _Record | None:
    """(Under the lock.) The classifier's record, now the most recently used; None when it has none
    and ``create`` is false."""
    key = classifier_key(c)
    rec = _records.get(key)
    if rec is None:
        if not create:
            return None
        rec = _records[key] = _Record()
        while len(_records) > MAX_ENTRIES:
            _records.popitem(last=False)
    _records.move_to_end(key)
    return rec


def order(c):
    """The vocabulary order (int32 (V,) permutation) last remembered for classifier ``c``, or None."""
    with _lock:
        rec = _record(c, create=False)
        return None if rec is None else rec.order


def remember_order(c, perm) -> None:
    """Keep ``perm`` as the vocabulary order of classifier ``c``."""
    if tuple(perm.shape) != (c.shape[0],):
        raise ValueError(f"perm: expected shape ({c.shape[0]},), got {tuple(perm.shape)}")
    with _lock:
        _record(c, create=True).order = perm


def pause(c, calls: int) -> None:
    """The next ``calls`` calls of classifier ``c`` neither walk its order nor map (see :func:`take_pause`)."""
    with _lock:
        _record(c, create=True).pause_left = calls


def take_pause(c) -> bool:
    """True (and one call fewer left) while classifier ``c`` is paused."""
    with _lock:
        rec = _record(c, create=False)
        if rec is None or rec.pause_left <= 0:
            return False
        rec.pause_left -= 1
        return True


def verdict(c, filter_eps: float, correctable: bool = False) -> tuple | None:
    """``(candidate index, direction or None)`` the accuracy check last chose for classifier ``c`` at
    ``filter_eps`` (one call fewer left), or None when a check is due (none remembered, another filter
    asked, a correction remembered that this call cannot take, or its calls used up). The direction
    of the dead-tile correction stays as the check fitted it: the classifier moves slowly between
    checks."""
    with _lock:
        rec = _record(c, create=False)
        v = None if rec is None else rec.verdict
        if v is None or v[0] != filter_eps or v[2] <= 0 or (v[3] is not None and not correctable):
            return None
        v[2] -= 1
        return v[1], v[3]


def remember_verdict(c, filter_eps: float, choice: int, calls: int, direction=None) -> None:
    """Keep the check's ``choice`` (and the correction's ``direction``, if any) for the next ``calls``
    calls of classifier ``c`` at ``filter_eps``."""
    with _lock:
        _record(c, create=True).verdict = [filter_eps, choice, calls, direction]


def clear() -> None:
    """Forget every classifier (the next call of each sorts, maps and checks afresh)."""
    with _lock:
        _records.clear()

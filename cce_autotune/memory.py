"""What is remembered about each classifier between calls: one record per classifier, one cache.

A training step's classifier is the previous step's plus a small update, so what one call learned
about it serves the next:

- the vocabulary order the backward sorted (the next forward walks it and records where the live
  tiles are: :mod:`cce_autotune.tile_map`);
- a pause: for a number of calls the forward neither walks nor maps (the planner found that
  filtering cannot pay for this classifier now);
- the accuracy check's verdicts: which candidate filter passed at the call's filter, for how many more
  calls, the dead-tile correction's direction when the filter needs it
  (:mod:`cce_autotune.planning.accuracy`), and a fingerprint of what it was measured on (the
  classifier's content and the call's rows) so that only calls like the one measured reuse it; a
  few per classifier, for the several losses that may share one (an auxiliary head, distillation);
- the last mapped backward's measurements (its live shares and whether the dropped-mass guard and the
  verdict's fingerprint held), perhaps still on their way to the host: the next backward of the same
  shape plans on them instead of waiting for its own (opaque here: the planner makes and reads them).

The orders, pauses and measurements are speed hints: any order gives exact results, a pause only filters less. A
verdict changes what the backward computes, so the planner applies it only to a call whose
fingerprint matches (:func:`cce_autotune.planning.planner.check_filter`).

Records are keyed by the classifier's storage (device, data pointer, shape, strides, dtype), which an
optimiser's in-place update keeps. At most :data:`MAX_ENTRIES` classifiers are remembered; the least
recently used record goes first. The planner reads and writes the records
(:mod:`cce_autotune.planning.planner`); :func:`clear` forgets everything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_ENTRIES", "MAX_VERDICTS", "Verdict", "classifier_key", "order", "remember_order", "pause", "take_pause",
           "verdicts", "use_verdict", "remember_verdict", "measured", "remember_measured", "clear"]

MAX_ENTRIES = 8
MAX_VERDICTS = 4  # per classifier (calls of different losses on one classifier each keep theirs)


@dataclass
class Verdict:
    """One accuracy check's result for one classifier: at ``filter_eps``, candidate ``choice`` passed
    (with the correction ``direction``, or None); ``calls`` more calls may reuse it; ``fingerprint``:
    what it was measured on (opaque here: the planner makes and compares it)."""

    filter_eps: float
    choice: int
    calls: int
    direction: Any = None
    fingerprint: Any = None


@dataclass
class _Record:
    order: Any = None  # (V,) int32 permutation: the vocabulary by descending average logit
    pause_left: int = 0  # calls left that neither walk nor map
    verdicts: list = field(default_factory=list)  # Verdict, most recent last
    measured: Any = None  # the last mapped backward's measurements (the planner's)


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


def verdicts(c, filter_eps: float, correctable: bool = False) -> list:
    """The verdicts remembered for classifier ``c`` at ``filter_eps`` that a call may still reuse (calls
    left; a correction only where ``correctable``), most recent first."""
    with _lock:
        rec = _record(c, create=False)
        if rec is None:
            return []
        return [v for v in reversed(rec.verdicts) if v.filter_eps == filter_eps and v.calls > 0
                and (v.direction is None or correctable)]


def use_verdict(c, verdict: Verdict) -> None:
    """One call fewer left for ``verdict`` (one of :func:`verdicts`)."""
    with _lock:
        verdict.calls -= 1


def remember_verdict(c, verdict: Verdict) -> None:
    """Keep ``verdict`` for classifier ``c`` (used-up verdicts go; the oldest beyond
    :data:`MAX_VERDICTS`)."""
    with _lock:
        rec = _record(c, create=True)
        rec.verdicts = [v for v in rec.verdicts if v.calls > 0]
        rec.verdicts.append(verdict)
        del rec.verdicts[:-MAX_VERDICTS]


def measured(c):
    """The measurements last remembered for classifier ``c`` (:func:`remember_measured`), or None."""
    with _lock:
        rec = _record(c, create=False)
        return None if rec is None else rec.measured


def remember_measured(c, m) -> None:
    """Keep ``m`` (None: forget) as the last mapped backward's measurements of classifier ``c``."""
    with _lock:
        rec = _record(c, create=m is not None)
        if rec is not None:
            rec.measured = m


def clear() -> None:
    """Forget every classifier (the next call of each sorts, maps and checks afresh)."""
    with _lock:
        _records.clear()

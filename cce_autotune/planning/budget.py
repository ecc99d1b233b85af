"""The memory budget of a call: the extra device memory (beyond dE, dC and dbias themselves) its
backward may hold at its peak, and the size strings that set it.

By default ``0.05 · (|dE| + |dC|) + 32 MiB`` plus one fp32 copy of dE (its accumulator: 4·n·D bytes,
the size of one activation whatever the vocabulary) and, for a classifier of another dtype than e (an
fp32 ``lm_head`` under autocast), one copy of it in e's dtype (the copy autocast makes for every
``F.linear`` of it); the ``max_extra_memory`` argument or
``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY`` ("2GiB", "512MiB", a byte count, "auto" or "none") change it.
"""

from __future__ import annotations

import math
import os
import re

__all__ = ["ENV_MAX_EXTRA", "MiB", "parse_bytes", "memory_budget"]

ENV_MAX_EXTRA = "CCE_AUTOTUNE_MAX_EXTRA_MEMORY"
MiB = 2**20

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(value, name: str = "max_extra_memory") -> int | None | str:
    """``"auto"`` (the default budget), None / ``"none"`` (unlimited), or a byte count from an int or
    a string such as ``"512MiB"``, ``"2 GB"``, ``"1.5GiB"``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", ""):
            return "auto"
        if text in ("none", "unlimited", "inf"):
            return None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; use e.g. '512MiB', '2GiB', a byte count, "
                             "'auto' or 'none'")
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a non-negative byte count, a size string, 'auto' or None, got {value!r}")
    return int(value)


def memory_budget(requested, grad_bytes: int, accumulator_bytes: int = 0, cast_bytes: int = 0) -> int | None:
    """Extra bytes the backward may hold: ``requested`` (a :func:`parse_bytes` value; "auto" defers to
    ``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY``, then to the default ``0.05 · grad_bytes + 32 MiB`` plus
    ``accumulator_bytes``, one fp32 copy of dE: the accumulator that keeps dE at fp32 accuracy,
    the size of one activation of the model, whatever the vocabulary, plus ``cast_bytes``, the
    classifier's copy in e's dtype when its own differs: what autocast holds for PyTorch's path)."""
    req = parse_bytes(requested)
    if req == "auto":
        env = os.environ.get(ENV_MAX_EXTRA)
        req = parse_bytes(env, ENV_MAX_EXTRA) if env else "auto"
    if req == "auto":
        return int(0.05 * grad_bytes) + 32 * MiB + accumulator_bytes + cast_bytes
    return req

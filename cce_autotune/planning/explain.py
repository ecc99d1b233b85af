"""Saying how calls run: ``$CCE_AUTOTUNE_EXPLAIN`` prints plans to stderr, and :func:`recording` hands
the plans made inside a block to the code that opened it (the calibration, the tests).

``CCE_AUTOTUNE_EXPLAIN=1`` prints every new (shape, strategy, sizes, map or not, filter, what the
accuracy check chose) once; ``=all`` prints every plan and every accuracy check's measurements.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, NamedTuple

__all__ = ["ENV_EXPLAIN", "Recorded", "report", "report_check", "recording"]

ENV_EXPLAIN = "CCE_AUTOTUNE_EXPLAIN"

_seen_lock = threading.Lock()
_seen: set = set()
_sinks: list = []  # the open recording() blocks' lists (process-wide: autograd runs CUDA backwards in its own threads)


class Recorded(NamedTuple):
    """One plan made inside a :func:`recording` block: the backward plan (or the fused strategy's),
    the call's sizes, and the whole call's plan (None for a plan made outside a call)."""

    plan: Any
    problem: Any
    call: Any = None


def _mode() -> str:
    mode = os.environ.get(ENV_EXPLAIN, "").strip().lower()
    return "" if mode in ("", "0", "false", "no") else mode


def report(plan, p, checked: str = "", call=None) -> None:
    """Hand the backward ``plan`` of problem ``p`` (and ``call``, the whole call's plan) to the open
    :func:`recording` blocks, and print it to stderr as ``$CCE_AUTOTUNE_EXPLAIN`` says (``checked``:
    how the accuracy check chose the filter, part of what makes a plan new)."""
    for sink in tuple(_sinks):
        sink.append(Recorded(plan, p, call))
    mode = _mode()
    if not mode:
        return
    key = (p.n, p.V, p.D, plan.strategy, plan.chunk_v, plan.row_group, plan.de_fp32, plan.row_block,
           plan.dc_fp32, plan.tile_products, plan.use_map, plan.filter_eps, checked)
    if mode != "all":
        with _seen_lock:
            if key in _seen:
                return
            _seen.add(key)
    print(f"cce_autotune plan (n={p.n}, V={p.V}, D={p.D}): {plan.describe()}", file=sys.stderr, flush=True)


def report_check(p, measured, limit: float) -> None:
    """Print what the accuracy check measured (``(filter_eps, dE error, corrected)`` triples) to
    stderr when ``$CCE_AUTOTUNE_EXPLAIN=all``."""
    if not measured or _mode() != "all":
        return
    text = ", ".join(f"{err:.2e} at {eps:.2g}{' corrected' if fixed else ''}" for eps, err, fixed in measured)
    print(f"cce_autotune check (n={p.n}, V={p.V}, D={p.D}): dE error {text} (limit {limit:g})", file=sys.stderr,
          flush=True)


def forget() -> None:
    """Print every plan again as if new."""
    with _seen_lock:
        _seen.clear()


@contextlib.contextmanager
def recording():
    """``with recording() as plans:`` collects, in order, a :class:`Recorded` for each plan made inside
    the block (each call's backward, or its fused forward)."""
    plans: list = []
    with _seen_lock:
        _sinks.append(plans)
    try:
        yield plans
    finally:
        with _seen_lock:
            _sinks.remove(plans)

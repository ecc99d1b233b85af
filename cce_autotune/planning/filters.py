"""The one ladder of filters: the candidates below a call's ``filter_eps`` that the planner may lower
it to, and the accuracy bound they are held to.

Two measurements walk the ladder, both in :func:`cce_autotune.planning.planner.plan_backward` (the one
place that lowers a filter): the accuracy check (:mod:`cce_autotune.planning.accuracy`) measures the
dE error of the rungs in :data:`CHECK_RUNGS` and takes the first within :data:`MAX_ERROR`; the
dropped-mass guard steps down :data:`GUARD_RUNGS` from the filter it is given while the tile map's
bound says too much of the gradient's mass would be dropped.
"""

from __future__ import annotations

__all__ = ["LADDER", "CHECK_RUNGS", "GUARD_RUNGS", "MAX_ERROR", "CONFIDENCE", "GROUP", "ladder", "summed_blocks", "SUMMED_DC_BLOCKS"]

# Factors of the call's filter, largest first. Fine near the call's own filter: on real data the
# error falls fast over a few halvings while the live share, and so the backward's cost, climbs.
LADDER = (1.0, 2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4, 2.0**-6, 2.0**-8)
# The rungs the accuracy check may choose (all of them).
CHECK_RUNGS = (0, 1, 2, 3, 4, 5, 6)
# The dropped-mass guard's steps below the filter it starts from: x1, x2^-4, x2^-8.
GUARD_RUNGS = (0, 4, 6)
# The largest relative dE error a filter may cause, by the check's upper bound (the sampled rows'
# error raised by CONFIDENCE standard errors of the sample). 16-bit rounding adds about 2e-3 (exact
# mode) in quadrature: the whole dE stays near 7e-3, under the tuner's gate of 1e-2.
MAX_ERROR = 7e-3
# Standard errors the check adds to a sample's estimate (one-sided 95 %). On LM-like data near a
# filter's edge, 1 % of the rows held 59 % of what the filter drops, and estimates from 256 random
# rows ranged from 0.62x to 1.37x the whole call's error (5th to 95th percentile); deterministic mode
# at 32768 x 128256 x 4096 measured dE 9.3e-3 where its sample had passed the filter.
CONFIDENCE = 1.645
# A 16-bit dC that the fused strategy sums over k blocks of rows in dC itself is rounded k times: its
# relative error measured about eps / 5 * sqrt(k), eps = 2^-7 (bf16; H200, B = 8,192-32,768, LM-like data of
# both generators: k = 8: 3.1-4.2e-3, k = 32: 5.8-9.2e-3), beside the one rounding that every plan makes
# (about eps / 4: exact mode's dC error, 1.6-2.2e-3).


def summed_blocks(max_error: float, eps: float = 2.0**-7) -> int:
    """The most blocks a 16-bit dC may be summed over in dC itself for its error, by the model above,
    to stay within ``max_error`` (at least 1: one block is one rounding)."""
    room = max(0.0, max_error**2 - (eps / 4) ** 2) ** 0.5
    return max(1, int((room / (eps / 5)) ** 2))


# The blocks a default call may sum that way (18; fp16, 8x finer, is held to bf16's count). An exact
# call sums none: its bound, 3e-3, leaves no measured room.
SUMMED_DC_BLOCKS = summed_blocks(MAX_ERROR)
# Candidates the check measures together after the call's own filter failed (each group's logits
# recomputed once).
GROUP = 3


def ladder(filter_eps: float, rungs) -> list:
    """The candidate filters ``filter_eps * LADDER[r]`` for each rung ``r`` in ``rungs``, in order."""
    return [filter_eps * LADDER[r] for r in rungs]

"""How one call runs, and why: every decision about a call is made here, into one
:class:`~cce_autotune.plans.CallPlan`; :mod:`cce_autotune.runtime.execute` runs it and decides nothing.

A call is planned in three steps, as what they need becomes known:

1. :func:`plan_call` (the call's options, its kernel variants, the device): PyTorch or the kernels,
   the filter, determinism;
2. :func:`plan_forward` (and what :mod:`cce_autotune.memory` remembers of the classifier): whether
   the forward walks a remembered vocabulary order and records the tile map, or computes the
   gradients itself (the fused strategy), and whether an fp32 classifier is converted whole;
3. :func:`plan_gradients` (the forward's tile map, the gradient's coefficients): the filter the
   backward applies (the accuracy check of :mod:`~cce_autotune.planning.accuracy` and the
   dropped-mass guard, both walking :mod:`~cce_autotune.planning.filters`' ladder), the strategy and
   its sizes (:func:`plan_backward`), the dead-tile correction, and whether the classifier pauses.

The planner weighs, for the call at hand, the live share the forward's tile map measures, a cost
model of each strategy in units of one matmul of the shape (2·n·V·D flops) with coefficients per GPU
(:mod:`~cce_autotune.planning.costs`, handed in by the caller), and the memory budget
(:mod:`~cce_autotune.planning.budget`). The fastest strategy that fits is taken; when none fits, the
smallest. The strategies and their formulas are those of :mod:`cce_autotune.strategies`.

``$CCE_AUTOTUNE_EXPLAIN=1`` prints each new plan (:mod:`~cce_autotune.planning.explain`);
``cce-tune explain`` prints the plans of a shape for given live shares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, NamedTuple

from .. import memory, strategies
from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import interpreting, load_utility
from ..launch import cdiv
from ..plans import BackwardPlan, CallPlan, CallProblem, ForwardPlan
from ..strategies.base import FORWARD_TILE_V, PlanContext, mm_ms
from ..strategies.forward import convert_width
from ..tile_map import dropped_share, measure
from . import accuracy, explain, filters
from .budget import memory_budget

__all__ = ["choose_impl", "plan_call", "plan_forward", "plan_gradients", "plan_backward", "plan_fused",
           "fused_allowed", "records_map", "converts_whole", "call_budget", "with_forward_tiles", "check_filter", "fingerprint", "fingerprint_tensor", "fingerprint_held", "decide", "decide_unread", "Decision", "Measurement", "Fingerprint", "exact_cost", "unfiltered_cost", "default_strategy", "Evidence"]


# -- 1. the call ----------------------------------------------------------------------------------
def choose_impl(o, device) -> str:
    """"triton" (the kernels) or "torch" (the chunked PyTorch path) for options ``o`` on ``device``."""
    impl = o.impl
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    elif impl == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"impl: 'triton' needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run the "
            "kernels on the CPU through Triton's interpreter, or use impl='torch'"
        )
    if o.label_smoothing and o.softcap is not None:
        # The smoothing term's gradient through the softcap is not uniform across the vocabulary:
        # the kernels' outside rank-one term cannot carry it. The chunked PyTorch path does.
        impl = "torch"
    return impl


def plan_call(o, impl: str, variants, dispatched: bool, p: CallProblem | None = None, costs=None,
              measurable: bool = True) -> CallPlan:
    """The call's first plan: ``variants`` as the kernels run them (``dispatched``: they come from
    the tuned-config database, not from the caller), the filter, determinism; on the kernels' path
    (``p`` and ``costs`` given), how a classifier of another dtype than e (``p.cast_bytes``: an fp32
    one with 16-bit e) is converted: whole, once, when the copy fits the memory budget (then every
    strategy runs as for a 16-bit classifier), else a chunk or window at a time inside the kernel
    launches. ``measurable``: the call may read what it measures back to the host (not while a CUDA
    graph is being captured: a replay would not run the host's decisions again); a call that may not
    filters nothing, since nothing could measure what a filter costs it."""
    kv = variants
    eps = None
    forward = ForwardPlan()
    if kv is not None:
        eps = kv.backward.filter_eps if o.filter_eps == "auto" else o.filter_eps
        if not measurable:
            eps = None
        if dispatched and kv.backward.strategy != "auto":
            # A tuned entry's strategy was measured on the tuner's data; which strategy runs is the
            # planner's choice for each call, from the live share it measures and the memory budget.
            kv = kv.replace(backward=kv.backward.replace(strategy="auto"))
        if o.deterministic and impl == "triton":
            # LSE splits merged through a buffer (not under locks in arrival order); the backward's
            # strategy one whose sums use no float atomics.
            kv = kv.replace(lse_forward=kv.lse_forward.replace(merge="buffer"))
            if kv.backward.strategy != "auto" and not strategies.get(kv.backward.strategy).deterministic:
                kv = kv.replace(backward=kv.backward.replace(strategy="auto"))
        if p is not None:
            whole = converts_whole(p, o.max_extra_memory)
            forward = ForwardPlan(
                convert_classifier=whole,
                convert_chunk=convert_width(p.V, p.D, kv.lse_forward.block_v, p.elem, costs.convert_bytes)
                if p.cast_bytes and not whole else 0)
    return CallPlan(impl=impl, variants=kv, filter_eps=eps, deterministic=bool(o.deterministic), forward=forward,
                    costs=costs)


def converts_whole(p: CallProblem, max_extra_memory) -> bool:
    """Whether a classifier of another dtype than e is converted whole, once: when its copy fits the
    memory budget (the default budget allows it: autocast holds the same copy for PyTorch's path)."""
    if not p.cast_bytes:
        return False
    budget = call_budget(p, max_extra_memory, converted=False)
    return budget is None or p.cast_bytes <= budget


def call_budget(p: CallProblem, max_extra_memory, converted: bool) -> int | None:
    """The memory budget of a call's strategies (:func:`~cce_autotune.planning.budget.memory_budget`:
    with dE's fp32 accumulator and, for a classifier of another dtype than e, its copy in e's dtype);
    less that copy when the call makes it (``converted``: it is held for the whole call)."""
    budget = memory_budget(max_extra_memory, p.grad_bytes, 4 * p.n_all * p.D, p.cast_bytes)
    if budget is not None and converted:
        budget = max(0, budget - p.cast_bytes)
    return budget


def fused_allowed(o, plan: CallPlan, wider_classifier: bool) -> bool:
    """Whether the call's loss lets the gradients be computed in the forward for a unit incoming
    gradient with one coefficient per row for the softmax and the onehot: "mean" or "sum", not the
    returned LSE's gradient (it would reach the backward only), no label smoothing or z-loss, and a
    classifier the kernels read in e's dtype (an fp32 one only when it is converted whole: else its
    cuBLAS logits would need a whole converted copy of C)."""
    return (o.reduction in ("mean", "sum") and not o.return_lse and not o.label_smoothing and not o.z_loss
            and (not wider_classifier or plan.forward.convert_classifier))


def records_map(variant, filter_eps) -> bool:
    """Whether a call filtering at ``filter_eps`` has the forward walk a sorted order and record the
    tile map for ``variant`` (the strategy it asks for must be able to launch from it)."""
    return (variant.tile_map and variant.sort_vocab and filter_eps is not None
            and (variant.strategy == "auto" or strategies.get(variant.strategy).uses_map(variant)))


# -- 2. the forward -------------------------------------------------------------------------------
def plan_forward(plan: CallPlan, p: CallProblem, c, costs, *, needs_grad: bool, fused_allowed: bool,
                 max_extra_memory="auto") -> CallPlan:
    """The forward's part of ``plan`` (made by :func:`plan_call`) for classifier ``c`` (its memory is
    read and, for a pause, counted down): ``fused_allowed``: the call's loss and classifier let the
    gradients be computed in the forward (see :func:`fused_allowed`)."""
    kv = plan.variants
    bw = kv.backward
    eps = plan.filter_eps
    # With the tile map, the backward sorts the vocabulary for the classifier's next call, whose
    # forward walks that order and records where the live tiles are; when a backward found that
    # filtering cannot pay, the classifier is paused and the gradients may be computed right here instead.
    sort = needs_grad and p.n > 0 and records_map(bw, eps)
    walk, paused = None, False
    if sort:
        paused = memory.take_pause(c)
        if not paused:
            walk = memory.order(c)
    fused = None
    asks_forward = bw.strategy != "auto" and strategies.get(bw.strategy).in_forward
    if needs_grad and p.n > 0 and (paused or eps is None or asks_forward):
        fused = plan_fused(p, bw, paused=paused, exact=eps is None, allowed=fused_allowed,
                           budget=call_budget(p, max_extra_memory, plan.forward.convert_classifier), costs=costs,
                           forward=kv.lse_forward)
    if fused is not None or paused:
        sort = False  # (paused: the planner found filtering cannot pay for this classifier now)
        walk = None
    copy = plan.forward.convert_chunk
    if walk is not None and not copy:  # (a classifier converted in chunks is copied in the walked order already)
        copy = walk_copy(p, kv.lse_forward, call_budget(p, max_extra_memory, plan.forward.convert_classifier), costs)
    forward = replace(plan.forward, walk=walk, sort=sort, fused=fused,
                      paused=paused, convert_chunk=copy)
    out = replace(plan, forward=forward)
    if fused is not None:
        explain.report(fused, p, call=out)
    return out


def walk_copy(p: CallProblem, variant, budget: int | None, costs) -> int:
    """Rows of the classifier the forward copies at a time in the order it walks, each copy a chunk
    that the LSE kernel reads by position (as TMA tiles where it can), or 0: the kernel gathers C's rows
    by the order itself. Gathering in the kernel costs ``walk_gather`` (every row block gathers every
    tile: pointer loads in place of TMA, in proportion to the matmul); the copies move C twice (read,
    written: ``elem x flops_per_byte / n`` in matmuls) and take ``walk_copy_ms`` of the host's time a
    chunk. The chunk is at most ``convert_bytes`` and the memory budget."""
    limit = costs.convert_bytes if budget is None else min(costs.convert_bytes, budget)
    if limit < variant.block_v * p.D * p.elem:
        return 0
    rows = convert_width(p.V, p.D, variant.block_v, p.elem, limit)
    chunks = -(-p.V // rows)
    copies = p.elem * costs.flops_per_byte / max(1, p.n) + chunks * costs.walk_copy_ms / mm_ms(p, costs)
    return rows if copies < costs.walk_gather else 0


def plan_fused(p: CallProblem, variant, *, paused: bool, allowed: bool, exact: bool = False, budget: int | None,
               costs, forward=None) -> BackwardPlan | None:
    """The plan of gradients computed in the forward when it is the one to run, else None (the
    forward computes the LSE and the backward is planned when it runs).

    The forward must decide before any tile map exists, so it goes by what it knows: the call filters
    nothing (``exact``), the previous call of the classifier found that filtering cannot pay
    (``paused``: most tiles live), or the variant asks for an in-forward strategy. ``allowed``: the
    call's loss permits it. The strategy must fit ``budget`` with blocks of at least the cost model's
    ``fused_min_rows`` rows (or all rows) and beat the forward plus the exact backward by the cost
    model, unless the variant asks for it. A 16-bit dC without room for its fp32 accumulator is summed
    over at most :data:`~cce_autotune.planning.filters.SUMMED_DC_BLOCKS` blocks (the accuracy of a
    default call), over none in an exact call, whatever the variant asks. ``forward``: the call's LSE
    variant, whose tiling the plan runs with (``forward_tiles``) and whose ``block_v`` its statistics
    follow; None: estimated at :data:`~cce_autotune.strategies.base.FORWARD_TILE_V`, with the
    backward variant's own tiling."""
    if not allowed:
        return None
    if variant.strategy != "auto":
        chosen = strategies.get(variant.strategy)
        if not chosen.in_forward:
            return None
        forced = True
    elif paused or exact:
        chosen = next((s for s in strategies.all_strategies() if s.in_forward), None)
        forced = False
        if chosen is None:
            return None
    else:
        return None
    opt = chosen.forward_option(p, costs, budget, forced=forced,
                                tile_v=forward.block_v if forward is not None else FORWARD_TILE_V,
                                summed_blocks=1 if exact else filters.SUMMED_DC_BLOCKS)
    if opt is None:
        return None
    other = costs.forward + exact_cost(p, variant, budget, costs)
    if opt.cost >= other and not forced:
        return None
    if forced:
        why = "the variant asks for it"
    elif paused:
        why = ("the previous call of this classifier found most tiles live; no recompute beats the forward plus "
               f"an exact backward (est {other:.2f} mm)")
    else:
        why = f"exact: no recompute beats the forward plus an exact backward (est {other:.2f} mm)"
    plan = BackwardPlan(strategy=chosen.name, use_map=False, row_block=opt.sizes["row_block"],
                        dc_fp32=opt.sizes.get("dc_fp32", False), cost=opt.cost, extra_bytes=opt.extra_bytes,
                        budget=budget, reason=why)
    return _forward_tiling(plan, variant, forward) if forward is not None else plan


# -- 3. the gradients ----------------------------------------------------------------------------
@dataclass
class Evidence:
    """What the backward knows when it plans: the inputs, the rows taking part and their targets, the
    LSE (infinite where a row has no gradient), the forward's tile map (None: the forward walked no
    order), and the gradient's coefficients (``coef_s`` of the softmax, ``coef_t`` of the onehot).

    ``shards``: None in one process; for one vocabulary shard of a call whose classifier is split over
    processes (the vocabulary-parallel loss, :mod:`cce_autotune.distributed`), what the shards do
    together: ``sum_(t)`` sums tensor ``t`` over the shards in place, ``min_(values)`` returns the
    element-wise minimum of a list of floats over the shards. Every shard then makes the same
    decisions about its filter, from the same numbers: whether to filter at all, the accuracy check
    over the whole vocabulary (each shard's dropped terms and its part of dE summed before the error
    is taken), a remembered verdict's reuse, and the pause."""

    e: Any
    c: Any
    bias: Any
    rows: Any
    targets: Any
    lse: Any
    softcap: float | None
    tile_map: Any
    coef_s: Any
    coef_t: Any
    shards: Any = None


def _agreed(shards, flags: list) -> list:
    """``flags`` (bools) held by every shard (one process: as they are)."""
    if shards is None:
        return list(flags)
    return [x > 0 for x in shards.min_([1.0 if f else 0.0 for f in flags])]


def _measured(filter_eps: float, eps: float | None, direction) -> str | None:
    """What the accuracy check's choice of ``eps`` (from the call's ``filter_eps``) and its correction
    ``direction`` add to the plan's reason."""
    measured = None
    if eps != filter_eps:
        measured = (f"filter_eps lowered to {eps:.2g} by the measured dE error (at most {filters.MAX_ERROR:g})"
                    if eps is not None else
                    f"every filter_eps down to {filters.ladder(filter_eps, filters.CHECK_RUNGS)[-1]:.2g} "
                    f"costs dE more than {filters.MAX_ERROR:g} (measured): exact")
    if direction is not None:
        measured = (measured + "; " if measured else "") + "the dead-tile correction (measured)"
    return measured


def _likely_verdict(ev: Evidence, filter_eps: float, correctable: bool) -> tuple | None:
    """``(verdict, filter_eps)``: the classifier's most recent verdict that this call may reuse if its
    fingerprint matches, and the filter it chose; None where there is none, or where the call is one
    shard of a vocabulary-parallel call (the shards agree on a verdict first: see :func:`check_filter`)."""
    if ev.shards is not None:
        return None
    cands, stored = _verdicts(ev, filter_eps, correctable)
    return (stored[0], cands[stored[0].choice]) if stored else None


def _verdicts(ev: Evidence, filter_eps: float, correctable: bool, rungs=None) -> tuple:
    """``(candidates, verdicts)``: the check's candidate filters below ``filter_eps`` (the rungs
    :data:`~cce_autotune.planning.filters.CHECK_RUNGS`, or ``rungs``) and the classifier's remembered
    verdicts that may name one of them, most recent first."""
    cands = filters.ladder(filter_eps, filters.CHECK_RUNGS if rungs is None else rungs)
    return cands, [v for v in memory.verdicts(ev.c, filter_eps, correctable) if v.choice < len(cands)]


def plan_gradients(plan: CallPlan, p: CallProblem, costs, ev: Evidence, *, fused_allowed: bool,
                   max_extra_memory="auto") -> CallPlan:
    """The backward's part of ``plan``: the filter it applies, the strategy and its sizes, the
    correction, the pause (written to the classifier's memory)."""
    kv = plan.variants
    bw = kv.backward
    c = ev.c
    tmap = ev.tile_map
    eps = plan.filter_eps
    measured = direction = None
    checked: tuple = ()
    can_check = tmap is not None and eps is not None
    if ev.shards is not None:  # the shards filter together or not at all, from the smallest filter of any
        least = ev.shards.min_([1.0 if can_check else 0.0, eps or 0.0])
        if can_check and least[0] < 1:
            measured = "another vocabulary shard of the call has no tile map: exact"
        can_check = least[0] > 0
        eps = least[1] if can_check else None
    budget = call_budget(p, max_extra_memory, plan.forward.convert_classifier)
    decided = found = None
    if can_check:
        correctable = (bw.strategy == "auto" or strategies.get(bw.strategy).takes_correction) \
            and not plan.deterministic
        seen = None
        likely = _likely_verdict(ev, eps, correctable) if filters.MAX_ERROR < float("inf") else None
        if likely is not None:
            # The classifier's last verdict will most likely be reused. Where the previous call's
            # measurements can plan this one, nothing is read back (the fingerprint is compared on
            # the device: see decide_unread). Else the backward is decided at the verdict's filter, and
            # this call's fingerprint rides on the same host copy; if it does not match, the verdicts
            # are looked at again with it (and the call checked) before deciding again.
            verdict, at = likely
            why = _measured(plan.filter_eps, at, verdict.direction)
            decided = decide_unread(p, bw, at, ev, verdict, budget=budget, costs=costs,
                                    fused_allowed=fused_allowed, deterministic=plan.deterministic, why=why,
                                    correction=verdict.direction is not None)
            if decided is None:
                now = fingerprint_tensor(ev, costs.check_rows)
                decided = decide(p, bw, at, tmap, ev.lse, budget=budget, costs=costs, fused_allowed=fused_allowed,
                                 deterministic=plan.deterministic, why=why, correction=verdict.direction is not None,
                                 extra=now, e=ev.e)
                seen = _fingerprint_values(decided.extra, now)
                if not _alike(verdict.fingerprint, seen):
                    decided = None
                elif decided.measured is not None:
                    decided.measured.verdict = verdict  # (measured under it: the next call may reuse both)
            if decided is not None:
                memory.use_verdict(c, verdict)
                eps, direction = at, verdict.direction
        if decided is None:
            weighed: dict = {}  # (filter, corrected) -> its Decision: the winner is not decided again

            def cheaper(corrected, plain) -> bool:  # (the two backwards' estimates; one copy each)
                for x, fix in ((corrected[0], True), (plain, False)):
                    weighed[(x, fix)] = decide(p, bw, x, tmap, ev.lse, budget=budget, costs=costs,
                                               fused_allowed=fused_allowed, deterministic=plan.deterministic,
                                               correction=fix)
                return weighed[(corrected[0], True)].plan.cost <= weighed[(plain, False)].plan.cost

            eps, checked, direction = check_filter(
                ev, eps, bw.block_b, bw.block_v, costs, correctable=correctable, seen=seen,
                cheaper=cheaper if ev.shards is None else None,  # (shards: the same choice on every shard)
                admissible=lambda x: float(dropped_share(tmap, ev.lse, x)) <= costs.max_dropped)  # (one copy each)
            found = weighed.get((eps, direction is not None))  # (decided while weighing, without its text)
        explain.report_check(p, checked, filters.MAX_ERROR)
        measured = _measured(plan.filter_eps, eps, direction)
        if found is not None:
            decided = found.explained(measured)
    elif eps is not None and filters.MAX_ERROR < float("inf"):
        # No tile map (a classifier's first call, a paused one, a variant without the map): nothing
        # measures what the filter would cost, so nothing is filtered.
        eps = None
        measured = "no tile map to check the filter against: exact"
    if decided is None:
        decided = decide(p, bw, eps, tmap, ev.lse, budget=budget, costs=costs, fused_allowed=fused_allowed,
                         deterministic=plan.deterministic, why=measured, correction=direction is not None)
    chosen, live, blocks, pause, reported, columns = decided[:6]
    if ev.shards is None:  # (what this call measured plans the classifier's next one: see decide_unread)
        memory.remember_measured(c, decided.measured)
    measured_exact = can_check and eps is None  # the check's verdict: exact
    if can_check and not _agreed(ev.shards, [not pause])[0] and not pause:
        # Another shard found that filtering cannot pay and runs exact: so does this one (its dropped
        # terms were measured together with the others').
        why = "another vocabulary shard of the call pauses: exact"
        chosen, live, blocks, _, reported, columns = decide(p, bw, None, tmap, ev.lse, budget=budget, costs=costs,
                                                            fused_allowed=fused_allowed, deterministic=plan.deterministic,
                                                            why=why)[:6]
        pause = True
    if measured_exact:
        pause = True  # the forward stops walking and mapping until the next check
    pause_calls = 0
    if pause:
        pause_calls = costs.check_every if measured_exact else costs.pause_calls
        memory.pause(c, pause_calls)
        eps = None  # the plan for this call filters nothing either
    elif chosen.filter_eps is not None:
        eps = chosen.filter_eps  # lowered by the dropped-mass guard
    chosen = with_forward_tiles(chosen, kv)
    strategy = strategies.get(chosen.strategy)
    # The correction was fitted to what the checked filter drops: not where the guard lowered it.
    correction = direction if chosen.use_map and strategy.takes_correction and chosen.filter_eps is None else None
    out = replace(plan, backward=chosen, run_eps=eps, correction=correction, live=live, blocks=blocks,
                  columns=columns, pause=pause_calls, checked=checked)
    explain.report(chosen, p, reported, call=out)
    return out


TILING = ("block_b", "block_v", "block_d", "group_b", "num_warps", "num_stages")


def with_forward_tiles(plan: BackwardPlan, variants) -> BackwardPlan:
    """``plan`` with the LSE forward variant's tiling where its strategy computes every tile as the
    forward does (no map, a strategy's ``forward_tiles``) and the backward variant's tiling differs."""
    return _forward_tiling(plan, variants.backward, variants.lse_forward)


def _forward_tiling(plan: BackwardPlan, backward, forward) -> BackwardPlan:
    """:func:`with_forward_tiles` for the ``backward`` and ``forward`` (LSE) variants."""
    if plan.use_map or not strategies.get(plan.strategy).forward_tiles:
        return plan
    tiles = {k: getattr(forward, k) for k in TILING}
    if all(getattr(backward, k) == v for k, v in tiles.items()):
        return plan
    return replace(plan, tiles=tiles)


def check_filter(ev: Evidence, filter_eps: float, block_b: int, block_v: int, costs, *, correctable: bool = False,
                 rungs=None, admissible=None, seen=None, cheaper=None) -> tuple:
    """``(filter_eps, measured, direction)``: the filter the accuracy check chooses on the ladder below
    ``filter_eps`` (the rungs :data:`~cce_autotune.planning.filters.CHECK_RUNGS`, or ``rungs``) for a
    backward of (``block_b`` x ``block_v``) tiles that launches from ``ev.tile_map`` (None: even the
    smallest costs too much, run exact); what it measured this call (nothing when a remembered verdict
    applies); the dead-tile correction's direction when the chosen filter needs it and ``correctable``
    says the call can take it (else None). ``admissible(filter_eps) -> bool``: the candidates that may
    run at all (the dropped-mass guard), None: all. ``seen``: the call's :func:`fingerprint`, where the
    caller has it already. ``cheaper(corrected, plain) -> bool``: where the chosen filter needs the
    correction and a smaller one passes without it, whether the corrected one (a filter, its direction)
    runs faster than the plain one (a filter); None: the corrected one is taken.

    A verdict is measured on a classifier's first mapped call and reused for at most
    ``costs.check_every`` calls, and only by a call like the one it was measured on
    (:func:`fingerprint`): the same classifier, moved little, and rows and targets alike. So another
    classifier at the same storage, one loaded in place, or another loss's rows on the same classifier
    are measured afresh; up to :data:`cce_autotune.memory.MAX_VERDICTS` verdicts are kept per
    classifier. The shards of a vocabulary-parallel call (``ev.shards``) reuse a verdict only when
    every shard finds the same one, and measure together (see :func:`~.accuracy.check`)."""
    if not filters.MAX_ERROR < float("inf"):
        return filter_eps, (), None
    cands, stored = _verdicts(ev, filter_eps, correctable, rungs)
    now = (seen or fingerprint(ev, costs.check_rows)) if stored else seen
    reuse = next((v for v in stored if _alike(v.fingerprint, now)), None)
    if ev.shards is not None:  # every shard reuses the same choice, or all measure afresh
        k = reuse.choice if reuse is not None else -1.0
        low, neg_high = ev.shards.min_([k, -k])
        reuse = reuse if low == -neg_high >= 0 else None
    if reuse is not None:
        memory.use_verdict(ev.c, reuse)
        return cands[reuse.choice], (), reuse.direction
    index, measured, direction, plain = accuracy.check(
        ev.e, ev.c, ev.bias, ev.rows, ev.targets, ev.lse, ev.softcap, ev.tile_map, block_b, block_v, cands,
        sample=costs.check_rows, max_bytes=costs.check_bytes, coef_s=ev.coef_s, coef_t=ev.coef_t,
        correctable=correctable, admissible=admissible, max_error=filters.MAX_ERROR, group=filters.GROUP,
        shards=ev.shards, weigh=cheaper is not None)
    if plain is not None and not cheaper((cands[index], direction), cands[plain]):
        index, direction = plain, None
    if index is None:  # (an exact verdict is not remembered: the classifier pauses instead)
        return None, measured, None
    memory.remember_verdict(ev.c, memory.Verdict(filter_eps, index, costs.check_every, direction,
                                                 now or fingerprint(ev, costs.check_rows)))
    return cands[index], measured, direction


PROBES = 16  # classifier rows, and directions the rows' mean is projected on
FINGERPRINT_BLOCK_D = 64  # columns of D a program of the fingerprint's parts takes
CLASSIFIER_DRIFT = 0.1  # the relative change of the classifier's probe a reused verdict allows
ROWS_DRIFT = 0.25  # of the rows' mean's projections
LOSS_DRIFT = 0.2  # and of the rows' mean loss (relative, at least 0.2 nats)


class Fingerprint(NamedTuple):
    """A :func:`fingerprint`: its three parts on the host, and ``values``, :func:`fingerprint_tensor`'s
    device tensor they came from (what a call that reads nothing back compares its own with)."""

    classifier: tuple
    rows: tuple
    loss: float
    values: Any = None


def fingerprint(ev: Evidence, sample: int) -> Fingerprint:
    """What a verdict is measured on, in one host copy: ``(classifier, rows, loss)``. ``classifier``:
    16 spread rows of the classifier, each projected on a fixed random direction (its content, which
    moves little from one training step to the next); ``rows``: the mean of the check's sampled rows
    (the rows with a gradient) projected on 16 fixed random directions; ``loss``: their mean loss
    (LSE minus the target logit), which tells apart another loss's targets on the same rows."""
    values = fingerprint_tensor(ev, sample)
    return _fingerprint_values(values.tolist(), values)


def _fingerprint_values(host: list, values=None) -> Fingerprint:
    """:func:`fingerprint` from the host values of :func:`fingerprint_tensor` (``values``)."""
    k = len(host) - PROBES - 1
    return Fingerprint(tuple(host[:k]), tuple(host[k:k + PROBES]), host[-1], values)


def fingerprint_tensor(ev: Evidence, sample: int):
    """:func:`fingerprint`'s numbers on the device (a 1-d fp32 tensor: the classifier's probes, the
    rows' 16 projections, the loss), for a caller that copies them with others."""
    return _fingerprint_launch(ev, sample, None)[0]


def fingerprint_held(ev: Evidence, sample: int, then: Fingerprint):
    """``(values, held)``: :func:`fingerprint_tensor`, and whether a verdict measured with ``then``
    may be reused on this call (:func:`_alike` on the device, in fp32: a 0-d bool tensor; False where
    ``then`` has no device values of this layout). Nothing is read back."""
    return _fingerprint_launch(ev, sample, then)


def _fingerprint_launch(ev: Evidence, sample: int, then: Fingerprint | None) -> tuple:
    """Two launches of ``templates/fingerprint.py.j2`` (the parts over slices of D, then the sums, the
    mean loss and the comparison with ``then``): ``(values, held or None)``."""
    c, e = ev.c, ev.e
    V, D = c.shape
    dev = c.device
    directions, probe_rows = _probes(D, V, dev)
    idx = _sample(ev.rows.shape[0], sample, dev)
    e2 = e.reshape(-1, D)
    kc, S = probe_rows.numel(), idx.numel() if ev.rows.shape[0] else 0  # (no rows: nothing sampled, nothing read)
    P = cdiv(D, FINGERPRINT_BLOCK_D)
    parts = torch.empty((P, 2 * PROBES), dtype=torch.float32, device=dev)
    load_utility("fingerprint.py.j2", "cce_fingerprint_parts_kernel")[(P,)](
        c, probe_rows, directions, e2, ev.rows, idx, ev.lse, parts, D, S, kc,
        c.stride(0), c.stride(1), e2.stride(0), e2.stride(1), directions.stride(0),
        PROBES=PROBES, BLOCK_S=32, BLOCK_D=FINGERPRINT_BLOCK_D, num_warps=4)
    values = torch.empty(kc + PROBES + 1, dtype=torch.float32, device=dev)
    comparable = then is not None and then.values is not None and then.values.shape == values.shape \
        and then.values.device == dev
    held = torch.zeros(1, dtype=torch.int8, device=dev) if then is not None else None
    load_utility("fingerprint.py.j2", "cce_fingerprint_kernel")[(1,)](
        parts, idx, ev.lse, ev.tile_map.zt, then.values if comparable else values, values,
        held if held is not None else values, P, S, kc, CLASSIFIER_DRIFT, ROWS_DRIFT, LOSS_DRIFT,
        PROBES=PROBES, BLOCK_P=32, BLOCK_S=256, HAS_THEN=comparable, num_warps=4)
    return values, None if held is None else held.view(torch.bool)[0]


@lru_cache(maxsize=16)
def _probes(D: int, V: int, device) -> tuple:
    """The fingerprint's fixed random directions (D x 16, fp32) and classifier rows, on ``device``
    (made once per shape: a call pays no host-to-device copy for them)."""
    g = torch.Generator().manual_seed(0)
    directions = torch.randn(D, PROBES, generator=g).to(device=device, dtype=torch.float32)
    rows = torch.linspace(0, V - 1, min(V, PROBES)).round().long().to(device)
    return directions, rows


@lru_cache(maxsize=16)
def _sample(n: int, sample: int, device):
    return accuracy.sample_rows(n, sample).to(device)


def _drift(a, b) -> float:
    return sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5 / max(sum(x * x for x in a) ** 0.5, 1e-30)


def _alike(then: Fingerprint, now: Fingerprint) -> bool:
    """Whether a call with fingerprint ``now`` may reuse a verdict measured with ``then``."""
    (c0, r0, l0), (c1, r1, l1) = then[:3], now[:3]
    return (_drift(c0, c1) <= CLASSIFIER_DRIFT and _drift(r0, r1) <= ROWS_DRIFT
            and abs(l0 - l1) <= LOSS_DRIFT * max(abs(l0), abs(l1), 1.0))


class Decision(NamedTuple):
    """What :func:`decide` found."""

    plan: BackwardPlan
    live: Any  # the live grid (device), None unless the plan launches from the map
    blocks: Any  # the chosen strategy's live blocks (host), or None
    pause: bool
    checked: str
    columns: Any  # the live tiles of each tile column (host ints), or None
    extra: Any = None  # the host values of ``extra``, or None
    lossy: bool = False  # even the smallest filter dropped too much: the exact plan, whatever ``why`` says
    measured: Any = None  # what the copy brought at the asked filter (a Measurement), or None

    def explained(self, why: str | None) -> "Decision":
        """This decision with ``why`` (how the check chose the filter) before its plan's reason, as
        :func:`decide` reports it: not before an exact plan put in the filtering plan's place (a pause,
        too much dropped), and not as ``checked`` where too much was dropped."""
        if not why or self.lossy:
            return self
        plan = self.plan if self.pause else replace(self.plan, reason=why + "; " + self.plan.reason)
        return self._replace(plan=plan, checked=why)


def decide(p: CallProblem, variant, filter_eps, tile_map, lse, *, budget: int | None, costs,
           fused_allowed: bool = False, deterministic: bool = False, why: str | None = None,
           correction: bool = False, extra=None, e=None) -> Decision:
    """``(plan, live, blocks, pause, checked, columns, extra)`` of a call's backward, measured.

    With the forward's ``tile_map`` (and filtering), the live grid is built on the device, each
    strategy's live blocks are derived from it, and all reach the host in one copy, with the count of
    live tiles in each tile column (``columns``: what a strategy launching from the grid sizes its
    launches by, so that it needs no copy of its own); the dropped-mass
    guard lowers the filter down :data:`~cce_autotune.planning.filters.GUARD_RUNGS` while the map's
    bound says it drops more than the cost model's ``max_dropped`` of the gradient's mass (past the
    last rung the call runs exact and pauses). ``pause``: filtering cannot pay for this classifier
    now: the forward and a mapped backward cost about as much as the best plan that filters nothing
    (the fused one where ``fused_allowed``), so this call runs that exact plan too. ``why``: how the
    accuracy check chose ``filter_eps``, put before the plan's reason; ``correction``: a filtering
    plan must take the dead-tile correction. ``checked``: the text the plan is reported with.
    ``extra``: a 1-d device tensor the caller wants on the host too; it rides on the same copy (or,
    without a map, a copy of its own), and its values come back as ``extra``. ``measured``: what the
    copy brought at ``filter_eps`` itself where the guard let it run (a :class:`Measurement` of rows
    ``e``, for the classifier's next call), else None."""
    exact = filter_eps is None
    live = extra_host = measured = None
    shares = Shares()
    eps, lossy = filter_eps, None
    if extra is not None and (tile_map is None or exact or p.n == 0):
        extra_host, extra = extra.tolist(), None
    if tile_map is not None and not exact and p.n > 0:
        for eps in filters.ladder(filter_eps, filters.GUARD_RUNGS):
            live, layout, values = _measure(p, variant, eps, tile_map, lse, budget, costs)
            host = torch.cat([values, *((extra.double(),) if extra is not None else ())]).tolist()  # one copy
            if extra is not None:
                extra_host, host = host[len(host) - extra.numel():], host[:len(host) - extra.numel()]
                extra = None  # (the first rung's copy brought it)
            if host[0] <= costs.max_dropped:
                break
        else:
            lossy = host[0]
        shares = layout.read(host)
        if eps == filter_eps and lossy is None and e is not None:
            measured = Measurement(_measure_key(p, variant, eps, budget, costs, e), layout, host)
    if lossy is not None:  # even the smallest filter drops too much of this call's gradient: exact
        plan = plan_backward(replace(p, sorted_vocab=False), variant, has_map=False, budget=budget, costs=costs,
                             exact=True, deterministic=deterministic)
        plan = replace(plan, reason=f"filtering would drop {lossy:.1e} of the gradient's mass even at filter_eps "
                                    f"{eps:.2g} (at most {costs.max_dropped:g}): exact; " + plan.reason)
        return Decision(plan, None, None, True, "", None, extra_host, lossy=True)
    out = _settle(p, variant, filter_eps, eps, tile_map is not None, shares, budget=budget, costs=costs,
                  fused_allowed=fused_allowed, deterministic=deterministic, correction=correction)
    out = out._replace(extra=extra_host, measured=measured)
    if out.plan.use_map:
        out = out._replace(live=live)
    return out.explained(why)


class Shares(NamedTuple):
    """What a backward's measurements say, on the host: the live tiles of each tile column
    (``columns``), their share of the grid (``live``), and for each strategy that skips blocks its
    list of live blocks (``lists``) and their share (``blocks``); empty without a map."""

    columns: Any = None
    live: float | None = None
    lists: dict = {}
    blocks: dict = {}


@dataclass(frozen=True)
class _Layout:
    """Where each measurement lies in a backward's one copy (see :func:`_measure`): the dropped
    share, the live tiles of each of ``tiles`` tile columns (of a grid of ``rows`` row blocks), then
    each strategy's live blocks (``grids``: (name, how many))."""

    tiles: int
    rows: int
    grids: tuple

    def read(self, host: list) -> Shares:
        # (map, not a comprehension: the host's time after the copy is time the device waits)
        columns = list(map(int, host[1:1 + self.tiles]))
        lists, shares = {}, {}
        at = 1 + self.tiles
        for name, k in self.grids:
            flags = list(map(bool, host[at:at + k]))
            at += k
            lists[name] = flags
            shares[name] = sum(flags) / max(1, k)
        return Shares(columns, sum(columns) / max(1, self.tiles * self.rows), lists, shares)


def _measure(p: CallProblem, variant, eps: float, tile_map, lse, budget, costs) -> tuple:
    """``(live, layout, values)``: the (row blocks, tiles) live grid at ``eps`` and, as one 1-d fp64
    device tensor laid out as ``layout`` says, the share of the gradient's mass the filter drops,
    the live tiles of each tile column and each strategy's live blocks (nothing read back here)."""
    ctx = PlanContext(problem=p, variant=variant, costs=costs, budget=budget, use_map=True, live=1.0,
                      live_blocks=1.0, n_live=0, fixed=0.0, exact=False)
    live, dropped = measure(tile_map, lse, eps, p.V, variant.block_b, variant.block_v)  # (one pass over the map)
    grids = [(s.name, g) for s in strategies.all_strategies() if (g := s.blocks(live, ctx)) is not None]
    values = torch.cat([dropped.view(1).double(), live.sum(0).double(), *(g.double() for _, g in grids)])
    layout = _Layout(live.shape[1], live.shape[0], tuple((name, g.numel()) for name, g in grids))
    return live, layout, values


def _measure_key(p: CallProblem, variant, eps: float, budget, costs, e) -> tuple:
    """What a backward's measurements depend on: another call with the same key measures the same
    grids (the live shares can differ). ``e``'s address tells the losses on one classifier apart (an
    auxiliary head's rows, another loss's): a training loop's allocator usually gives a loss's rows
    the same storage at every step; where it does not, the call reads its measurements back."""
    return (p, variant, eps, budget, costs, e.data_ptr())


class Measurement:
    """A mapped backward's measurements (:func:`_measure`) at its filter, kept for the classifier's
    next call (:func:`cce_autotune.memory.remember_measured`): ``key`` (:func:`_measure_key`),
    ``layout``; the values as the host has them, or, for a backward that read nothing back, a copy on
    its way to pinned host memory and the event that says it landed. Its last value says whether the
    call's dropped-mass guard and verdict held (a backward that read its measurements back ran only
    if they did)."""

    def __init__(self, key: tuple, layout: _Layout, host: list | None = None, values=None, verdict=None):
        self.key, self.layout, self.verdict = key, layout, verdict
        self._host = None if host is None else [*host, 1.0]
        self._copy = self._event = None
        if values is not None and values.is_cuda:
            self._copy = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._copy.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        elif values is not None:
            self._copy = values

    def values(self) -> list:
        """The values on the host (waiting for a copy still on its way: it was enqueued by an earlier
        call, so the device is past it unless the host runs more than a call ahead)."""
        if self._host is None:
            if self._event is not None:
                self._event.synchronize()
            self._host = self._copy.tolist()
            self._copy = self._event = None
        return self._host

    def held(self) -> bool:
        """Whether the measured call's guard and verdict held (its live shares can plan another call)."""
        return self.values()[-1] > 0.5


def _settle(p: CallProblem, variant, filter_eps, eps, has_map: bool, shares: Shares, *, budget, costs,
            fused_allowed: bool, deterministic: bool, correction: bool, listed: bool = True) -> Decision:
    """:func:`decide`'s plan from the measured ``shares`` at filter ``eps`` (lowered from ``filter_eps``
    by the guard, or equal): the strategy, its sizes, the pause; the live grid is the caller's.
    ``listed``: the host has the live blocks (see :func:`plan_backward`)."""
    exact = filter_eps is None
    # A backward that filters nothing walks the natural order (no sorted chunks of C to gather): it is
    # planned, and its memory counted, as such.
    natural = replace(p, sorted_vocab=False)
    plan = plan_backward(natural if exact else p, variant, has_map=has_map, live=shares.live,
                         live_blocks=shares.blocks, budget=budget, costs=costs, exact=exact, deterministic=deterministic,
                         correction=correction, listed=listed)
    if eps != filter_eps:
        plan = replace(plan, filter_eps=eps, reason=f"filter_eps lowered to {eps:.2g} (at {filter_eps:.2g} the filter "
                                                    f"would drop more than {costs.max_dropped:g} of the gradient's "
                                                    "mass); " + plan.reason)
    if eps != filter_eps and correction:  # (the correction applies only at the checked filter)
        plan = replace(plan, reason="no dead-tile correction at the lowered filter; " + plan.reason)
    pause = False
    if plan.use_map and variant.strategy == "auto":
        pause = costs.forward + plan.cost >= costs.pause_share * unfiltered_cost(p, variant, budget, costs, fused_allowed)
        if pause:  # this call too: the map showed that filtering would save nothing, and cost accuracy
            plan = plan_backward(natural, variant, has_map=False, budget=budget, costs=costs, exact=True,
                                 deterministic=deterministic)
            plan = replace(plan, reason=f"filtering cannot pay (live tiles {shares.live:.1%}): exact; " + plan.reason)
    if not plan.use_map:
        return Decision(plan, None, None, pause, "", None)
    return Decision(plan, None, shares.lists.get(plan.strategy), pause, "", shares.columns)


def decide_unread(p: CallProblem, variant, eps: float, ev: Evidence, verdict, *, budget: int | None, costs,
                  fused_allowed: bool = False, deterministic: bool = False, why: str | None = None,
                  correction: bool = False) -> Decision | None:
    """:func:`decide` with nothing read back, for a call that reuses ``verdict`` (its filter ``eps``),
    or None where it cannot be: the backward is planned on the classifier's previous call's
    measurements (of the same shape, variant, filter and rows' storage, under the same verdict, whose
    guard and fingerprint held), where that plan runs from the device's live grid alone (:meth:`Strategy.unlisted
    <cce_autotune.strategies.base.Strategy.unlisted>`; or is the pause's exact plan), and costs less than
    reading the measurements back would: without the host's list every block is launched, with it
    the device waits ``readback_ms`` for the host (the cost model's; each plan priced on the same
    shares). This call's own
    measurements go to the host without a wait (``measured``: for the next call); where its dropped-mass guard or
    its fingerprint fails, every tile of its live grid is made live on the device (the gradients are
    then exact) and the next call measures and checks afresh."""
    c = ev.c
    if ev.shards is not None or ev.tile_map is None or p.n == 0:
        return None
    key = _measure_key(p, variant, eps, budget, costs, ev.e)
    prev = memory.measured(c)
    if prev is None or prev.key != key or prev.verdict is not verdict or not prev.held():
        return None
    shares = prev.layout.read(prev.values())
    settle = dict(budget=budget, costs=costs, fused_allowed=fused_allowed, deterministic=deterministic,
                  correction=correction)
    out = _settle(p, variant, eps, eps, True, shares, listed=False, **settle)
    if out.plan.use_map and not strategies.get(out.plan.strategy).unlisted(out.plan):
        return None
    read = _settle(p, variant, eps, eps, True, shares, listed=True, **settle)
    if read.plan.cost + costs.readback_ms / mm_ms(p, costs) < out.plan.cost:
        return None
    reason = "planned on the previous call's live shares (nothing read back); "
    out = out._replace(plan=replace(out.plan, reason=reason + out.plan.reason), blocks=None, columns=None)
    if out.plan.use_map:
        live, layout, values = _measure(p, variant, eps, ev.tile_map, ev.lse, budget, costs)
        _, alike = fingerprint_held(ev, costs.check_rows, verdict.fingerprint)
        held = (values[0] <= costs.max_dropped) & alike
        live.logical_or_(~held)  # (the guard or the fingerprint failed: every tile live, exact gradients)
        out = out._replace(live=live, measured=Measurement(key, layout, values=torch.cat([values, held.double().view(1)]),
                                                           verdict=verdict))
    return out.explained(why)


# -- the choice of a strategy --------------------------------------------------------------------
def plan_backward(p: CallProblem, variant, *, has_map: bool, live: float | None = None, live_blocks=None,
                  budget: int | None = None, costs, exact: bool = False, deterministic: bool = False,
                  correction: bool = False, listed: bool = True) -> BackwardPlan:
    """The strategy and sizes for one backward, given the live shares.

    ``variant``: the call's :class:`~cce_autotune.variant.BackwardVariant` (block sizes, chunk_v, and
    its ``strategy``: "auto" lets the planner choose; another value is honoured when it fits the
    budget). ``has_map``: the forward recorded a tile map; ``live``: the live-tile share it
    measured; ``live_blocks``: the share of each strategy's blocks that hold a live tile (a mapping
    by strategy name, or one share for all; None: all live). ``deterministic``: only strategies whose
    sums use no float atomics (the same bits every run). ``correction``: only strategies that take
    the dead-tile correction (a filter that needs it runs there). ``listed``: the host will have the
    live blocks (the call's measurements read back); False: it launches every block
    (:attr:`~cce_autotune.strategies.base.PlanContext.listed`)."""
    blocks = tuple(sorted(live_blocks.items())) if isinstance(live_blocks, dict) else live_blocks
    return _plan_backward(p, variant, has_map, live, blocks, budget, costs, exact, deterministic, correction,
                          listed, strategies.generation())


@lru_cache(maxsize=1024)  # pure: a steady loop asks for the same plans at every call (host time is a cost)
def _plan_backward(p: CallProblem, variant, has_map: bool, live, blocks, budget, costs, exact: bool,
                   deterministic: bool, correction: bool, listed: bool, generation: int) -> BackwardPlan:
    """:func:`plan_backward`, kept per arguments (``blocks``: ``live_blocks`` as a tuple of items where
    it is a mapping) and per :func:`cce_autotune.strategies.generation`."""
    live_blocks = dict(blocks) if isinstance(blocks, tuple) else blocks
    bb, bv = variant.block_b, variant.block_v
    n_tiles = -(-p.n // bb) * -(-p.V // bv)
    use_map = has_map and live is not None and not exact
    L = live if use_map else 1.0
    n_live = int(round(L * n_tiles))
    fixed = costs.map_ms / mm_ms(p, costs) if use_map else 0.0
    options = {}
    for s in strategies.all_strategies():
        if s.in_forward:
            continue
        share = live_blocks.get(s.name) if isinstance(live_blocks, dict) else live_blocks
        ctx = PlanContext(problem=p, variant=variant, costs=costs, budget=budget, use_map=use_map, live=L,
                          live_blocks=float(share) if use_map and share is not None else 1.0, n_live=n_live,
                          fixed=fixed, exact=exact, listed=listed)
        opt = s.option(ctx)
        if opt is not None:
            options[s.name] = opt
    if deterministic:
        options = {k: o for k, o in options.items() if strategies.get(k).deterministic}
    if correction:
        options = {k: o for k, o in options.items() if strategies.get(k).takes_correction}
    fits = {k: o for k, o in options.items() if budget is None or o.extra_bytes <= budget}
    requested = variant.strategy
    if requested != "auto" and requested in fits:
        choice, why = requested, "the variant asks for it"
    elif fits:
        choice = min(fits, key=lambda k: fits[k].cost)
        why = "fastest estimate" + (" within the memory budget" if len(fits) < len(options) else "")
        if deterministic:
            why = "deterministic: the strategy without float atomics"
        elif correction:
            why = "the strategy of the dead-tile correction"
        if requested != "auto":
            why += f" ({requested} " + ("cannot run for this call" if requested not in options else "exceeds the budget") + ")"
    else:
        choice = min(options, key=lambda k: options[k].extra_bytes)
        why = "nothing fits the memory budget: the smallest"
    alternatives = []
    for k, o in sorted(options.items(), key=lambda kv: kv[1].cost):
        if k != choice:
            alternatives.append((k, o.cost, o.extra_bytes, "" if k in fits else "exceeds the budget"))
    opt = options[choice]
    sizes = opt.sizes
    return BackwardPlan(
        strategy=choice, use_map=opt.use_map, chunk_v=sizes.get("chunk_v", 0), row_group=sizes.get("row_group", 0),
        de_fp32=sizes.get("de_fp32", True), live=live if use_map else None,
        tile_products=sizes.get("tile_products", False),
        live_chunks=sizes.get("live_chunks"), cost=opt.cost, extra_bytes=opt.extra_bytes, budget=budget, reason=why,
        alternatives=tuple(alternatives),
    )


def exact_cost(p: CallProblem, variant, budget: int | None, costs) -> float:
    """Estimated cost of the best backward that computes every tile (no map, natural order)."""
    return _exact_cost(p, variant, budget, costs, strategies.generation())


@lru_cache(maxsize=256)  # pure; asked for on every mapped call's backward
def _exact_cost(p: CallProblem, variant, budget: int | None, costs, generation: int) -> float:
    natural = replace(p, sorted_vocab=False, map_bytes=0)
    return plan_backward(natural, variant.replace(strategy="auto"), has_map=False, budget=budget, costs=costs,
                         exact=True).cost


def unfiltered_cost(p: CallProblem, variant, budget: int | None, costs, fused_allowed: bool) -> float:
    """Estimated forward + backward of the best plan that filters nothing: the forward and the
    exact backward, or a strategy that computes the gradients in the forward where it may run."""
    return _unfiltered_cost(p, variant, budget, costs, fused_allowed, strategies.generation())


@lru_cache(maxsize=256)  # (pure, as exact_cost)
def _unfiltered_cost(p: CallProblem, variant, budget: int | None, costs, fused_allowed: bool, generation: int) -> float:
    best = costs.forward + exact_cost(p, variant, budget, costs)
    if fused_allowed:
        for s in strategies.all_strategies():
            if s.in_forward:
                opt = s.forward_option(p, costs, budget, summed_blocks=filters.SUMMED_DC_BLOCKS)
                if opt is not None:
                    best = min(best, opt.cost)
    return best


def default_strategy() -> str:
    """What ``strategy="auto"`` renders as when no call decides it (``cce-tune render``):
    :data:`cce_autotune.strategies.AUTO_RENDERS`."""
    return strategies.AUTO_RENDERS


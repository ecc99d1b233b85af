"""Running a call's plan: the forward (the target logits and the LSE, or the fused strategy's forward
with its gradients), the loss's reduction, and the backward (the vocabulary order, the arguments of
the strategy the plan names, the label-smoothing term added outside the kernels).

Everything here follows the :class:`~cce_autotune.plans.CallPlan`; nothing is decided.
"""

from __future__ import annotations

import torch

from .. import memory, strategies
from ..plans import CallPlan
from ..strategies import forward as fwd
from ..strategies.rows import row_loss
from ..strategies.common import BackwardArgs, scale_in_place
from ..tile_map import sort_order
from . import reference
from .call import Call

__all__ = ["CallState", "forward", "forward_reference", "sort_vocabulary", "MapTargets", "map_targets", "backward",
           "backward_reference",
           "reduce_loss", "add_uniform_term"]


class CallState:
    """What one forward leaves for its backward: the call's tensors (its rows, targets and weights:
    the backward's inputs are the forward's), the plan, the tile map, the fused strategy's gradients
    (for a unit incoming gradient), the classifier's fp32 column sum (label smoothing) and its whole
    copy in e's dtype where the plan converts it whole (``classifier``: converted once a call, as the
    plan says; PyTorch's path under autocast keeps the same copy for its backward)."""

    def __init__(self, plan: CallPlan | None = None, call: Call | None = None):
        self.plan = plan
        self.call = call
        self.tile_map = None
        self.fused = None  # (dE, dC, dbias)
        self.fused_scale = None  # the scale of the fused gradients (fp16, see gradient_scale), or None
        self.csum = None
        self.classifier = None  # the forward's whole copy of an fp32 classifier, for the backward


FP16_HEADROOM = 2.0**14  # the largest gradient entry a scaled fp16 call may write (fp16's largest: 65504)


def gradient_scale(e, c, *coefs) -> torch.Tensor | None:
    """For fp16 inputs, a power of two (0-d fp32, on the device: no host sync) that the gradient's
    per-row coefficients are multiplied by before the kernels and the gradients divided by after.

    The kernels round the gradient of the logits, ``coef * (softmax - onehot)``, to e's dtype before
    the products; with "mean" over n rows ``coef`` is 1/n, and fp16 (whose smallest normal number is
    6e-5) flushes most of a row's softmax terms to zero: dE 1.6e-2 from the float64 truth at 3000 x
    32000 x 2048 where the products are otherwise exact to 2e-4 (bf16 has fp32's range: None). The
    scale lifts the largest coefficient to about 1, less where a scaled dE, dC or dbias entry could
    pass :data:`FP16_HEADROOM` (bounded by the coefficients' sums and the inputs' largest entries)."""
    if e.dtype != torch.float16 or not coefs or coefs[0].numel() == 0:
        return None
    big = torch.stack([x.abs().max() for x in coefs]).max()  # the largest coefficient
    total = sum(x.abs().sum() for x in coefs)  # bounds a dC or dbias entry over the rows (times max |e|)
    e_max, c_max = e.abs().max().float(), c.abs().max().float()
    cap = torch.minimum(1.0 / big, FP16_HEADROOM / (total * torch.clamp(e_max, min=1.0)))
    cap = torch.minimum(cap, FP16_HEADROOM / (2.0 * big * torch.clamp(c_max, min=1.0)))
    scale = torch.exp2(torch.floor(torch.log2(cap)))
    return torch.where(torch.isfinite(scale) & (scale > 0), scale, 1.0).clamp(2.0**-24, 2.0**24)


def _kernel_classifier(plan: CallPlan, e, c):
    """The classifier the kernels read: ``c``, or its whole copy in e's dtype when the plan says so
    (then every strategy runs as for a 16-bit classifier; remembered state stays keyed by ``c``)."""
    return fwd.converted_classifier(c, e.dtype) if plan.forward.convert_classifier else c


def _column_sum(c: torch.Tensor) -> torch.Tensor:
    """Σ_v C[v] in fp32 (of the classifier as stored: for an fp32 classifier with 16-bit e, the
    kernels' logits use C rounded to e's dtype, so the mean logit differs from theirs by that
    rounding, a relative 2^-9 of the smoothing term at most)."""
    return c.sum(0, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Forward


def forward(plan: CallPlan, call: Call, e, c, bias) -> tuple:
    """``(loss, lse, state)`` on the kernels' path."""
    o = call.options
    kv = plan.variants
    fp = plan.forward
    state = CallState(plan, call)
    ck = _kernel_classifier(plan, e, c)
    if fp.fused is not None:
        call.check_targets()
        coef = call.unit_coef().contiguous()
        state.fused_scale = gradient_scale(e, ck, coef)
        if state.fused_scale is not None:
            coef = coef * state.fused_scale
        lse, zt, de, dc, dbias = strategies.get(fp.fused.strategy).run_forward(
            e, ck, bias, call.layout, call.targets, coef, call.softcap, kv.backward.replace(**(fp.fused.tiles or {})),
            fp.fused, dc_dtype=c.dtype, block_v=plan.costs.fused_block_v)
        state.fused = (de, dc, dbias)
    else:
        if ck is not c:
            state.classifier = ck
        zt = fwd.indexed_dot(e, ck, bias, call.layout, call.targets, call.softcap, kv.indexed_dot)
        call.check_targets()  # (no host sync on a GPU)
        lse, state.tile_map = fwd.lse_forward(e, ck, bias, call.layout, call.softcap, kv.lse_forward, perm=fp.walk,
                                              zt=zt if fp.walk is not None else None, convert_chunk=fp.convert_chunk)
    zsum = None
    if o.label_smoothing:  # (no softcap here: see planner.choose_impl) Σ_j z_ij = e_i · Σ_j c_j + Σ_j b_j
        state.csum = _column_sum(c)
        zsum = torch.mv(call.layout.take(e).float(), state.csum) if call.n_rows else lse.new_zeros(0)
        if bias is not None:
            zsum = zsum + bias.sum(dtype=torch.float32)
    loss, lse_out = reduce_loss(call, lse, zt, zsum)
    return loss, lse_out, state


def forward_reference(call: Call, e, c, bias) -> tuple:
    """``(loss, lse, state)`` on the PyTorch path."""
    call.check_targets()
    lse, zt, zsum = reference.forward(e, c, bias, call.rows, call.targets, call.softcap,
                                      row_sums=bool(call.options.label_smoothing))
    loss, lse_out = reduce_loss(call, lse, zt, zsum)
    return loss, lse_out, CallState(call=call)


def reduce_loss(call: Call, lse, zt, zsum) -> tuple:
    """``(loss, lse_out)`` of the call from every row's LSE, target logit and (label smoothing) sum of
    logits over the whole vocabulary: the loss terms, token weights and reduction, NaN where a row's
    logits are not finite or its target is out of range; ``lse_out`` 0 at ignored rows. On the
    kernels' path in one launch (:func:`~cce_autotune.strategies.rows.row_loss`: the same terms)."""
    o = call.options
    ls = o.label_smoothing
    if call.impl == "triton":
        loss, lse_out, den = row_loss(
            lse.float().contiguous(), zt.float().contiguous(), zsum.float().contiguous() if ls else None, call.valid,
            call.out_of_range, call.weights, reduction=o.reduction, label_smoothing=ls, V=call.V, z_loss=o.z_loss,
            weighted=call.has_token_weights)
        if den is not None:
            call.keep_denominator(den)
        return (loss.view(call.pred_shape) if o.reduction == "none" else loss), lse_out
    dt = call.dtype
    lse = lse.to(dt)
    row = lse - (1.0 - ls) * zt.to(dt) if ls else lse - zt.to(dt)
    if ls:
        row = row - (ls / call.V) * zsum.to(dt)
    if o.z_loss:
        row = row + o.z_loss * lse * lse
    # torch's cross_entropy gives NaN for a row whose logits hold +inf (or are all -inf).
    row = torch.where(torch.isfinite(lse), row, float("nan"))
    row = torch.where(call.valid, row, 0.0)
    if call.has_token_weights:
        row = row * call.weights  # (ignored rows stay 0, NaN rows stay NaN where the weight is not 0)
    row = torch.where(call.out_of_range, float("nan"), row)  # (an error: see Call.check_targets)
    if o.reduction == "none":
        loss = row.view(call.pred_shape)
    elif o.reduction == "sum":
        loss = row.sum()
    else:
        loss = row.sum() / call.denominator()  # 0 / 0 = NaN when every target is ignored, as torch
    lse_out = torch.where(call.valid, lse, 0.0)
    return loss, lse_out


# ----------------------------------------------------------------------------------------------
# Backward


def scale_fused(state: CallState, grad_loss, e) -> tuple:
    """The gradients the fused forward computed for a unit incoming gradient, scaled by this one (an
    fp32 0-d factor, not rounded to the gradients' dtype first)."""
    de, dc, dbias = state.fused
    state.fused = None
    scale = grad_loss.float() if grad_loss is not None else torch.zeros((), device=e.device)
    if state.fused_scale is not None:
        scale = scale / state.fused_scale
    scale_(de, dc, dbias, factor=scale)
    return de, dc, dbias


def scale_(*tensors, factor) -> None:
    """Multiply each tensor (None: skipped) in place by ``factor``, a 0-d fp32 tensor on their device,
    in fp32 before the rounding to each one's dtype, without a host sync (one launch each)."""
    for t in tensors:
        if t is not None:
            scale_in_place(t, factor)


def sort_vocabulary(plan: CallPlan, call: Call, e, c, bias) -> None:
    """Where the forward's plan says so, sort the vocabulary by this call's average logit and remember
    the order for the classifier's next forward, which walks it. It needs nothing the backward's
    planning reads back, so it is enqueued before that: its host time passes while the device may
    still run the forward, not after the read-back, while the device waits."""
    if plan.forward.sort:
        memory.remember_order(c, sort_order(call.layout.take(e), c, bias, weights=call.valid))


class MapTargets:
    """Where the call's targets lie in the order the forward walked (its tile map's), for a backward
    launched from the map: ``pos`` (n,) int32, each row's target's position in that order; ``tile``
    (``(n,)`` int64 row blocks, ``(n,)`` int64 tiles), the (row block, tile) holding it in the live
    grid of (block_b x block_v) tiles. Nothing here depends on what the backward's planning reads back, so the backward
    enqueues it first (:func:`map_targets`): the device runs it while it finishes the forward rather
    than after the read-back, while it would wait for the host."""

    def __init__(self, call: Call, tile_map, block_b: int, block_v: int):
        self.perm = tile_map.perm
        self.pos = _positions(self.perm, call.targets)
        self.block_b, self.block_v = block_b, block_v
        self.tile = (torch.arange(self.pos.shape[0], device=self.pos.device) // block_b, self.pos.long() // block_v)


def map_targets(plan: CallPlan | None, call: Call, tile_map) -> MapTargets | None:
    """The call's :class:`MapTargets` where the forward recorded a tile map, else None."""
    if plan is None or tile_map is None or call.n_rows == 0:
        return None
    bw = plan.variants.backward
    return MapTargets(call, tile_map, bw.block_b, bw.block_v)


def _positions(perm, targets):
    """Each target's position in the order ``perm`` (position p is vocabulary entry perm[p])."""
    inv = torch.empty_like(perm)
    inv[perm.long()] = torch.arange(perm.shape[0], dtype=perm.dtype, device=perm.device)
    return inv[targets]


def backward(plan: CallPlan, call: Call, e, c, bias, lse, coef_s, coef_t, coef_u, tile_map, csum=None,
             at_map: MapTargets | None = None, classifier=None) -> tuple:
    """``(dE, dC, dbias)`` on the kernels' path, as ``plan`` (complete: its backward planned) says;
    ``lse`` is infinite where a row has no gradient;
    ``at_map``: :func:`map_targets`'s, where the call has a tile map (else computed here);
    ``classifier``: the forward's whole copy of c in e's dtype, where the plan converts it whole
    (else converted here)."""
    bw = plan.backward
    if classifier is not None and (not plan.forward.convert_classifier or classifier.shape != c.shape
                                   or classifier.dtype != e.dtype):
        raise ValueError("classifier: the whole copy is given only for a plan that converts c whole, "
                         "shaped like c in e's dtype")
    ck = classifier if classifier is not None else _kernel_classifier(plan, e, c)
    scale = gradient_scale(e, ck, *(x for x in (coef_s, coef_t, coef_u) if x is not None))
    if scale is not None:
        coef_s, coef_t = coef_s * scale, coef_t * scale
        coef_u = coef_u * scale if coef_u is not None else None
    perm = tile_map.perm if bw.use_map and tile_map is not None else None  # (the order the forward walked)
    if perm is not None and at_map is not None and perm is at_map.perm:
        target_pos = at_map.pos
    elif perm is not None:
        target_pos = _positions(perm, call.targets)
    else:
        target_pos = call.targets
    strategy = strategies.get(bw.strategy)
    if plan.correction is not None and not (bw.use_map and strategy.takes_correction and not plan.deterministic):
        raise ValueError("plan: the dead-tile correction needs a mapped plan of a strategy that takes it "
                         "(not deterministic)")
    if bw.use_map and (tile_map is None or plan.live is None or plan.run_eps is None):
        raise ValueError("plan: a mapped backward needs the tile map, its live grid, filtering and the order the "
                         "forward walked")
    variant = plan.variants.backward.replace(strategy=bw.strategy, filter_eps=plan.run_eps, sort_vocab=perm is not None,
                                             **(bw.tiles or {}))
    coef_out = None
    rows = call.layout
    if bw.use_map and rows.n > 0:
        # The onehot term of a row is added inside a launched tile; rows whose target tile is not
        # launched get theirs from outside (coefficient coef_out).
        if at_map is None or (at_map.block_b, at_map.block_v) != (variant.block_b, variant.block_v):
            at_map = MapTargets(call, tile_map, variant.block_b, variant.block_v)
        coef_out = torch.where(plan.live[at_map.tile], 0.0, coef_t)
    args = BackwardArgs(
        e=e, c=ck, bias=bias, rows=rows, target_pos=target_pos, targets=call.targets, lse=lse, coef_s=coef_s,
        coef_t=coef_t, coef_out=coef_out, perm=perm, softcap=call.softcap, filter_eps=plan.run_eps, variant=variant,
        tile_map=tile_map if bw.use_map else None, live=plan.live, blocks=plan.blocks, columns=plan.columns,
        dc_dtype=c.dtype,
        deterministic=plan.deterministic, correction=plan.correction, costs=plan.costs,
    )
    de, dc, dbias = strategy.run(args, bw)
    if coef_u is not None:
        de, dc, dbias = add_uniform_term(e, call, coef_u, csum if csum is not None else _column_sum(c), de, dc, dbias)
    if scale is not None:
        scale_(de, dc, dbias, factor=1.0 / scale)
    return de, dc, dbias


def backward_reference(call: Call, e, c, bias, lse, coef_s, coef_t, coef_u) -> tuple:
    """``(dE, dC, dbias)`` on the PyTorch path."""
    return reference.backward(e, c, bias, call.rows, call.targets, lse, coef_s, coef_t, call.softcap, coef_u=coef_u)


def add_uniform_term(e, call: Call, coef_u, csum, de, dc, dbias):
    """The label-smoothing term -coef_u[i] of every logit of row i: dE[row i] -= coef_u[i] Σ_v C[v],
    every dC row -= Σ_i coef_u[i] e_i, every dbias entry -= Σ_i coef_u[i] (products in the call's
    dtype: fp32, float64 for float64 e)."""
    D = e.shape[-1]
    dt = call.dtype
    de2 = de.view(-1, D)
    r = call.rows
    de2[r] = (de2[r].to(dt) - coef_u[:, None] * csum[None, :]).to(de.dtype)
    u = coef_u @ call.layout.take(e).to(dt)
    dc = (dc.to(dt) - u[None, :]).to(dc.dtype) if dc.dtype != dt else dc.sub_(u[None, :])
    if dbias is not None:
        dbias = (dbias.to(dt) - coef_u.sum()).to(dbias.dtype)
    return de, dc, dbias

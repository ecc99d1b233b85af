"""The loss as two PyTorch custom operators, so that ``torch.compile(fullgraph=True)`` sees one
opaque node each way: ``cce_autotune::lce_forward`` and ``cce_autotune::lce_backward``.

- Both take tensors and one string, the call's options (:class:`Options`, JSON): every decision that
  reads tensor values (target checks, the dispatcher, the planner, the remembered vocabulary orders)
  happens inside the operators, where the tensors are real, so compiled graphs hold no guard on it.
- Fake implementations give the output shapes, for compile tracing and for meta tensors.
- The forward returns a third output, a 0-d int64 "handle" tensor. What the backward needs from its
  forward beyond tensors (the tile map, whether the vocabulary is sorted, the fused strategy's
  gradients) rides on it as a Python attribute, so it lives exactly as long as autograd keeps the
  handle for the backward. A backward that finds no state (a second backward with
  ``retain_graph=True``) recomputes what it needs: the state is a speed-up, never needed for
  correctness.

The per-row loss: ``l_i = lse_i - (1 - ls) * z_i,t - ls * mean_j z_ij + zl * lse_i**2`` (``ls``:
label smoothing, ``zl``: the z-loss coefficient), weighted by the token weight ``w_i``; "mean" divides
the weighted sum by the sum of the non-ignored positions' weights. Its gradient with respect to row
i's logits is ``softmax * coef_s - onehot * coef_t - coef_u`` (times the softcap derivative): the
kernels take ``coef_s`` and ``coef_t``; the uniform ``coef_u`` term adds rank-one products outside.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Optional

import torch

from . import accuracy, kernels, planner, reference, vocab_order
from .codegen import interpreting
from .variant import KernelVariants, VariantError

__all__ = ["Options", "lce_forward", "lce_backward"]


@dataclass(frozen=True)
class Options:
    """The non-tensor arguments of one call, checked by :func:`cce_autotune.loss.linear_cross_entropy`."""

    ignore_index: int = -100
    softcap: Optional[float] = None
    reduction: str = "mean"
    shift: int = 0
    return_lse: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    filter_eps: Any = "auto"  # "auto" | None | float
    impl: str = "auto"
    variants: Optional[dict] = None  # KernelVariants.to_dict(), or None for the dispatcher's
    max_extra_memory: Any = "auto"  # planner.parse_bytes value: "auto" | None | int
    deterministic: bool = False  # the same gradient bits every run (no float atomics)

    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    @lru_cache(maxsize=256)
    def decode(text: str) -> "Options":
        return Options(**json.loads(text))


@dataclass
class _Problem:
    """Everything about one call that is not a differentiable tensor.

    Every predicting position takes part (ignored ones are masked, not compacted out), so that no
    shape depends on the targets' values and the forward needs no device-to-host copy before its
    main kernel."""

    impl: str  # "triton" | "torch"
    variants: KernelVariants
    filter_eps: float | None
    options: Options
    pred_shape: torch.Size  # shape of the predicted targets (targets[..., shift:])
    valid: torch.Tensor  # (n,) bool: the position's target is not ignore_index
    weights: torch.Tensor  # (n,) fp32: the token weight of each position, 0 where ignored
    rows: torch.Tensor  # row index of each predicting position in e.reshape(-1, D)
    layout: kernels.RowLayout | None  # how the kernels address those rows (Triton path)
    targets: torch.Tensor  # (n,) int64 target of each position; 0 where ignored or out of range
    raw_targets: torch.Tensor  # (n,) the targets as given (for the range check)
    V: int

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]

    @property
    def softcap(self) -> float | None:
        return self.options.softcap

    @property
    def reduction(self) -> str:
        return self.options.reduction

    def check_targets(self) -> None:
        """Raise on a target outside [0, V) that is not ignore_index (one device-to-host copy; the
        kernels only ever see in-range targets)."""
        t = self.raw_targets
        bad = self.valid & ((t < 0) | (t >= self.V))
        if self.n_rows and bool(bad.any()):
            value = t[bad][0].item()
            raise ValueError(f"targets: value {value} is outside [0, {self.V}) and is not "
                             f"ignore_index={self.options.ignore_index}")

    def denominator(self) -> torch.Tensor:
        """What "mean" divides by: the summed weights of the non-ignored positions (their count
        without token weights). 0 when every position is ignored: the loss is then NaN, as torch's."""
        return self.weights.sum()

    def unit_coef(self) -> torch.Tensor:
        """Per-row gradient coefficient of the reduced loss for a unit incoming gradient."""
        return self.weights / self.denominator().clamp(min=torch.finfo(torch.float32).tiny) \
            if self.reduction == "mean" else self.weights


def _grid_offsets(shape, strides, device) -> torch.Tensor:
    """Σ_j index_j * strides[j] over the index grid of ``shape``, flattened (int64)."""
    off = torch.zeros((), dtype=torch.int64, device=device)
    for j, (n, s) in enumerate(zip(shape, strides)):
        view = [1] * len(shape)
        view[j] = n
        off = off + (torch.arange(n, dtype=torch.int64, device=device) * s).view(view)
    return off.expand(tuple(shape)).reshape(-1)


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def pred_shape(batch, shift: int) -> torch.Size:
    return torch.Size(tuple(batch[:-1]) + (batch[-1] - shift,))


def resolve_impl(impl: str, device: torch.device, o: Options | None = None) -> str:
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    elif impl == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"impl: 'triton' needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run the "
            "kernels on the CPU through Triton's interpreter, or use impl='torch'"
        )
    if o is not None and o.label_smoothing and o.softcap is not None:
        # The smoothing term's gradient through the softcap is not uniform across the vocabulary:
        # the kernels' outside rank-one term cannot carry it. The chunked PyTorch path does.
        impl = "torch"
    return impl


def _resolve_variants(variants: dict | None, e, c, bias, softcap) -> KernelVariants:
    if variants is None:
        from .dispatch import select_variants

        return select_variants(e, c, has_bias=bias is not None, has_softcap=softcap is not None)
    try:
        kv = KernelVariants.from_dict(variants)
        kv.validate(elem_bytes=e.element_size(), smem_limit=None)
    except (VariantError, TypeError) as exc:
        raise ValueError(f"variants: {str(exc).removeprefix('variants: ')}") from exc
    return kv


def prepare(e, c, targets, bias, token_weights, o: Options) -> _Problem:
    impl = resolve_impl(o.impl, e.device, o)
    # Explicit variants are always checked; the dispatcher is consulted only for the Triton path.
    kv = (_resolve_variants(o.variants, e, c, bias, o.softcap) if impl == "triton" or o.variants is not None
          else KernelVariants())
    eps = kv.backward.filter_eps if o.filter_eps == "auto" else o.filter_eps
    if o.variants is None and kv.backward.strategy != "auto":
        # A tuned entry's strategy was measured on the tuner's data; which strategy runs is the
        # planner's choice for each call, from the live share it measures and the memory budget.
        kv = kv.replace(backward=kv.backward.replace(strategy="auto"))
    if o.deterministic and impl == "triton":
        # LSE splits merged through a buffer (not under locks in arrival order); the backward's
        # strategy is the planner's deterministic one (chunked) or the forward's fused one.
        kv = kv.replace(lse_forward=kv.lse_forward.replace(merge="buffer"))
        if kv.backward.strategy not in ("auto", "chunked", "fused"):
            kv = kv.replace(backward=kv.backward.replace(strategy="auto"))
    dev = e.device
    V = c.shape[0]
    batch = tuple(e.shape[:-1])
    T = batch[-1]
    shape = pred_shape(batch, o.shift)
    raw = targets.narrow(-1, o.shift, T - o.shift).reshape(-1)
    valid = raw.long() != o.ignore_index
    tgt = torch.where(valid & (raw >= 0) & (raw < V), raw, 0).to(torch.int64)
    weights = valid.float()
    if token_weights is not None:
        weights = weights * token_weights.narrow(-1, o.shift, T - o.shift).reshape(-1).float()
    # Row of each prediction in e.reshape(-1, D).
    rows = _grid_offsets(shape, _contiguous_strides(batch), dev)
    layout = _row_layout(e, shape, rows) if impl == "triton" else None
    return _Problem(impl=impl, variants=kv, filter_eps=eps, options=o, pred_shape=shape, valid=valid,
                    weights=weights, rows=rows, layout=layout, targets=tgt, raw_targets=raw, V=V)


def _row_layout(e, shape, rows) -> kernels.RowLayout:
    """Element offsets of the predicting rows, in e's storage and in a contiguous dE."""
    D = e.shape[-1]
    offsets = _grid_offsets(shape, e.stride()[:-1], e.device)
    dense_stride = None
    if shape == e.shape[:-1]:
        # No shift: if the batch dims flatten to one stride, skip the table.
        try:
            dense_stride = e.view(-1, D).stride(0)
        except RuntimeError:
            pass
    aligned = D % 8 == 0 and all(s % 8 == 0 for s in e.stride()[:-1]) and e.data_ptr() % 16 == 0
    return kernels.RowLayout(offsets=offsets, de_offsets=rows * D, dense_stride=dense_stride, aligned=aligned)


class _CallState:
    """What one forward leaves for its backward (see the module docstring)."""

    def __init__(self, sort=False, tile_map=None, fused=None, csum=None):
        self.sort = sort
        self.tile_map = tile_map
        self.fused = fused  # (dE, dC, dbias) for a unit incoming gradient
        self.csum = csum  # fp32 column sum of C (label smoothing), reused by the backward


def _fused_allowed(p: _Problem, e, c) -> bool:
    """The fused strategy computes gradients for a unit incoming gradient of a "mean" or "sum" loss
    in the forward, with one coefficient per row for the softmax and the onehot: not for per-row
    incoming gradients, the returned LSE's, label smoothing, the z-loss, or a classifier the kernels
    read wider than e (its cuBLAS logits would need a whole converted copy of C)."""
    o = p.options
    return (o.reduction in ("mean", "sum") and not o.return_lse and not o.label_smoothing and not o.z_loss
            and c.dtype == e.dtype)


def _planner_problem(e, c, bias, p: _Problem, tmap=None) -> planner.Problem:
    D = e.shape[-1]
    return planner.Problem(
        n=p.n_rows, n_all=e.numel() // D, V=p.V, D=D, elem=e.element_size(),
        grad_bytes=sum(t.numel() * t.element_size() for t in (e, c, bias) if t is not None),
        e_view=_views_as_matrix(e), sorted_vocab=tmap is not None, map_bytes=tmap.nbytes if tmap is not None else 0,
    )


def _views_as_matrix(e: torch.Tensor) -> bool:
    try:
        e.view(-1, e.shape[-1])
        return True
    except RuntimeError:
        return False


def _gpu(device) -> str | None:
    """The GPU slug whose cost coefficients the planner uses (None on the CPU)."""
    if device.type != "cuda":
        return None
    from .dispatch import gpu_slug

    return gpu_slug(device)


def _column_sum(c: torch.Tensor) -> torch.Tensor:
    """Σ_v C[v] in fp32 (of the classifier as stored: for an fp32 classifier with 16-bit e, the
    kernels' logits use C rounded to e's dtype, so the mean logit differs from theirs by that
    rounding, a relative 2^-9 of the smoothing term at most)."""
    return c.sum(0, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Forward


def _kernel_classifier(e, c):
    """The classifier the kernels read: ``c``, or for an fp32 classifier with 16-bit e whose
    converted copy fits in one conversion chunk (``kernels.CONVERT_BYTES``), that copy (then every
    strategy runs as for a 16-bit classifier, the fused one included). A larger classifier is
    converted a chunk or window at a time inside the kernel launches. Remembered orders and pauses
    stay keyed by ``c`` itself."""
    if c.dtype == e.dtype:
        return c
    whole = kernels.converted_classifier(c, e.dtype) if c.is_cuda or interpreting() else None
    return c if whole is None else whole


def _forward(e, c, bias, targets, token_weights, o: Options, needs_grad: bool):
    p = prepare(e, c, targets, bias, token_weights, o)
    state = _CallState()
    zsum = None
    if p.impl == "triton":
        ck = _kernel_classifier(e, c)
        kv = p.variants
        bw = kv.backward
        sort = needs_grad and bw.sort_vocab and p.filter_eps is not None and p.n_rows > 0
        # With the tile map, the forward walks the order a previous backward left for this
        # classifier and records where the live tiles are (see tile_map.py); when that backward
        # found filtering cannot pay, the classifier is paused and the planner may compute the
        # gradients right here instead (strategy "fused").
        walk = None
        paused = False
        if sort and bw.uses_tile_map(p.filter_eps):
            paused = vocab_order.paused(c)
            if not paused:
                walk = vocab_order.lookup(c)
        fused = None
        if needs_grad and p.n_rows > 0 and (paused or bw.strategy == "fused"):
            fused = planner.plan_forward(
                _planner_problem(e, c, bias, p), bw, paused=paused, dense_rows=p.layout.dense_stride is not None,
                allowed=_fused_allowed(p, e, ck), max_extra_memory=o.max_extra_memory, gpu=_gpu(e.device))
        if fused is not None:
            p.check_targets()
            lse, zt, de, dc, dbias = kernels.fused(e, ck, bias, p.layout, p.targets, p.unit_coef().contiguous(),
                                                   p.softcap, bw, fused.row_block, dc_dtype=c.dtype)
            state.fused = (de, dc, dbias)
        else:
            if paused:
                sort = False  # the planner found filtering cannot pay for this classifier now
            state.sort = sort
            zt = kernels.indexed_dot(e, ck, bias, p.layout, p.targets, p.softcap, kv.indexed_dot)
            # The call's one device-to-host copy, just before the main kernel's launch, so that the
            # GPU does not wait for the host's preparations.
            p.check_targets()
            lse, state.tile_map = kernels.lse_forward(
                e, ck, bias, p.layout, p.softcap, kv.lse_forward, perm=walk, zt=zt if walk is not None else None,
            )
        if o.label_smoothing:  # (no softcap here: see resolve_impl) Σ_j z_ij = e_i · Σ_j c_j + Σ_j b_j
            state.csum = _column_sum(c)
            zsum = torch.mv(p.layout.take(e).float(), state.csum) if p.n_rows else lse.new_zeros(0)
            if bias is not None:
                zsum = zsum + bias.sum(dtype=torch.float32)
    else:
        p.check_targets()
        lse, zt, zsum = reference.forward(e, c, bias, p.rows, p.targets, p.softcap, row_sums=bool(o.label_smoothing))
    lse = lse.float()
    ls = o.label_smoothing
    row = lse - (1.0 - ls) * zt.float() if ls else lse - zt.float()
    if ls:
        row = row - (ls / p.V) * zsum.float()
    if o.z_loss:
        row = row + o.z_loss * lse * lse
    # torch's cross_entropy gives NaN for a row whose logits hold +inf (or are all -inf).
    row = torch.where(torch.isfinite(lse), row, float("nan"))
    row = torch.where(p.valid, row, 0.0)
    if token_weights is not None:
        row = row * p.weights  # (ignored rows stay 0, NaN rows stay NaN where the weight is not 0)
    if o.reduction == "none":
        loss = row.view(p.pred_shape)
    elif o.reduction == "sum":
        loss = row.sum()
    else:
        loss = row.sum() / p.denominator()  # 0 / 0 = NaN when every target is ignored, as torch
    lse_out = torch.where(p.valid, lse, 0.0)
    return loss, lse_out, state


# ----------------------------------------------------------------------------------------------
# Backward


def _coefficients(p: _Problem, grad_loss, grad_lse, lse):
    """(coef_s, coef_t, coef_u) of each row (fp32, (n,)); see the module docstring."""
    o = p.options
    n = p.n_rows
    if grad_loss is None:
        g = torch.zeros(n, dtype=torch.float32, device=lse.device)
    elif o.reduction == "none":
        g = grad_loss.reshape(-1).float() * p.weights
    else:
        g = grad_loss.float() * p.unit_coef()
    coef_t = g * (1.0 - o.label_smoothing) if o.label_smoothing else g
    coef_s = g * (1.0 + 2.0 * o.z_loss * lse) if o.z_loss else g
    if grad_lse is not None:
        coef_s = coef_s + grad_lse.reshape(-1).float() * p.valid
    coef_u = g * (o.label_smoothing / p.V) if o.label_smoothing else None
    return coef_s.contiguous(), coef_t.contiguous(), coef_u


def _backward(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse_out, state: _CallState | None,
              o: Options):
    if state is not None and state.fused is not None:
        # Computed in the forward for a unit gradient: scale by this one (an fp32 0-d factor, not
        # rounded to the gradients' dtype first).
        de, dc, dbias = state.fused
        state.fused = None
        scale = grad_loss.float() if grad_loss is not None else torch.zeros((), device=e.device)
        return de.mul_(scale), dc.mul_(scale), dbias.mul_(scale) if dbias is not None else None
    p = prepare(e, c, targets, bias, token_weights, o)
    n = p.n_rows
    if n == 0:
        return torch.zeros_like(e), torch.zeros_like(c), torch.zeros_like(bias) if bias is not None else None
    coef_s, coef_t, coef_u = _coefficients(p, grad_loss, grad_lse, lse_out)
    # Ignored positions: an infinite LSE makes their softmax (and so their gradient) zero.
    lse_v = torch.where(p.valid, lse_out, float("inf"))
    if p.impl == "torch":
        return reference.backward(e, c, bias, p.rows, p.targets, lse_v, coef_s, coef_t, p.softcap, coef_u=coef_u)
    bw = p.variants.backward
    tmap = state.tile_map if state is not None else None
    order = None
    if state is not None and state.sort:
        order = vocab_order.sort_order(p.layout.take(e), c, bias, weights=p.valid)
        if bw.tile_map:
            vocab_order.remember(c, order)  # the next forward of this classifier walks it
    ck = _kernel_classifier(e, c)
    prob = _planner_problem(e, c, bias, p, tmap)
    eps = p.filter_eps
    measured = direction = None
    if tmap is not None and eps is not None:
        # The filter's measured cost in accuracy (a sample of rows against the map; remembered per
        # classifier): lowered, or None (exact) when even the smallest candidate costs too much; with
        # the direction of the dead-tile correction when the filter needs it (chunked plans only).
        eps, checked, direction = accuracy.choose_filter(
            e, c, bias, p.rows, p.targets, lse_v, p.softcap, tmap, bw.block_b, bw.block_v, eps, accuracy.SCALES,
            coef_s, coef_t, correctable=bw.strategy in ("auto", "chunked") and not o.deterministic,
            admissible=lambda x: planner.admissible(tmap, lse_v, x))
        planner.report_check(prob, checked, accuracy.MAX_ERROR)
        if eps != p.filter_eps:
            measured = (f"filter_eps lowered to {eps:.2g} by the measured dE error (at most {accuracy.MAX_ERROR:g})"
                        if eps is not None else
                        f"every filter_eps down to {p.filter_eps * accuracy.SCALES[-1]:.2g} costs dE more than "
                        f"{accuracy.MAX_ERROR:g} (measured): exact")
        if direction is not None:
            measured = (measured + "; " if measured else "") + "the dead-tile correction (measured)"
    plan, live, chunks, pause = planner.decide(prob, bw, eps, tmap, lse_v, o.max_extra_memory,
                                               _gpu(e.device), fused_allowed=_fused_allowed(p, e, ck),
                                               deterministic=o.deterministic, why=measured,
                                               chunked_only=direction is not None)
    measured_exact = measured is not None and eps is None
    if measured_exact:
        pause = True  # the forward stops walking and mapping until the next check
    if pause:
        vocab_order.pause(c, accuracy.CHECK_EVERY if measured_exact else planner.PAUSE_CALLS)
        eps = None  # the planner's plan for this call filters nothing either
    elif plan.filter_eps is not None:
        eps = plan.filter_eps  # lowered by the planner's accuracy guard
    if plan.use_map:
        perm = tmap.perm  # the live grid is in the order the forward walked
    elif plan.strategy == "chunked":
        perm = None  # without a map nothing is skipped: the natural order needs no gathers
    else:
        perm = order  # the tile kernel's own filter skips more in a sorted order
    if perm is not None:
        inv = torch.empty_like(perm)
        inv[perm.long()] = torch.arange(perm.shape[0], dtype=perm.dtype, device=perm.device)
        target_pos = inv[p.targets]
    else:
        target_pos = p.targets
    de, dc, dbias = kernels.backward(
        e, ck, bias, p.layout, target_pos, lse_v, coef_s, coef_t, perm,
        p.softcap, eps, bw, plan, tile_map=tmap if plan.use_map else None,
        live=live, chunks=chunks, targets=p.targets, dc_dtype=c.dtype, deterministic=o.deterministic,
        # (not where the dropped-mass guard lowered the checked filter: the direction was fitted to what
        # the checked filter drops)
        dead_dir=direction if plan.use_map and plan.strategy == "chunked" and plan.filter_eps is None else None,
    )
    if coef_u is not None:
        csum = state.csum if state is not None and state.csum is not None else _column_sum(c)
        de, dc, dbias = _add_uniform_term(e, p, coef_u, csum, de, dc, dbias)
    return de, dc, dbias


def _add_uniform_term(e, p: _Problem, coef_u, csum, de, dc, dbias):
    """The label-smoothing term -coef_u[i] of every logit of row i: dE[row i] -= coef_u[i] Σ_v C[v],
    every dC row -= Σ_i coef_u[i] e_i, every dbias entry -= Σ_i coef_u[i] (products in fp32)."""
    D = e.shape[-1]
    de2 = de.view(-1, D)
    r = p.rows
    de2[r] = (de2[r].float() - coef_u[:, None] * csum[None, :]).to(de.dtype)
    u = coef_u @ p.layout.take(e).float()
    dc = (dc.float() - u[None, :]).to(dc.dtype) if dc.dtype != torch.float32 else dc.sub_(u[None, :])
    if dbias is not None:
        dbias = (dbias.float() - coef_u.sum()).to(dbias.dtype)
    return de, dc, dbias


# ----------------------------------------------------------------------------------------------
# The operators


class _NoAutocast:
    """Autocast off inside the operators: the kernels and the PyTorch path choose their own
    precision (the loss's inputs were already cast by the caller where autocast says so)."""

    def __init__(self, device: torch.device):
        self.ctx = torch.autocast(device_type=device.type, enabled=False) \
            if device.type in ("cuda", "cpu") else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


@torch.library.custom_op("cce_autotune::lce_forward", mutates_args=())
def lce_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                token_weights: Optional[torch.Tensor], options: str, needs_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, per-position LSE (n,) fp32 with 0 at ignored positions, handle)."""
    o = Options.decode(options)
    with _NoAutocast(e.device):
        loss, lse, state = _forward(e, c, bias, targets, token_weights, o, needs_grad)
    handle = torch.zeros((), dtype=torch.int64)
    if needs_grad:
        handle._cce_state = state
    return loss, lse, handle


@lce_forward.register_fake
def _lce_forward_fake(e, c, bias, targets, token_weights, options, needs_grad):
    o = Options.decode(options)
    shape = pred_shape(e.shape[:-1], o.shift)
    n = math.prod(shape)
    loss = e.new_empty(shape if o.reduction == "none" else (), dtype=torch.float32)
    return loss, e.new_empty((n,), dtype=torch.float32), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("cce_autotune::lce_backward", mutates_args=())
def lce_backward(grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], e: torch.Tensor,
                 c: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                 token_weights: Optional[torch.Tensor], lse: torch.Tensor, handle: torch.Tensor, options: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, dbias); dbias is an empty tensor when there is no bias."""
    o = Options.decode(options)
    state = getattr(handle, "_cce_state", None)
    if state is not None:
        del handle._cce_state  # used once; a second backward recomputes what it needs
    with _NoAutocast(e.device):
        de, dc, dbias = _backward(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse, state, o)
    if dbias is None:
        dbias = e.new_empty((0,))
    return de, dc, dbias


@lce_backward.register_fake
def _lce_backward_fake(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse, handle, options):
    dbias = torch.empty_like(bias) if bias is not None else e.new_empty((0,))
    return torch.empty_like(e), torch.empty_like(c), dbias


def _setup_context(ctx, inputs, output):
    e, c, bias, targets, token_weights, options, needs_grad = inputs
    _, lse, handle = output
    ctx.options = options
    ctx.has_bias = bias is not None
    ctx.has_weights = token_weights is not None
    ctx.save_for_backward(e, c, bias if bias is not None else lse, targets,
                          token_weights if token_weights is not None else lse, lse, handle)


def _autograd_backward(ctx, grad_loss, grad_lse, grad_handle):
    e, c, bias, targets, token_weights, lse, handle = ctx.saved_tensors
    de, dc, dbias = lce_backward(grad_loss, grad_lse, e, c, bias if ctx.has_bias else None, targets,
                                 token_weights if ctx.has_weights else None, lse, handle, ctx.options)
    return de, dc, dbias if ctx.has_bias else None, None, None, None, None


lce_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "linear_cross_entropy: second derivatives are not supported (a backward through the gradients, "
        "e.g. torch.autograd.grad(..., create_graph=True) then another backward): the saved log-sum-exp "
        "is not differentiated again; compute such terms with a materialised-logits loss")


lce_backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)

"""The public loss: argument checks, the autograd.Function, ``linear_cross_entropy`` and a Module."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from . import kernels, planner, reference, vocab_order
from .codegen import interpreting
from .variant import KernelVariants, VariantError

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")


@dataclass
class _Problem:
    """Everything about one call that is not a differentiable tensor.

    Every predicting position takes part (ignored ones are masked, not compacted out), so that no
    shape depends on the targets' values and the forward needs no device-to-host copy before its
    main kernel."""

    impl: str  # "triton" | "torch"
    variants: KernelVariants
    filter_eps: float | None
    softcap: float | None
    reduction: str
    pred_shape: torch.Size  # shape of the predicted targets (targets[..., shift:])
    valid: torch.Tensor  # (n,) bool: the position's target is not ignore_index
    rows: torch.Tensor  # row index of each predicting position in e.reshape(-1, D)
    layout: kernels.RowLayout | None  # how the kernels address those rows (Triton path)
    targets: torch.Tensor  # (n,) int64 target of each position; 0 where ignored or out of range
    raw_targets: torch.Tensor  # (n,) the targets as given (for the range check)
    V: int
    return_lse: bool
    max_extra_memory: object = "auto"  # the backward's memory budget request (planner.memory_budget)

    @property
    def n_rows(self) -> int:
        return self.rows.shape[0]

    def check_targets(self) -> None:
        """Raise on a target outside [0, V) that is not ignore_index (one device-to-host copy; the
        kernels only ever see in-range targets)."""
        t = self.raw_targets
        bad = self.valid & ((t < 0) | (t >= self.V))
        if self.n_rows and bool(bad.any()):
            value = t[bad][0].item()
            raise ValueError(f"targets: value {value} is outside [0, {self.V}) and is not ignore_index={self.ignore_index}")

    ignore_index: int = -100


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


def _check_inputs(e, c, targets, bias, ignore_index, softcap, reduction, shift, impl, filter_eps, max_extra_memory):
    for name, t in (("e", e), ("c", c), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    if e.dim() < 2:
        raise ValueError(f"e: expected shape (..., D) with at least one batch dimension, got {tuple(e.shape)}")
    if c.dim() != 2:
        raise ValueError(f"c: expected shape (V, D), got {tuple(c.shape)}")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"c: hidden size D={c.shape[1]} does not match e's D={e.shape[-1]}")
    if c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"c: empty classifier of shape {tuple(c.shape)}")
    if e.dtype not in _DTYPES and not (impl == "torch" and e.dtype == torch.float64):
        raise TypeError(f"e: dtype {e.dtype} not supported; use one of float32, bfloat16, float16")
    if c.dtype != e.dtype:
        raise TypeError(f"c: dtype {c.dtype} differs from e's dtype {e.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"targets: shape {tuple(targets.shape)} does not match e's batch shape {tuple(e.shape[:-1])}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != c.shape[0]:
            raise ValueError(f"bias: expected shape ({c.shape[0]},), got {tuple(bias.shape)}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias: expected a floating-point tensor, got {bias.dtype}")
    for name, t in (("c", c), ("targets", targets), ("bias", bias)):
        if t is not None and t.device != e.device:
            raise ValueError(f"{name}: on {t.device}, but e is on {e.device}; all tensors must share one device")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {list(_REDUCTIONS)}")
    if impl not in _IMPLS:
        raise ValueError(f"impl: {impl!r} is not one of {list(_IMPLS)}")
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"shift: expected an int, got {type(shift).__name__}")
    T = e.shape[-2]
    if not 0 <= shift < max(T, 1):
        raise ValueError(f"shift: {shift} out of range [0, {T}) for a last batch dimension of {T}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap: expected a positive finite number or None, got {softcap!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if filter_eps not in ("auto", None):
        if isinstance(filter_eps, bool) or not isinstance(filter_eps, (int, float)) or not 0 < filter_eps < 1:
            raise ValueError(f"filter_eps: expected 'auto', None (exact) or a float in (0, 1), got {filter_eps!r}")
    planner.parse_bytes(max_extra_memory)


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(
            f"impl: 'triton' needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run the "
            "kernels on the CPU through Triton's interpreter, or use impl='torch'"
        )
    return impl


def _resolve_variants(variants, e, c, bias, softcap) -> KernelVariants:
    if variants is None:
        from .dispatch import select_variants

        return select_variants(e, c, has_bias=bias is not None, has_softcap=softcap is not None)
    if isinstance(variants, Mapping):
        try:
            variants = KernelVariants.from_dict(variants)
        except (VariantError, TypeError) as exc:
            raise ValueError(f"variants: {exc}") from exc
    if not isinstance(variants, KernelVariants):
        raise TypeError(f"variants: expected KernelVariants, a dict of kernel variants or None, got {type(variants).__name__}")
    try:
        variants.validate(elem_bytes=e.element_size(), smem_limit=None)
    except VariantError as exc:
        raise ValueError(f"variants: {exc}") from exc
    return variants


def _prepare(e, c, targets, bias, ignore_index, softcap, reduction, shift, return_lse, filter_eps, impl, variants,
             max_extra_memory="auto"):
    _check_inputs(e, c, targets, bias, ignore_index, softcap, reduction, shift, impl, filter_eps, max_extra_memory)
    impl = _resolve_impl(impl, e.device)
    # Explicit variants are always checked; the dispatcher is consulted only for the Triton path.
    kv = _resolve_variants(variants, e, c, bias, softcap) if impl == "triton" or variants is not None else KernelVariants()
    eps = kv.backward.filter_eps if filter_eps == "auto" else filter_eps
    if variants is None and kv.backward.strategy != "auto":
        # A tuned entry's strategy was measured on the tuner's data; which strategy runs is the
        # planner's choice for each call, from the live share it measures and the memory budget.
        kv = kv.replace(backward=kv.backward.replace(strategy="auto"))
    dev = e.device
    D, V = e.shape[-1], c.shape[0]
    batch = tuple(e.shape[:-1])
    T = batch[-1]
    pred_shape = torch.Size(batch[:-1] + (T - shift,))
    raw = targets.narrow(-1, shift, T - shift).reshape(-1)
    valid = raw != ignore_index
    tgt = torch.where(valid & (raw >= 0) & (raw < V), raw, 0).to(torch.int64)
    # Row of each prediction in e.reshape(-1, D).
    rows = _grid_offsets(pred_shape, _contiguous_strides(batch), dev)
    layout = _row_layout(e, pred_shape, rows) if impl == "triton" else None
    return _Problem(
        impl=impl, variants=kv, filter_eps=eps, softcap=float(softcap) if softcap is not None else None,
        reduction=reduction, pred_shape=pred_shape, valid=valid, rows=rows, layout=layout,
        targets=tgt, raw_targets=raw, V=V, return_lse=return_lse, ignore_index=ignore_index,
        max_extra_memory=max_extra_memory,
    )


def _row_layout(e, pred_shape, rows) -> kernels.RowLayout:
    """Element offsets of the predicting rows, in e's storage and in a contiguous dE."""
    D = e.shape[-1]
    offsets = _grid_offsets(pred_shape, e.stride()[:-1], e.device)
    dense_stride = None
    if pred_shape == e.shape[:-1]:
        # No shift: if the batch dims flatten to one stride, skip the table.
        try:
            dense_stride = e.view(-1, D).stride(0)
        except RuntimeError:
            pass
    aligned = D % 8 == 0 and all(s % 8 == 0 for s in e.stride()[:-1]) and e.data_ptr() % 16 == 0
    return kernels.RowLayout(offsets=offsets, de_offsets=rows * D, dense_stride=dense_stride, aligned=aligned)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, p: _Problem):
        needs_grad = any(ctx.needs_input_grad[:3])
        tmap = None
        sort = False
        ctx.fused = None
        if p.impl == "triton":
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
                    allowed=_fused_allowed(p),
                    max_extra_memory=p.max_extra_memory, gpu=_gpu(e.device))
            if fused is not None:
                valid = p.valid.float()
                coef = valid / p.valid.sum().clamp(min=1) if p.reduction == "mean" else valid
                p.check_targets()
                lse, zt, de, dc, dbias = kernels.fused(e, c, bias, p.layout, p.targets, coef.contiguous(), p.softcap,
                                                       bw, fused.row_block)
                ctx.fused = (de, dc, dbias)
                sort = False
            else:
                if paused:
                    sort = False  # the planner found filtering cannot pay for this classifier now
                zt = kernels.indexed_dot(e, c, bias, p.layout, p.targets, p.softcap, kv.indexed_dot)
                # The call's one device-to-host copy, just before the main kernel's launch, so that the
                # GPU does not wait for the host's preparations.
                p.check_targets()
                lse, tmap = kernels.lse_forward(
                    e, c, bias, p.layout, p.softcap, kv.lse_forward, perm=walk, zt=zt if walk is not None else None,
                )
        else:
            p.check_targets()
            lse, zt = reference.forward(e, c, bias, p.rows, p.targets, p.softcap)
        # torch's cross_entropy gives NaN for a row whose logits hold +inf (or are all -inf).
        loss_v = torch.where(torch.isfinite(lse), lse - zt, float("nan")).float()
        loss_v = torch.where(p.valid, loss_v, 0.0)
        lse_v = lse.float()
        ctx.problem = p
        ctx.sort = sort
        ctx.tile_map = tmap
        ctx.save_for_backward(e, c, bias, lse_v)
        if p.reduction == "none":
            loss = loss_v.view(p.pred_shape)
        elif p.reduction == "sum":
            loss = loss_v.sum()
        else:
            loss = loss_v.sum() / p.valid.sum()  # 0 / 0 = NaN when every target is ignored, as torch
        lse_out = torch.where(p.valid, lse_v, 0.0).view(p.pred_shape) if p.return_lse else None
        return loss, lse_out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        p: _Problem = ctx.problem
        e, c, bias, lse_v = ctx.saved_tensors
        n = p.n_rows
        if ctx.fused is not None:  # computed in the forward for a unit gradient: scale by this one
            de, dc, dbias = ctx.fused
            ctx.fused = None
            if grad_loss is None:
                grad_loss = torch.zeros((), device=e.device)
            scale = grad_loss.float()  # (an fp32 0-d factor: not rounded to the gradients' dtype first)
            return de.mul_(scale), dc.mul_(scale), dbias.mul_(scale) if dbias is not None else None, None
        if n == 0:
            return (torch.zeros_like(e), torch.zeros_like(c), torch.zeros_like(bias) if bias is not None else None, None)
        valid = p.valid.float()
        if grad_loss is None:
            coef_t = torch.zeros(n, dtype=torch.float32, device=e.device)
        elif p.reduction == "none":
            coef_t = grad_loss.reshape(-1).float() * valid
        else:
            scale = grad_loss.float() / (p.valid.sum().clamp(min=1) if p.reduction == "mean" else 1)
            coef_t = scale * valid
        coef_s = coef_t + grad_lse.reshape(-1).float() * valid if grad_lse is not None else coef_t
        coef_s = coef_s.contiguous()
        # Ignored positions: an infinite LSE makes their softmax (and so their gradient) zero.
        lse_v = torch.where(p.valid, lse_v, float("inf"))
        if p.impl == "triton":
            bw = p.variants.backward
            tmap = ctx.tile_map
            order = None
            if ctx.sort:
                order = vocab_order.sort_order(p.layout.take(e), c, bias, weights=p.valid)
                if bw.tile_map:
                    vocab_order.remember(c, order)  # the next forward of this classifier walks it
            prob = _planner_problem(e, c, bias, p, tmap)
            plan, live, chunks, pause = planner.decide(prob, bw, p.filter_eps, tmap, lse_v, p.max_extra_memory,
                                                       _gpu(e.device), fused_allowed=_fused_allowed(p))
            eps = p.filter_eps
            if pause:
                vocab_order.pause(c, planner.PAUSE_CALLS)
                eps = None  # the planner's plan for this call filters nothing either
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
                e, c, bias, p.layout, target_pos, lse_v, coef_s, coef_t, perm,
                p.softcap, eps, bw, plan, tile_map=tmap if plan.use_map else None,
                live=live, chunks=chunks, targets=p.targets,
            )
        else:
            de, dc, dbias = reference.backward(e, c, bias, p.rows, p.targets, lse_v, coef_s, coef_t, p.softcap)
        return de, dc, dbias, None


def _fused_allowed(p: _Problem) -> bool:
    """The fused strategy computes gradients for a unit incoming gradient of a "mean" or "sum" loss
    in the forward: it cannot serve per-row incoming gradients or the returned LSE's."""
    return p.reduction in ("mean", "sum") and not p.return_lse


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


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    shift: int = 0,
    return_lse: bool = False,
    filter_eps: float | str | None = "auto",
    impl: str = "auto",
    variants: KernelVariants | Mapping[str, Any] | None = None,
    max_extra_memory: int | str | None = "auto",
):
    """Cross-entropy of ``softcap(e @ c.T + bias)`` against ``targets``, without the logit matrix.

    Same value as ``F.cross_entropy(softcap(e @ c.T + bias).float().flatten(0, -2), targets.flatten(),
    ignore_index=..., reduction=...)`` (with ``reduction="none"`` shaped like the predicted targets).

    Args:
        e: (..., D) embeddings; float32, bfloat16 or float16. Any strides.
        c: (V, D) classifier, same dtype as ``e``.
        targets: integer tensor shaped like ``e.shape[:-1]``; values in [0, V) or ``ignore_index``.
        bias: optional (V,) bias.
        ignore_index: target value whose positions contribute nothing.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)``.
        reduction: "mean" (over non-ignored positions), "sum" or "none".
        shift: position ``t`` of the last batch dimension predicts target ``t + shift`` (next-token
            loss with ``shift=1``) without copying ``e``; "none" returns ``targets[..., shift:]``'s shape.
        return_lse: also return the per-position log-sum-exp (fp32, 0 at ignored positions),
            differentiable (for a z-loss).
        filter_eps: "auto" (the kernel variant's), None (exact gradients) or a float: backward tiles
            whose softmax values are all below it are skipped. The torch path is always exact.
        impl: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". With
            ``TRITON_INTERPRET=1``, "triton" runs the kernels on CPU tensors.
        variants: explicit kernel variants (:class:`KernelVariants` or its dict form); by default the
            dispatcher picks them from the tuned-config database.
        max_extra_memory: device memory the backward may use beyond the gradients themselves:
            "auto" (``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY`` if set, else ``0.05 * (|dE| + |dC|) + 32 MiB``
            plus an fp32 copy of dE),
            None (unlimited), a byte count or a size string ("2GiB"). The planner runs the fastest
            strategy that fits (:mod:`cce_autotune.planner`).

    Returns:
        The loss (fp32), or ``(loss, lse)`` when ``return_lse``.
    """
    p = _prepare(e, c, targets, bias, ignore_index, softcap, reduction, shift, return_lse, filter_eps, impl, variants,
                 max_extra_memory)
    loss, lse = _LinearCrossEntropy.apply(e, c, bias, p)
    return (loss, lse) if return_lse else loss


class LinearCrossEntropy(torch.nn.Module):
    """Module wrapper holding the options of :func:`linear_cross_entropy`.

    ``forward(e, c, targets, bias=None)``: the classifier is passed in, so that it can stay tied to
    an embedding or live in another module.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        softcap: float | None = None,
        reduction: str = "mean",
        shift: int = 0,
        return_lse: bool = False,
        filter_eps: float | str | None = "auto",
        impl: str = "auto",
        variants: KernelVariants | Mapping[str, Any] | None = None,
        max_extra_memory: int | str | None = "auto",
    ):
        super().__init__()
        self.options = dict(
            ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=shift,
            return_lse=return_lse, filter_eps=filter_eps, impl=impl, variants=variants,
            max_extra_memory=max_extra_memory,
        )

    def forward(self, e, c, targets, bias=None):
        return linear_cross_entropy(e, c, targets, bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "variants")

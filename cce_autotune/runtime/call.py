"""One call's tensors, as the kernels and the PyTorch path see them: which rows of E take part, their
targets and token weights, how the kernels address them, and the gradient's per-row coefficients.

Every predicting position takes part (ignored ones are masked, not compacted out), so that no shape
depends on the targets' values and the forward needs no device-to-host copy before its main kernel.

The per-row loss: ``l_i = lse_i - (1 - ls) * z_i,t - ls * mean_j z_ij + zl * lse_i**2`` (``ls``:
label smoothing, ``zl``: the z-loss coefficient), weighted by the token weight ``w_i``; "mean" divides
the weighted sum by the sum of the non-ignored positions' weights. Its gradient with respect to row
i's logits is ``softmax * coef_s - onehot * coef_t - coef_u`` (times the softcap derivative): the
kernels take ``coef_s`` and ``coef_t``; the uniform ``coef_u`` term adds rank-one products outside.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..options import Options
from ..plans import CallProblem
from ..strategies import forward as fwd
from ..strategies.common import RowLayout
from ..strategies.rows import row_coefficients

__all__ = ["Call", "prepare", "loss_dtype", "pred_shape", "raise_landed_checks", "rows_flatten"]


@dataclass
class Call:
    """Everything about one call that is not a differentiable tensor."""

    impl: str  # "triton" | "torch"
    options: Options
    pred_shape: torch.Size  # shape of the predicted targets (targets[..., shift:])
    valid: torch.Tensor  # (n,) bool: the position's target is not ignore_index
    weights: torch.Tensor  # (n,) in dtype: the token weight of each position, 0 where ignored (or out of range)
    rows: torch.Tensor  # row index of each predicting position in e.reshape(-1, D)
    layout: RowLayout | None  # how the kernels address those rows (Triton path)
    targets: torch.Tensor  # (n,) int64 target of each position; 0 where ignored or out of range
    out_of_range: torch.Tensor  # (n,) bool: the target is not ignore_index and lies outside [0, V) (an error)
    raw_targets: torch.Tensor  # (n,) the targets as given (for the range check)
    V: int
    has_token_weights: bool = False
    firsts: torch.Tensor | None = None  # kernels' path: each block's first position out of range and its target
    _denominator: torch.Tensor | None = field(default=None, repr=False)
    _unit_coef: torch.Tensor | None = field(default=None, repr=False)
    dtype: torch.dtype = torch.float32  # the loss's, the LSE's and the per-row terms': float64 for float64 e

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
        """Raise on a target outside [0, V) that is not ignore_index (the kernels only ever see
        in-range targets, and such a row's loss is NaN). On the CPU at once; on a GPU without a
        host sync: the finding is copied to the host asynchronously and raised by the first call of
        this process (this call's backward, usually) that finds the copy landed
        (:func:`raise_landed_checks`). Not at all while a CUDA graph is being captured."""
        if not self.n_rows:
            return
        bad = self.out_of_range
        t = self.raw_targets
        if not t.is_cuda:
            if bool(bad.any()):
                raise ValueError(_out_of_range_message(int(t[bad][0]), self.V, self.options.ignore_index))
            return
        if torch.cuda.is_current_stream_capturing():
            return
        # Each block's first bad position (n where none) and its target, as the targets kernel found
        # them (the PyTorch path: the first bad row's, row 0 when none; gather, not t[index]: indexing
        # with a 0-d tensor reads the index back, a sync per call).
        found = self.firsts
        if found is None:
            first = bad.view(torch.uint8).argmax().view(1)
            found = torch.stack([torch.where(bad.gather(0, first), first, self.n_rows), t.gather(0, first).long()], 1)
        host = torch.empty(found.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(found, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        with _pending_lock:
            _pending.append((landed, host, self.V, self.options.ignore_index, self.n_rows))

    def denominator(self) -> torch.Tensor:
        """What "mean" divides by: the summed weights of the non-ignored positions (their count
        without token weights). 0 when every position is ignored: the loss is then NaN, as torch's.
        (Made once a call: the forward's loss and its backward's coefficients both use it; the
        kernels' path sums it with the loss: :meth:`keep_denominator`.)"""
        if self._denominator is None:
            self._denominator = self.weights.sum()
        return self._denominator

    def keep_denominator(self, value: torch.Tensor) -> None:
        """Keep ``value`` (0-d, on the device: the weights' sum the loss was divided by) as the
        call's :meth:`denominator`, unless one was made already."""
        if self._denominator is None:
            self._denominator = value

    def unit_coef(self) -> torch.Tensor:
        """Per-row gradient coefficient of the reduced loss for a unit incoming gradient (made once a
        call)."""
        if self._unit_coef is None:
            self._unit_coef = self.weights / self.denominator().clamp(min=torch.finfo(torch.float32).tiny) \
                if self.reduction == "mean" else self.weights
        return self._unit_coef

    def coefficients(self, grad_loss, grad_lse, lse):
        """(coef_s, coef_t, coef_u, lse_v) of each row (fp32, (n,); see the module docstring) from the
        forward's ``lse`` (0 at ignored rows); ``lse_v``: the LSE, +inf at ignored rows (their softmax,
        so their gradient, is then 0). On the kernels' path in one launch
        (:func:`~cce_autotune.strategies.rows.row_coefficients`: the same values)."""
        o = self.options
        if self.impl == "triton":
            return row_coefficients(grad_loss, grad_lse.reshape(-1) if grad_lse is not None else None, self.valid,
                                    self.weights, lse, self.denominator() if o.reduction == "mean" else None,
                                    reduction=o.reduction, label_smoothing=o.label_smoothing, V=self.V,
                                    z_loss=o.z_loss)
        n, dt = self.n_rows, self.dtype
        if grad_loss is None:
            g = torch.zeros(n, dtype=dt, device=lse.device)
        elif o.reduction == "none":
            # (a select, not a product: an infinite incoming gradient at an ignored row stays out)
            g = torch.where(self.valid, grad_loss.reshape(-1).to(dt) * self.weights, 0.0)
        else:
            g = torch.where(self.valid, grad_loss.to(dt) * self.unit_coef(), 0.0)
        coef_t = g * (1.0 - o.label_smoothing) if o.label_smoothing else g
        coef_s = g * (1.0 + 2.0 * o.z_loss * lse) if o.z_loss else g
        if grad_lse is not None:
            coef_s = coef_s + torch.where(self.valid, grad_lse.reshape(-1).to(dt), 0.0)
        coef_u = g * (o.label_smoothing / self.V) if o.label_smoothing else None
        lse_v = torch.where(self.valid, lse, float("inf"))
        return coef_s.contiguous(), coef_t.contiguous(), coef_u, lse_v

    def problem(self, e, c, bias, tile_map=None) -> CallProblem:
        """The call's sizes for the planner (``tile_map``: the forward's, alive during the backward)."""
        D = e.shape[-1]
        return CallProblem(
            n=self.n_rows, n_all=e.numel() // D, V=self.V, D=D, elem=e.element_size(),
            grad_bytes=sum(t.numel() * t.element_size() for t in (e, c, bias) if t is not None),
            e_view=rows_flatten(e), sorted_vocab=tile_map is not None,
            map_bytes=tile_map.nbytes if tile_map is not None else 0, c_elem=c.element_size(),
            cast_bytes=self.V * D * e.element_size() if c.dtype != e.dtype else 0,
            dense_rows=self.layout is None or self.layout.dense_stride is not None,
        )


_pending: list = []  # (event, pinned host copy of (first bad position or n, its target) pairs, V, ignore_index, n)
# of GPU range checks in flight
_pending_lock = threading.Lock()


def _out_of_range_message(value: int, V: int, ignore_index: int) -> str:
    return f"targets: value {value} is outside [0, {V}) and is not ignore_index={ignore_index}"


def raise_landed_checks() -> None:
    """Raise the ValueError of the first GPU range check (:meth:`Call.check_targets`) whose host copy
    has landed and found a target out of range; checks still in flight stay for a later call."""
    if not _pending or torch.cuda.is_current_stream_capturing():
        return
    with _pending_lock:
        landed = [x for x in _pending if x[0].query()]
        for x in landed:
            _pending.remove(x)
    for _, host, V, ignore_index, n in landed:
        first, value = min(host.tolist())
        if first < n:
            raise ValueError(_out_of_range_message(value, V, ignore_index) + " (found by a GPU check without a host "
                             "sync: in this call or an earlier one of this process; that call's loss was NaN)")


def pred_shape(batch, shift: int) -> torch.Size:
    """The shape of the predicted targets of a batch shape (``targets[..., shift:]``)."""
    return torch.Size(tuple(batch[:-1]) + (batch[-1] - shift,))


def prepare(e, c, targets, bias, token_weights, o: Options, impl: str, V: int | None = None) -> Call:
    """The call's rows, targets and weights (and, on the kernels' path, their layout); ``V``: the
    vocabulary's size where ``c`` holds a shard of it (default: c's rows)."""
    dev = e.device
    dt = loss_dtype(e.dtype)
    V = c.shape[0] if V is None else V
    batch = tuple(e.shape[:-1])
    T = batch[-1]
    shape = pred_shape(batch, o.shift)
    raw = targets.narrow(-1, o.shift, T - o.shift).reshape(-1)
    tw = token_weights.narrow(-1, o.shift, T - o.shift).reshape(-1) if token_weights is not None else None
    firsts = None
    if impl == "triton":  # (one launch: about a dozen element-wise ops' host time otherwise)
        valid, out_of_range, tgt, weights, firsts = fwd.prepare_targets(raw, tw, o.ignore_index, V)
    else:
        valid = raw.long() != o.ignore_index
        out_of_range = valid & ((raw < 0) | (raw >= V))
        # A position whose target is out of range (an error, raised by check_targets) has no gradient.
        takes_part = valid & ~out_of_range
        tgt = torch.where(takes_part, raw, 0).to(torch.int64)
        # A select: the weight of an ignored position (NaN or inf where a padding sequence's weights
        # are 1/0) never reaches the loss or the gradients.
        weights = takes_part.to(dt) if tw is None else torch.where(takes_part, tw.to(dt), 0.0)
    # Row of each prediction in e.reshape(-1, D).
    row_strides = _contiguous_strides(batch)
    rows = _grid_offsets(shape, row_strides, dev)
    layout = _row_layout(e, shape, row_strides) if impl == "triton" else None
    return Call(impl=impl, options=o, pred_shape=shape, valid=valid, weights=weights, rows=rows, layout=layout,
                targets=tgt, out_of_range=out_of_range, raw_targets=raw, V=V, has_token_weights=token_weights is not None,
                firsts=firsts, dtype=dt)


def loss_dtype(e_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the loss, the LSE and the per-row terms of a call whose embeddings are ``e_dtype``:
    float32, or float64 for float64 embeddings (the PyTorch path), whose loss and gradients are then
    float64 throughout (as PyTorch's cross_entropy's: ``torch.autograd.gradcheck`` passes)."""
    return torch.float64 if e_dtype == torch.float64 else torch.float32


_OFFSETS: dict = {}  # (shape, strides, device, stream) -> the offsets: the same tensor for every call of a shape
_OFFSETS_KEPT = 64


def _grid_offsets(shape, strides, device) -> torch.Tensor:
    """Σ_j index_j * strides[j] over the index grid of ``shape``, flattened (int64; read only: kept
    for the next call of the same shape on the same stream, except those made in inference mode).
    While a CUDA graph is captured the kept ones are neither read nor added to: the graph's replays
    read what it captured, and a kept tensor may be dropped (and its memory reused) later, while the
    graph's own stay its."""
    if _capturing(device):
        return _make_offsets(shape, strides, device)
    # (per stream: a call on another stream could read them before the kernels that made them ran)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (tuple(shape), tuple(strides), device, stream)
    off = _OFFSETS.get(key)
    if off is None:
        off = _make_offsets(shape, strides, device)
        if not torch.is_inference_mode_enabled():
            while len(_OFFSETS) >= _OFFSETS_KEPT:
                _OFFSETS.pop(next(iter(_OFFSETS)), None)
            _OFFSETS[key] = off
    return off


def _capturing(device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (of ``device``'s kind)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _make_offsets(shape, strides, device) -> torch.Tensor:
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


def _row_layout(e, shape, row_strides) -> RowLayout:
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
    de_offsets = _grid_offsets(shape, [s * D for s in row_strides], e.device)  # (the rows' offsets times D)
    return RowLayout(offsets=offsets, de_offsets=de_offsets, dense_stride=dense_stride, aligned=aligned)


def rows_flatten(e: torch.Tensor) -> bool:
    """Whether e's batch dimensions flatten into one row stride (``e.view(-1, D)`` is a view), from
    its sizes and strides alone (traceable; an empty e always views)."""
    if e.numel() == 0:
        return True
    dims = [(n, s) for n, s in zip(e.shape[:-1], e.stride()[:-1]) if n != 1]
    return all(s_outer == s_inner * n_inner for (_, s_outer), (n_inner, s_inner) in zip(dims, dims[1:]))

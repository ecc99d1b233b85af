"""A call's per-row element-wise work around the main kernels, one launch each on the kernels' path:
the loss from every row's LSE and target logit (its terms, token weights and reduction), and the
gradient's per-row coefficients. The PyTorch path takes about ten small operations for each (on the
H200's host about 20 us apiece: a quarter of a millisecond a call, while the device waits for the
host); these compute the same values with the same operations in the same order, none fused into
another (no multiply-add: the same bits as the PyTorch path's), but the sum of "sum" and "mean",
taken in another order (one program, a fixed order: the same bits every run).
"""

from __future__ import annotations

from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import load_utility
from ..launch import cdiv

__all__ = ["ROWS_BLOCK", "row_loss", "row_coefficients"]

ROWS_BLOCK = 1024  # rows a program takes (the summing program: at a time)


def row_loss(lse, zt, zsum, valid, out_of_range, weights, *, reduction: str, label_smoothing: float, V: int,
             z_loss: float, weighted: bool) -> tuple:
    """``(loss, lse_out, denominator)`` of (n,) fp32 ``lse``, ``zt`` and (label smoothing) ``zsum``
    (the row's logits summed over the vocabulary), with the call's ``valid``, ``out_of_range`` (bool)
    and ``weights`` (fp32; applied to the loss where ``weighted``): the loss, (n,) with
    ``reduction="none"`` and else 0-d (a sum, or with "mean" over ``denominator``, the summed weights:
    0-d, None with "none"); ``lse_out``: the LSE, 0 at ignored rows. See
    :func:`cce_autotune.runtime.execute.reduce_loss` for the terms."""
    n = lse.shape[0]
    dev = lse.device
    lse_out = torch.empty(n, dtype=torch.float32, device=dev)
    smooth = bool(label_smoothing)
    args = (lse, zt, zsum if smooth else lse, valid, out_of_range, weights, lse_out)
    scalars = (1.0 - label_smoothing if smooth else 1.0, label_smoothing / V if smooth else 0.0, float(z_loss))
    flags = dict(HAS_ZSUM=smooth, HAS_Z=bool(z_loss), HAS_WEIGHTS=weighted, BLOCK=ROWS_BLOCK)
    if reduction == "none":
        rows = torch.empty(n, dtype=torch.float32, device=dev)
        if n:
            kernel = load_utility("rows.py.j2", "cce_loss_rows_kernel")
            kernel[(cdiv(n, ROWS_BLOCK),)](*args, rows, n, *scalars, **flags, num_warps=4,
                                                  enable_fp_fusion=False)
        return rows, lse_out, None
    out = torch.empty(2, dtype=torch.float32, device=dev)
    kernel = load_utility("rows.py.j2", "cce_loss_sum_kernel")
    kernel[(1,)](*args, out, n, *scalars, **flags, MEAN=reduction == "mean", num_warps=4,
                    enable_fp_fusion=False)
    return out[0], lse_out, out[1]


def row_coefficients(grad_loss, grad_lse, valid, weights, lse, denominator, *, reduction: str,
                     label_smoothing: float, V: int, z_loss: float) -> tuple:
    """``(coef_s, coef_t, coef_u, lse_v)`` (fp32, (n,); ``coef_u`` None without label smoothing;
    ``coef_s`` is ``coef_t`` where they are equal) of the loss's gradient for the incoming
    ``grad_loss`` (0-d, or shaped like the rows with ``reduction="none"``; None: zero) and
    ``grad_lse`` ((n,) or None), from the forward's ``lse`` (0 at ignored rows) and the call's
    ``valid`` and ``weights``; ``denominator``: what "mean" divided by (0-d). ``lse_v``: the LSE,
    +inf at ignored rows. See :meth:`cce_autotune.runtime.call.Call.coefficients` for the terms."""
    n = lse.shape[0]
    dev = lse.device
    split = bool(z_loss) or grad_lse is not None or bool(label_smoothing)
    smooth = bool(label_smoothing)
    coef_t = torch.empty(n, dtype=torch.float32, device=dev)
    coef_s = torch.empty(n, dtype=torch.float32, device=dev) if split else coef_t
    coef_u = torch.empty(n, dtype=torch.float32, device=dev) if smooth else None
    lse_v = torch.empty(n, dtype=torch.float32, device=dev)
    if n:
        per_row = reduction == "none"
        gl = grad_loss.reshape(-1) if grad_loss is not None and per_row else grad_loss
        kernel = load_utility("rows.py.j2", "cce_coefficients_kernel")
        kernel[(cdiv(n, ROWS_BLOCK),)](
            gl if gl is not None else lse, grad_lse if grad_lse is not None else lse, valid, weights, lse,
            denominator if denominator is not None else lse, coef_s, coef_t, coef_u if smooth else coef_t, lse_v, n,
            gl.stride(0) if per_row and gl is not None else 0, grad_lse.stride(0) if grad_lse is not None else 0,
            1.0 - label_smoothing if smooth else 1.0, label_smoothing / V if smooth else 0.0, 2.0 * z_loss,
            HAS_GRAD_LOSS=grad_loss is not None, PER_ROW=per_row, MEAN=reduction == "mean",
            HAS_GRAD_LSE=grad_lse is not None, SMOOTH=smooth, HAS_Z=bool(z_loss), SPLIT=split, BLOCK=ROWS_BLOCK,
            num_warps=4, enable_fp_fusion=False)
    return coef_s, coef_t, coef_u, lse_v

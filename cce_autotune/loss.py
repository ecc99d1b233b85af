"""The public loss: argument checks, autocast, ``linear_cross_entropy`` and a Module.

The computation itself is the custom operators of :mod:`cce_autotune.ops` (eager, compiled and
meta runs alike)."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, Mapping

import torch

from . import activations, ops, planner
from .variant import KernelVariants, VariantError

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REDUCTIONS = ("mean", "sum", "none")
_IMPLS = ("auto", "triton", "torch")


def _check_tensors(e, c, targets, bias, token_weights, shift, impl):
    """Types, shapes, dtypes and devices (no tensor values: traceable by torch.compile)."""
    for name, t in (("e", e), ("c", c), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in (("bias", bias), ("token_weights", token_weights)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if e.dim() < 2:
        raise ValueError(f"e: expected shape (..., D) with at least one batch dimension, got {tuple(e.shape)}")
    if c.dim() != 2:
        raise ValueError(f"c: expected shape (V, D), got {tuple(c.shape)}")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"c: hidden size D={c.shape[1]} does not match e's D={e.shape[-1]}")
    if c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"c: empty classifier of shape {tuple(c.shape)}")
    torch_path = impl == "torch" or (impl == "auto" and e.device.type != "cuda")
    if e.dtype not in _DTYPES and not (torch_path and e.dtype == torch.float64):
        raise TypeError(f"e: dtype {e.dtype} not supported; use one of float32, bfloat16, float16 "
                        "(float64 on the PyTorch path: CPU tensors or impl='torch')")
    if c.dtype != e.dtype and not (c.dtype == torch.float32 and e.dtype in (torch.bfloat16, torch.float16)):
        raise TypeError(
            f"c: dtype {c.dtype} does not go with e's dtype {e.dtype}: c must have e's dtype, or be float32 "
            "with bfloat16/float16 e (mixed precision; inside torch.autocast, e is cast to the autocast dtype)")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets: expected an integer tensor, got {targets.dtype}")
    if tuple(targets.shape) != tuple(e.shape[:-1]):
        raise ValueError(f"targets: shape {tuple(targets.shape)} does not match e's batch shape {tuple(e.shape[:-1])}")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != c.shape[0]:
            raise ValueError(f"bias: expected shape ({c.shape[0]},), got {tuple(bias.shape)}")
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias: expected a floating-point tensor, got {bias.dtype}")
    if token_weights is not None:
        if tuple(token_weights.shape) != tuple(targets.shape):
            raise ValueError(f"token_weights: shape {tuple(token_weights.shape)} does not match targets' "
                             f"shape {tuple(targets.shape)}")
        if not token_weights.dtype.is_floating_point:
            raise TypeError(f"token_weights: expected a floating-point tensor, got {token_weights.dtype}")
    for name, t in (("c", c), ("targets", targets), ("bias", bias), ("token_weights", token_weights)):
        if t is not None and t.device != e.device:
            raise ValueError(f"{name}: on {t.device}, but e is on {e.device}; all tensors must share one device")
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"shift: expected an int, got {type(shift).__name__}")
    T = e.shape[-2]
    if not 0 <= shift < max(T, 1):
        raise ValueError(f"shift: {shift} out of range [0, {T}) for a last batch dimension of {T}")


def _number(name: str, value, lo: float, hi: float, hi_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < lo or (value >= hi if hi_open else value > hi):
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}{')' if hi_open else ']'}, got {value!r}")
    return float(value)


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing the compiler with the package
    (over a second): it sets this marker; tests/test_compile.py fails if a release changes it."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _encode_options(ignore_index, softcap, reduction, shift, return_lse, label_smoothing, z_loss, filter_eps, impl,
                    variants, max_extra_memory, deterministic=None) -> str:
    """Check the non-tensor arguments; the :class:`~cce_autotune.ops.Options` string the operators
    take (under torch.compile, evaluated once while tracing)."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: {reduction!r} is not one of {list(_REDUCTIONS)}")
    if impl not in _IMPLS:
        raise ValueError(f"impl: {impl!r} is not one of {list(_IMPLS)}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
                or softcap <= 0:
            raise ValueError(f"softcap: expected a positive finite number or None, got {softcap!r}")
        softcap = float(softcap)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    if filter_eps not in ("auto", None):
        if isinstance(filter_eps, bool) or not isinstance(filter_eps, (int, float)) or not 0 < filter_eps < 1:
            raise ValueError(f"filter_eps: expected 'auto', None (exact) or a float in (0, 1), got {filter_eps!r}")
        filter_eps = float(filter_eps)
    label_smoothing = _number("label_smoothing", label_smoothing, 0.0, 1.0, hi_open=False)
    z_loss = _number("z_loss", z_loss, 0.0, math.inf)
    if deterministic is not None and not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected True, False or None, got {deterministic!r}")
    if isinstance(variants, str):  # KernelVariants.json_text
        variants = json.loads(variants)
    if variants is not None:
        if isinstance(variants, Mapping):
            try:
                variants = KernelVariants.from_dict(variants)
            except (VariantError, TypeError) as exc:
                raise ValueError(f"variants: {str(exc).removeprefix('variants: ')}") from exc
        if not isinstance(variants, KernelVariants):
            raise TypeError(f"variants: expected KernelVariants, a dict of kernel variants or None, got "
                            f"{type(variants).__name__}")
        variants = variants.to_dict()
    return ops.Options(
        ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=shift, return_lse=bool(return_lse),
        label_smoothing=label_smoothing, z_loss=z_loss, filter_eps=filter_eps, impl=impl, variants=variants,
        max_extra_memory=planner.parse_bytes(max_extra_memory),
        deterministic=torch.are_deterministic_algorithms_enabled() if deterministic is None else bool(deterministic),
    ).encode()


def _autocast(e: torch.Tensor) -> torch.Tensor:
    """Inside a ``torch.autocast`` region, e in the autocast dtype, as autocast would hand it to the
    classifier's matmul (a copy of e, n x D; the classifier is never copied: the kernels round its
    tiles in registers)."""
    dev = e.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if e.dtype != dt and e.dtype in _DTYPES:
            return e.to(dt)
    return e


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
    label_smoothing: float = 0.0,
    token_weights: torch.Tensor | None = None,
    z_loss: float = 0.0,
    return_lse: bool = False,
    filter_eps: float | str | None = "auto",
    impl: str = "auto",
    variants: KernelVariants | Mapping[str, Any] | None = None,
    max_extra_memory: int | str | None = "auto",
    deterministic: bool | None = None,
):
    """Cross-entropy of ``softcap(e @ c.T + bias)`` against ``targets``, without the logit matrix.

    Same value as ``F.cross_entropy(softcap(e @ c.T + bias).float().flatten(0, -2), targets.flatten(),
    ignore_index=..., reduction=..., label_smoothing=...)`` (with ``reduction="none"`` shaped like the
    predicted targets), plus the optional token weights and z-loss.

    Args:
        e: (..., D) embeddings; float32, bfloat16 or float16. Any strides. Inside ``torch.autocast``
            it is cast to the autocast dtype, as for a matmul.
        c: (V, D) classifier: e's dtype, or float32 with 16-bit ``e`` (mixed precision: the kernels
            round its tiles to e's dtype in registers, no copy of ``c``; dC comes back in float32).
        targets: integer tensor shaped like ``e.shape[:-1]``; values in [0, V) or ``ignore_index``.
        bias: optional (V,) bias (any floating dtype; its gradient comes back in its dtype).
        ignore_index: target value whose positions contribute nothing.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)``.
        reduction: "mean" (over non-ignored positions, weighted by ``token_weights``), "sum" or "none".
        shift: position ``t`` of the last batch dimension predicts target ``t + shift`` (next-token
            loss with ``shift=1``) without copying ``e``; "none" returns ``targets[..., shift:]``'s shape.
        label_smoothing: in [0, 1], as ``F.cross_entropy``'s: the target distribution is
            ``(1 - ls) * onehot + ls / V``.
        token_weights: optional float tensor shaped like ``targets``: position i's loss is multiplied
            by ``token_weights[i]`` (loss masks, token scaling); "mean" divides by the sum of the
            non-ignored positions' weights. Not differentiated.
        z_loss: coefficient of PaLM's z-loss: each position adds ``z_loss * lse**2``.
        return_lse: also return the per-position log-sum-exp (fp32, 0 at ignored positions),
            differentiable.
        filter_eps: "auto" (the kernel variant's), None (exact gradients) or a float: backward tiles
            whose softmax values are all below it are skipped. The torch path is always exact.
        impl: "auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". With
            ``TRITON_INTERPRET=1``, "triton" runs the kernels on CPU tensors. (Label smoothing with a
            softcap always takes the chunked PyTorch path.)
        variants: explicit kernel variants (:class:`KernelVariants` or its dict form); by default the
            dispatcher picks them from the tuned-config database.
        max_extra_memory: device memory the backward may use beyond the gradients themselves:
            "auto" (``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY`` if set, else ``0.05 * (|dE| + |dC|) + 32 MiB``
            plus an fp32 copy of dE),
            None (unlimited), a byte count or a size string ("2GiB"). The planner runs the fastest
            strategy that fits (:mod:`cce_autotune.planner`).
        deterministic: the same gradient bits from run to run (the same calls in the same order): the
            backward takes the chunked strategy (or the fused one), whose sums use no float atomics,
            and the LSE's splits merge through a buffer. None (default): follow
            ``torch.use_deterministic_algorithms``.

    Returns:
        The loss (fp32), or ``(loss, lse)`` when ``return_lse``.

    The call is one custom operator each way (:mod:`cce_autotune.ops`): it compiles with
    ``torch.compile(fullgraph=True)`` and runs on meta tensors (shapes only).
    """
    e = _autocast(e)
    if isinstance(softcap, torch.Tensor):  # a 0-d tensor holding the cap (read once, on the host)
        if softcap.numel() != 1 or not softcap.dtype.is_floating_point:
            raise ValueError(f"softcap: expected a positive finite number or None, got a tensor of shape "
                             f"{tuple(softcap.shape)} and dtype {softcap.dtype}")
        softcap = float(softcap)
    if isinstance(variants, KernelVariants) and variants.json_text is not None:
        variants = variants.json_text
    _check_tensors(e, c, targets, bias, token_weights, shift, impl)
    if activations._active:  # a capture() block is open: save what this call sees (eager only)
        activations.record(e, c, targets, bias, softcap, ignore_index, shift)
    options = _encode_options(ignore_index, softcap, reduction, shift, return_lse, label_smoothing, z_loss,
                              filter_eps, impl, variants, max_extra_memory, deterministic)
    needs_grad = torch.is_grad_enabled() and (
        e.requires_grad or c.requires_grad or (bias is not None and bias.requires_grad))
    if token_weights is not None:
        token_weights = token_weights.detach()
    loss, lse, _ = torch.ops.cce_autotune.lce_forward(e, c, bias, targets, token_weights, options, needs_grad)
    if return_lse:
        return loss, lse.view(ops.pred_shape(e.shape[:-1], shift))
    return loss


class LinearCrossEntropy(torch.nn.Module):
    """Module wrapper holding the options of :func:`linear_cross_entropy`.

    ``forward(e, c, targets, bias=None, token_weights=None)``: the classifier is passed in, so that it
    can stay tied to an embedding or live in another module.
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        softcap: float | None = None,
        reduction: str = "mean",
        shift: int = 0,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        return_lse: bool = False,
        filter_eps: float | str | None = "auto",
        impl: str = "auto",
        variants: KernelVariants | Mapping[str, Any] | None = None,
        max_extra_memory: int | str | None = "auto",
        deterministic: bool | None = None,
    ):
        super().__init__()
        self.options = dict(
            ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=shift,
            label_smoothing=label_smoothing, z_loss=z_loss, return_lse=return_lse, filter_eps=filter_eps,
            impl=impl, variants=variants, max_extra_memory=max_extra_memory, deterministic=deterministic,
        )

    def forward(self, e, c, targets, bias=None, token_weights=None):
        return linear_cross_entropy(e, c, targets, bias, token_weights=token_weights, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "variants")

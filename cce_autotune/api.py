"""The public loss: ``linear_cross_entropy`` and its Module, argument checks and autocast.

The computation itself is the custom operators of :mod:`cce_autotune.runtime.ops` (eager, compiled
and meta runs alike). The options are defined once, in :class:`cce_autotune.options.Options`: the
function's and the Module's keyword arguments are generated from it.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from . import distributed
from .data import captured
from .options import Options, option_docs, option_names, option_parameters
from .runtime import ops  # noqa: F401 - registers the operators torch.ops.cce_autotune.lce_forward/backward
from .runtime.call import pred_shape, rows_flatten
from .variant import KernelVariants

__all__ = ["linear_cross_entropy", "LinearCrossEntropy"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_kinds(e, c, targets, bias, token_weights):
    """Every tensor argument a dense tensor (before anything reads its device or dtype)."""
    for name, t in (("e", e), ("c", c), ("targets", targets), ("bias", bias), ("token_weights", token_weights)):
        if t is None and name in ("bias", "token_weights"):
            continue
        if not isinstance(t, torch.Tensor):
            optional = " or None" if name in ("bias", "token_weights") else ""
            raise TypeError(f"{name}: expected a torch.Tensor{optional}, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}; convert it with "
                            ".to_dense()")


def _check_tensors(e, c, targets, bias, token_weights, shift, impl):
    """Shapes, dtypes and devices (no tensor values: traceable by torch.compile); the kinds are
    checked first (:func:`_check_kinds`)."""
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


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing the compiler with the package
    (over a second): it sets this marker; tests/test_compile.py fails if a release changes it."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _encode_options(**options) -> str:
    """Check the options and encode them as the operators take them (under torch.compile, evaluated
    once while tracing). The same options (the same values of the same types) give the same text: it
    is kept for the next call (a call's host time is a cost), except where a value is not hashable."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = (deterministic, *sorted((k, type(v), v) for k, v in options.items()))
    try:
        return _encoded(key)
    except TypeError:  # (an unhashable value, e.g. a dict of variants: checked every time)
        return Options.check(deterministic_default=deterministic, **options).encode()


@lru_cache(maxsize=256)
def _encoded(key: tuple) -> str:
    return Options.check(deterministic_default=key[0], **{k: v for k, _, v in key[1:]}).encode()


def _unexpected(fn_name: str, options: dict) -> None:
    for name in options:
        if name not in _OPTIONS:
            raise TypeError(f"{fn_name}() got an unexpected keyword argument {name!r}")


_OPTIONS = frozenset(option_names())


def _autocast(e: torch.Tensor) -> torch.Tensor:
    """Inside a ``torch.autocast`` region, e in the autocast dtype, as autocast would hand it to the
    classifier's matmul (a copy of e, n x D; the classifier is not cast here: the kernels convert it
    to e's dtype a vocabulary chunk at a time, or whole when it fits one chunk)."""
    dev = e.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if e.dtype != dt and e.dtype in _DTYPES:
            return e.to(dt)
    return e


def linear_cross_entropy(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None = None,
                         *, token_weights: torch.Tensor | None = None, **options):
    """Cross-entropy of ``softcap(e @ c.T + bias)`` against ``targets``, without the logit matrix.

    Same value as ``F.cross_entropy(softcap(e @ c.T + bias).float().flatten(0, -2), targets.flatten(),
    ignore_index=..., reduction=..., label_smoothing=...)`` (with ``reduction="none"`` shaped like the
    predicted targets), plus the optional token weights and z-loss.

    Args:
        e: (..., D) embeddings; float32, bfloat16 or float16. Any strides. Inside ``torch.autocast``
            it is cast to the autocast dtype, as for a matmul.
        c: (V, D) classifier: e's dtype, or float32 with 16-bit ``e`` (mixed precision: the kernels
            convert it to e's dtype a vocabulary chunk at a time, or whole when it fits one chunk;
            dC comes back in float32).
        targets: integer tensor shaped like ``e.shape[:-1]``; values in [0, V) or ``ignore_index``.
        bias: optional (V,) bias (any floating dtype; its gradient comes back in its dtype).
        token_weights: optional float tensor shaped like ``targets``: position i's loss is multiplied
            by ``token_weights[i]`` (loss masks, token scaling); "mean" divides by the sum of the
            non-ignored positions' weights. Not differentiated.

    Options (keyword arguments, :class:`cce_autotune.options.Options`):
{options}

    Returns:
        The loss (fp32; float64 for float64 inputs), or ``(loss, lse)`` when ``return_lse``.

    The call is one custom operator each way (:mod:`cce_autotune.runtime.ops`): it compiles with
    ``torch.compile(fullgraph=True)`` and runs on meta tensors (shapes only).
    """
    _unexpected("linear_cross_entropy", options)
    _check_kinds(e, c, targets, bias, token_weights)
    e = _autocast(e)
    softcap = options.get("softcap")
    if isinstance(softcap, torch.Tensor):  # a 0-d tensor holding the cap (read once, on the host)
        if softcap.numel() != 1 or not softcap.dtype.is_floating_point:
            raise ValueError(f"softcap: expected a positive finite number or None, got a tensor of shape "
                             f"{tuple(softcap.shape)} and dtype {softcap.dtype}")
        options = {**options, "softcap": float(softcap)}
    variants = options.get("variants")
    if isinstance(variants, KernelVariants) and variants.json_text is not None:
        options = {**options, "variants": variants.json_text}
    shift, impl = options.get("shift", 0), options.get("impl", "auto")
    _check_tensors(e, c, targets, bias, token_weights, shift, impl)
    encoded = _encode_options(**options)
    needs_grad = torch.is_grad_enabled() and (
        e.requires_grad or c.requires_grad or (bias is not None and bias.requires_grad))
    if token_weights is not None:
        token_weights = token_weights.detach()
    if distributed.has_dtensor(e, c, bias, targets, token_weights):  # (torch.distributed's DTensors, checked whole)
        return distributed.linear_cross_entropy(linear_cross_entropy, e, c, targets, bias, token_weights, options,
                                                encoded, needs_grad)
    if captured.active():  # a capture() block is open: save what this call sees (eager only; checked options)
        captured.record(e, c, targets, bias, options.get("softcap"), options.get("ignore_index", -100), shift)
    T = e.shape[-2]
    moved = shift > 0 and rows_flatten(e)
    if moved:
        # The shift as ignored targets: the targets move ``shift`` places left and the last ``shift``
        # positions of each sequence are ignored, so every row of e takes part and e stays one dense
        # matrix (no offset table, no row gather; the kernels may read it through TMA descriptors).
        # The same loss and gradients; ``shift`` more rows a sequence, narrowed off the outputs. (A
        # layout whose batch dimensions do not flatten keeps the shift: its rows are gathered either way.)
        ignore = options.get("ignore_index", -100)
        targets = torch.nn.functional.pad(targets.narrow(-1, shift, T - shift), (0, shift), value=ignore)
        if token_weights is not None:
            token_weights = torch.nn.functional.pad(token_weights.narrow(-1, shift, T - shift), (0, shift))
        encoded = _encode_options(**{**options, "shift": 0})
    loss, lse, _ = torch.ops.cce_autotune.lce_forward(e, c, bias, targets, token_weights, encoded, needs_grad)
    if moved and options.get("reduction", "mean") == "none":
        loss = loss.narrow(-1, 0, T - shift).contiguous()
    if options.get("return_lse", False):
        if moved:
            return loss, lse.view(e.shape[:-1]).narrow(-1, 0, T - shift).contiguous()
        return loss, lse.view(pred_shape(e.shape[:-1], shift))
    return loss


linear_cross_entropy.__doc__ = linear_cross_entropy.__doc__.format(options=option_docs(" " * 8))
linear_cross_entropy.__signature__ = inspect.Signature(
    [inspect.Parameter("e", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor),
     inspect.Parameter("c", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor),
     inspect.Parameter("targets", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor),
     inspect.Parameter("bias", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
     inspect.Parameter("token_weights", inspect.Parameter.KEYWORD_ONLY, default=None),
     *option_parameters()])


class LinearCrossEntropy(torch.nn.Module):
    """Module wrapper holding the options of :func:`linear_cross_entropy`.

    ``forward(e, c, targets, bias=None, token_weights=None)``: the classifier is passed in, so that it
    can stay tied to an embedding or live in another module.

    Options (keyword arguments, :class:`cce_autotune.options.Options`):
{options}
    """

    def __init__(self, **options):
        super().__init__()
        _unexpected("LinearCrossEntropy", options)
        self.options = {name: options.get(name, default.default) for name, default in _PARAMS.items()}

    def forward(self, e, c, targets, bias=None, token_weights=None):
        return linear_cross_entropy(e, c, targets, bias, token_weights=token_weights, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "variants")


_PARAMS = {p.name: p for p in option_parameters()}
LinearCrossEntropy.__doc__ = LinearCrossEntropy.__doc__.format(options=option_docs(" " * 8))
LinearCrossEntropy.__init__.__signature__ = inspect.Signature(
    [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD), *option_parameters()])

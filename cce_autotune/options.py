"""The options of a call: one definition, from which :func:`cce_autotune.linear_cross_entropy`'s
keyword arguments, :class:`cce_autotune.LinearCrossEntropy`'s constructor and the string the custom
operators take all derive.

:meth:`Options.check` validates what a caller passed (a clear error naming the argument) and returns
the options as the operators take them: the variants as a dict, the memory budget parsed,
``deterministic`` resolved; :meth:`Options.encode` / :meth:`Options.decode` turn them into the JSON
string the operators take (a constant for ``torch.compile``).
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import Any, Mapping

from .planning.budget import parse_bytes
from .variant import KernelVariants, VariantError

__all__ = ["Options", "REDUCTIONS", "IMPLS", "check_softcap", "option_names", "option_parameters", "option_docs"]

REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "triton", "torch")


def _doc(text: str) -> dict:
    return {"doc": text}


@dataclass(frozen=True)
class Options:
    """The non-tensor arguments of one call (defaults as a caller sees them)."""

    ignore_index: int = field(default=-100, metadata=_doc("target value whose positions contribute nothing."))
    softcap: float | None = field(default=None, metadata=_doc(
        "if set, logits become ``softcap * tanh(logits / softcap)``."))
    reduction: str = field(default="mean", metadata=_doc(
        '"mean" (over non-ignored positions, weighted by ``token_weights``), "sum" or "none".'))
    shift: int = field(default=0, metadata=_doc(
        "position ``t`` of the last batch dimension predicts target ``t + shift`` (next-token loss with "
        "``shift=1``) without copying ``e``; \"none\" returns ``targets[..., shift:]``'s shape."))
    label_smoothing: float = field(default=0.0, metadata=_doc(
        "in [0, 1], as ``F.cross_entropy``'s: the target distribution is ``(1 - ls) * onehot + ls / V``."))
    z_loss: float = field(default=0.0, metadata=_doc("coefficient of PaLM's z-loss: each position adds "
                                                     "``z_loss * lse**2``."))
    return_lse: bool = field(default=False, metadata=_doc(
        "also return the per-position log-sum-exp (fp32, 0 at ignored positions), differentiable."))
    filter_eps: Any = field(default="auto", metadata=_doc(
        '"auto" (the kernel variant\'s), None (exact gradients) or a float: backward tiles whose softmax '
        "values are all below it are skipped. The torch path is always exact."))
    impl: str = field(default="auto", metadata=_doc(
        '"auto" (Triton on CUDA, PyTorch elsewhere), "triton" or "torch". With ``TRITON_INTERPRET=1``, '
        '"triton" runs the kernels on CPU tensors. (Label smoothing with a softcap always takes the chunked '
        "PyTorch path.)"))
    variants: Any = field(default=None, metadata=_doc(
        "explicit kernel variants (:class:`KernelVariants` or its dict form); by default the dispatcher "
        "picks them from the tuned-config database."))
    max_extra_memory: Any = field(default="auto", metadata=_doc(
        'device memory the backward may use beyond the gradients themselves: "auto" '
        "(``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY`` if set, else ``0.05 * (|dE| + |dC|) + 32 MiB`` plus an fp32 copy "
        'of dE), None (unlimited), a byte count or a size string ("2GiB"). The planner runs the fastest '
        "strategy that fits."))
    deterministic: Any = field(default=None, metadata=_doc(
        "the same gradient bits from run to run (the same calls in the same order): strategies whose sums "
        "use no float atomics, and the LSE's splits merged through a buffer. None (default): follow "
        "``torch.use_deterministic_algorithms``."))

    # -- checking -------------------------------------------------------------------------------
    @classmethod
    def check(cls, deterministic_default: bool = False, **given) -> "Options":
        """The options a caller passed (keyword arguments, any subset), validated: ValueError or
        TypeError naming the argument. Returns them as the operators take them: ``variants`` a dict
        (or None), ``max_extra_memory`` parsed ("auto", None or bytes), ``deterministic`` a bool
        (``deterministic_default`` where it is None)."""
        unknown = [k for k in given if k not in _NAMES]
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the options are {list(_NAMES)}")
        o = {**_DEFAULTS, **given}
        reduction, impl, softcap = o["reduction"], o["impl"], o["softcap"]
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction: {reduction!r} is not one of {list(REDUCTIONS)}")
        if impl not in IMPLS:
            raise ValueError(f"impl: {impl!r} is not one of {list(IMPLS)}")
        softcap = check_softcap(softcap)
        ignore_index = o["ignore_index"]
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
        if not -2**63 <= ignore_index < 2**63:
            raise ValueError(f"ignore_index: {ignore_index} is outside the int64 range the targets hold")
        filter_eps = o["filter_eps"]
        if filter_eps not in ("auto", None):
            if isinstance(filter_eps, bool) or not isinstance(filter_eps, (int, float)) or not 0 < filter_eps < 1:
                raise ValueError(f"filter_eps: expected 'auto', None (exact) or a float in (0, 1), got {filter_eps!r}")
            filter_eps = float(filter_eps)
        label_smoothing = _number("label_smoothing", o["label_smoothing"], 0.0, 1.0, hi_open=False)
        z_loss = _number("z_loss", o["z_loss"], 0.0, math.inf)
        deterministic = o["deterministic"]
        if deterministic is not None and not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected True, False or None, got {deterministic!r}")
        variants = o["variants"]
        if isinstance(variants, str):  # KernelVariants.json_text
            try:
                variants = json.loads(variants)
            except ValueError as exc:
                raise ValueError(f"variants: not valid JSON ({exc})") from None
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
        return cls(ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=o["shift"],
                   label_smoothing=label_smoothing, z_loss=z_loss, return_lse=bool(o["return_lse"]),
                   filter_eps=filter_eps, impl=impl, variants=variants,
                   max_extra_memory=parse_bytes(o["max_extra_memory"]),
                   deterministic=deterministic_default if deterministic is None else bool(deterministic))

    # -- the operators' string ------------------------------------------------------------------
    def encode(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    @lru_cache(maxsize=256)
    def decode(text: str) -> "Options":
        return Options(**json.loads(text))


def check_softcap(value) -> float | None:
    """``softcap`` as a float, or None; ValueError naming it unless it is None or a positive finite
    number (also what an activation file may hold: :mod:`cce_autotune.data.captured`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap: expected a positive finite number or None, got {value!r}")
    return float(value)


def _number(name: str, value, lo: float, hi: float, hi_open: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < lo or (value >= hi if hi_open else value > hi):
        raise ValueError(f"{name}: expected a number in [{lo}, {hi}{')' if hi_open else ']'}, got {value!r}")
    return float(value)


_NAMES = tuple(f.name for f in fields(Options))
_DEFAULTS = {f.name: f.default for f in fields(Options)}


def option_names() -> tuple:
    """The options' names, in definition order."""
    return _NAMES


def option_parameters() -> list:
    """The options as keyword-only :class:`inspect.Parameter` s with their defaults (for the generated
    signatures of the function and the Module)."""
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in fields(Options)]


def option_docs(indent: str = "    ") -> str:
    """The options' descriptions as a docstring's argument list."""
    lines = []
    for f in fields(Options):
        lines.append(f"{indent}{f.name}: {f.metadata['doc']}")
    return "\n".join(lines)

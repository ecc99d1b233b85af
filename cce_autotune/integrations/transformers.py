"""Hugging Face ``transformers`` causal-LM models trained with :func:`cce_autotune.linear_cross_entropy`.

``patch(target, **options)`` replaces the ``forward`` of a causal-LM model (one instance, a class, or
a family's ``XxxForCausalLM`` class named by a string) so that, in training mode and with ``labels``,
the loss comes straight from the decoder's last hidden state and the ``lm_head`` weight, and the
``(batch, seq, vocab)`` logit tensor is never built. The output is the model's usual
``CausalLMOutputWithPast`` with ``logits=None`` (with ``return_dict=False``, the tuple keeps the
``None`` in the logits' place, so ``out[1]`` is never the cache). Without labels, or in eval mode
(evaluation, ``generate``), the original forward runs unchanged. ``unpatch(target)`` restores it.

The fused loss reads ``lm_head.weight`` (and ``bias``) instead of calling ``lm_head``, which is
only the same thing for a plain ``torch.nn.Linear``. A head that computes something else (a PEFT
LoRA layer on ``lm_head``, a quantized linear layer) would be skipped, changing the loss and leaving
its adapter without a gradient; so each call checks the head, and for such a head the original
forward computes the loss (exact, with the logit matrix) and a warning says so once. LoRA on the
other modules keeps the fused loss. The check is per call, so it does not matter whether the model
was patched before or after ``get_peft_model``, and ``patch`` accepts the PEFT model itself.

The patched loss follows ``transformers``' ``ForCausalLMLoss`` exactly: position ``t`` predicts
``labels[..., t + 1]`` (or ``shift_labels[..., t]`` when that keyword is given), ``-100`` (or the
``ignore_index`` keyword) is ignored, the mean is over non-ignored positions, or the sum divided by
``num_items_in_batch`` when that keyword is given (as ``Trainer`` does under gradient accumulation),
and ``config.final_logit_softcapping`` (Gemma 2/3) is applied to the logits.

Under ``torch.distributed``: with FSDP2 (``fully_shard`` on the decoder layers and the root) the head's
weight is gathered for the root's forward, as for the original; a head sharded on its own
(``fully_shard(model.lm_head)``) is called, with the loss as its forward, so that FSDP gathers its
weight and reduces its gradient as for the original's call. A tensor-parallel plan that shards
``lm_head`` column-wise leaves its weight a ``Shard(0)`` DTensor, which ``linear_cross_entropy`` takes as
the vocabulary-parallel loss (:mod:`cce_autotune.distributed`).

``transformers`` is imported only when a model is patched; ``import cce_autotune`` never needs it.

Example::

    from cce_autotune.integrations.transformers import patch

    model = AutoModelForCausalLM.from_pretrained(...)
    patch(model)                      # or patch("llama"), patch(LlamaForCausalLM), before loading
    model.train()                     # (from_pretrained leaves the model in eval mode)
    loss = model(input_ids=ids, labels=ids).loss
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import warnings
from typing import Any, Callable

import torch

from ..api import linear_cross_entropy
from ..data import captured

__all__ = ["patch", "unpatch", "FAMILIES"]

#: Family name -> the ``transformers`` class ``patch(name)`` patches. Each of these forwards
#: computes ``lm_head(last_hidden_state)`` (then the optional ``final_logit_softcapping``) and
#: ``ForCausalLMLoss``; families that scale the logits otherwise (Granite, Cohere) or add an
#: auxiliary loss (MoE models) are left out on purpose.
FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # the text-only model
    "phi": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}

# linear_cross_entropy arguments the patched forward derives from the model and the call.
_DERIVED_OPTIONS = ("shift", "softcap", "reduction", "ignore_index", "return_lse", "token_weights")
_IGNORE_INDEX = -100  # transformers' default (ForCausalLMLoss)
_warned_heads: set[type] = set()  # lm_head types the fallback to the original forward was shown for


@dataclasses.dataclass(frozen=True)
class _Patch:
    """What one patched forward needs besides the model: fixed when it is patched."""

    original: Callable  # the unpatched forward function (takes self)
    positional: tuple[str, ...]  # its positional parameter names after self, in order
    options: dict[str, Any]  # extra keyword arguments for linear_cross_entropy
    causal_lm_loss: Callable  # transformers' ForCausalLMLoss, the loss the patch reproduces
    output_cls: type  # CausalLMOutputWithPast
    carried: tuple[str, ...]  # output fields copied from the decoder output (cache, hidden_states, ...)
    owned: bool  # the patched class defined forward itself (False: it was inherited)


def patch(target, **options):
    """Make ``target``'s training loss a :func:`linear_cross_entropy` call without the logit matrix.

    Args:
        target: a model instance (only that instance is patched), a model class (its ``forward``
            is replaced for every instance), or a family name from :data:`FAMILIES` (that
            family's ``XxxForCausalLM`` class). Classes must be (subclasses of) those classes.
            A PEFT model (``get_peft_model(model)``, anything with ``get_base_model()``) stands
            for the ``transformers`` model it wraps, whose instance is patched: PEFT calls that
            model's ``forward``. Patching before or after ``get_peft_model`` is the same.
        **options: passed on to :func:`linear_cross_entropy` (``impl``, ``filter_eps``,
            ``variants``, ``max_extra_memory``, ``label_smoothing``, ``z_loss``); the rest of its
            arguments come from the model and the call.

    Patching a patched target again replaces the previous patch (its options) rather than
    stacking a second one. With accelerate hooks (``device_map=...``) patch the class or family
    before loading the model. While ``lm_head`` is not a plain ``torch.nn.Linear`` (a LoRA adapter
    on it), the model's own forward computes the loss (see the module docstring): merge the
    adapter or leave ``lm_head`` out of ``target_modules`` to keep the fused loss.

    Returns:
        ``target``.
    """
    options = _check_options(options)
    if isinstance(target, str):
        _patch_class(_family_class(target), options)
    elif isinstance(target, type):
        _check_class(target)
        _patch_class(target, options)
    else:
        model = _unwrap(target)
        _check_instance(model)
        _patch_instance(model, options)
    return target


def unpatch(target):
    """Restore the original ``forward`` of ``target`` (instance, class, family name, or a PEFT
    model: the model it wraps), if patched.

    Unpatching an instance leaves its class alone and vice versa. Returns ``target``.
    """
    if isinstance(target, (str, type)):
        cls = _family_class(target) if isinstance(target, str) else target
        patched = _patch_of(cls.__dict__.get("forward"))
        if patched is not None and patched.owned:
            cls.forward = patched.original
        elif patched is not None:
            delattr(cls, "forward")
        return target
    model = _unwrap(target)
    _check_instance(model)
    if _patch_of(_instance_forward(model)) is not None:
        del model.__dict__["forward"]
    return target


def _cce_forward(self, patched: _Patch, args: tuple, kwargs: dict):
    """The patched ``forward`` (shared by every family): see the module docstring."""
    if len(args) > len(patched.positional):
        raise TypeError(f"forward() takes at most {len(patched.positional)} positional arguments, got {len(args)}")
    for name, value in zip(patched.positional, args):
        if name in kwargs:
            raise TypeError(f"forward() got multiple values for argument {name!r}")
        kwargs[name] = value
    labels = kwargs.get("labels")
    why = _why_original(self, patched, labels, kwargs.get("logits_to_keep", 0))
    if why is not None:
        if captured.active():  # a capture block would otherwise end empty without saying why
            captured.skipped(why)
        return patched.original(self, **kwargs)
    head = self.lm_head
    if not _plain_linear(head):  # e.g. a LoRA adapter on lm_head: only calling it gives its logits
        if not torch.compiler.is_compiling():  # (a warning would break a fullgraph trace; eager says it)
            _warn_head(self, head)
        if captured.active():
            captured.skipped(f"its lm_head is a {type(head).__name__}, not a plain torch.nn.Linear")
        return patched.original(self, **kwargs)

    # As can_return_tuple does for the original forward.
    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    del kwargs["labels"]
    kwargs.pop("logits_to_keep", None)
    # The original forward passes all its other arguments (and **kwargs) on to the decoder; asking
    # for a ModelOutput explicitly keeps config.return_dict=False from turning it into a tuple.
    outputs = self.model(**kwargs, return_dict=True)
    hidden = outputs.last_hidden_state

    shift_labels = kwargs.get("shift_labels")
    num_items_in_batch = kwargs.get("num_items_in_batch")
    # transformers pads labels with ignore_index and uses labels[..., 1:]; shift=1 drops the last
    # position instead, which contributes nothing either way.
    targets, shift = (labels, 1) if shift_labels is None else (shift_labels, 0)
    softcap = getattr(self.config, "final_logit_softcapping", None)

    def head_loss(h, weight, bias):
        return linear_cross_entropy(
            h,
            weight,
            targets.to(h.device),
            bias,
            shift=shift,
            ignore_index=kwargs.get("ignore_index", _IGNORE_INDEX),
            softcap=None if softcap is None else float(softcap),
            reduction="mean" if num_items_in_batch is None else "sum",
            **patched.options,
        )

    loss = _through_head(head, hidden, head_loss)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch

    carried = {name: getattr(outputs, name, None) for name in patched.carried}
    if not return_dict:
        # As the original's to_tuple(), which drops the None fields, but the logits keep their
        # place (None), so out[1] is where callers of the unpatched model find the logits.
        return (loss, None, *(value for value in carried.values() if value is not None))
    return patched.output_cls(loss=loss, logits=None, **carried)


def _through_head(head, hidden, head_loss):
    """``head_loss(hidden, weight, bias)`` with the head's parameters as its own forward sees them.
    A head that FSDP2 shards on its own (``fully_shard(model.lm_head)``) holds a sharded weight
    outside its forward, and FSDP gathers it, and reduces its gradient, only around a call of the
    module: such a head is called, with the loss as its forward. Any other head's weight is read (a
    plain tensor, or a DTensor that ``linear_cross_entropy`` takes as it is placed: a tensor-parallel
    ``lm_head``).

    A tensor-parallel plan's hooks on such a head (FSDP2 over TP) adapt its input and its output, the
    logits, to their DTensor layouts; the loss takes its arguments as they are placed and returns a
    plain loss, so those hooks are left out of the call (FSDP's run)."""
    if not _fsdp_managed(head):
        return head_loss(hidden, head.weight, getattr(head, "bias", None))
    head.forward = lambda h: head_loss(h, head.weight, getattr(head, "bias", None))
    hooks = (head._forward_pre_hooks, head._forward_hooks)
    saved = [dict(d) for d in hooks]
    for d in hooks:
        for key in [k for k, fn in d.items() if getattr(fn, "__module__", "").startswith("torch.distributed.tensor")]:
            del d[key]
    try:
        return head(hidden)
    finally:
        del head.forward
        for d, kept in zip(hooks, saved):
            d.clear()
            d.update(kept)


def _fsdp_managed(module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself (only where FSDP2 was imported)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return cls is not None and isinstance(module, cls)


def _plain_linear(head) -> bool:
    """Whether ``head(x)`` is ``x @ head.weight.T + head.bias``, what the fused loss computes from the
    weights instead: a ``torch.nn.Linear`` (or a subclass) that keeps ``Linear.forward``. PEFT's
    LoRA layer is no ``Linear``; a quantized subclass overrides ``forward``."""
    return isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward


def _warn_head(model, head) -> None:
    """Say once per head type why this model's loss is not fused."""
    kind = type(head)
    if kind in _warned_heads:
        return
    _warned_heads.add(kind)
    warnings.warn(
        f"cce_autotune: {type(model).__name__}.lm_head is a {kind.__module__}.{kind.__qualname__}, not a plain "
        "torch.nn.Linear (a LoRA adapter on lm_head?); the fused loss reads lm_head.weight and would skip what "
        "the layer adds, so the model's own forward computes the loss, with the full logit matrix. Merge the "
        "adapter (merge_and_unload) or leave lm_head out of target_modules to get the fused loss. "
        "(shown once per process)",
        stacklevel=4,
    )


def _why_original(model, patched: _Patch, labels, logits_to_keep) -> str | None:
    """Why the patched forward runs the original one (also what an empty capture block says), or
    None: the loss is fused."""
    if labels is None:
        return "it was called without labels"
    if not model.training:
        return "the model is in eval mode (from_pretrained leaves it there: call model.train())"
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        return f"it was called with logits_to_keep={logits_to_keep!r}"
    if model.loss_function is not patched.causal_lm_loss:  # a custom loss: keep the model's own
        return "the model has a custom loss_function"
    return None


def _make_forward(original: Callable, options: dict[str, Any], owned: bool) -> Callable:
    """A forward function (taking self) that runs :func:`_cce_forward` around ``original``.

    It carries ``original``'s name, docstring and signature (``transformers`` inspects
    ``forward``'s parameters: ``generate`` for ``logits_to_keep``, ``Trainer`` for ``**kwargs``).
    """
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast

    params = list(inspect.signature(original).parameters.values())[1:]  # after self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    patched = _Patch(
        original=original,
        positional=tuple(p.name for p in params if p.kind in kinds),
        options=dict(options),
        causal_lm_loss=ForCausalLMLoss,
        output_cls=CausalLMOutputWithPast,
        carried=tuple(f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name not in ("loss", "logits")),
        owned=owned,
    )

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        return _cce_forward(self, patched, args, kwargs)

    forward.__cce_patch__ = patched
    return forward


def _patch_of(forward) -> _Patch | None:
    """The :class:`_Patch` behind a forward this module made (function or bound method), else None."""
    return getattr(getattr(forward, "__func__", forward), "__cce_patch__", None)


def _unpatched(forward: Callable) -> Callable:
    patched = _patch_of(forward)
    return forward if patched is None else patched.original


def _patch_class(cls: type, options: dict[str, Any]) -> None:
    own = cls.__dict__.get("forward")
    owned = _patch_of(own).owned if _patch_of(own) is not None else own is not None
    cls.forward = _make_forward(_unpatched(cls.forward), options, owned)


def _patch_instance(model, options: dict[str, Any]) -> None:
    current = _instance_forward(model)
    if current is not None and _patch_of(current) is None:
        raise TypeError(
            f"target: this {type(model).__name__} instance already has its own forward (an accelerate hook?); "
            "patch its class or family before loading the model instead"
        )
    forward = _make_forward(_unpatched(type(model).forward), options, owned=False)
    model.forward = types.MethodType(forward, model)


def _instance_forward(model):
    return vars(model).get("forward")


def _unwrap(target):
    """The ``transformers`` model behind a PEFT model (``get_base_model()``), else ``target``."""
    if callable(getattr(type(target), "get_base_model", None)):  # (looked up on the class: no import of peft)
        return target.get_base_model()
    return target


def _family_class(name: str) -> type:
    if name not in FAMILIES:
        raise ValueError(f"target: unknown model family {name!r}; supported: {', '.join(FAMILIES)}")
    import transformers

    return getattr(transformers, FAMILIES[name])


def _check_class(cls: type) -> None:
    """Accept the classes of :data:`FAMILIES` and their subclasses (matched by name, so that
    checking needs no import of every family)."""
    supported = set(FAMILIES.values())
    if not any(c.__name__ in supported and c.__module__.startswith("transformers.models.") for c in cls.__mro__):
        raise TypeError(
            f"target: {cls.__module__}.{cls.__qualname__} is not a supported causal-LM class; "
            f"supported: {', '.join(FAMILIES.values())} and their subclasses"
        )


def _check_instance(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"target: expected a model instance, a model class or a family name, got {type(model).__name__}"
        )
    _check_class(type(model))


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    """Only keyword arguments of :func:`linear_cross_entropy` that the model does not determine."""
    params = inspect.signature(linear_cross_entropy).parameters
    allowed = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in _DERIVED_OPTIONS]
    for name in options:
        if name in _DERIVED_OPTIONS:
            raise TypeError(
                f"options: {name!r} is set by the patched forward from the model and the call, not by patch()"
            )
        if name not in allowed:
            raise TypeError(f"options: linear_cross_entropy has no option {name!r}; accepted: {', '.join(allowed)}")
    return dict(options)

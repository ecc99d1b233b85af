"""The loss as two PyTorch custom operators, so that ``torch.compile(fullgraph=True)`` sees one
opaque node each way: ``cce_autotune::lce_forward`` and ``cce_autotune::lce_backward``.

- Both take tensors and one string, the call's options (:class:`~cce_autotune.options.Options`,
  JSON): every decision that reads tensor values (target checks, the dispatcher, the planner, what is
  remembered of the classifier) happens inside the operators, where the tensors are real, so compiled
  graphs hold no guard on it.
- Fake implementations give the output shapes, for compile tracing and for meta tensors.
- The forward returns a third output, a 0-d int64 "handle" tensor. What the backward needs from its
  forward beyond tensors (the call's plan, the tile map, the fused strategy's gradients) rides on it as
  a Python attribute, so it lives exactly as long as autograd keeps the handle for the backward. A
  backward that finds no state (a second backward with ``retain_graph=True``) plans again without
  it: the state is a speed-up, never needed for correctness.

Each operator gathers what the call is (:mod:`.call`), where its kernel variants and the GPU's cost
model come from (the config database, :mod:`cce_autotune.configdb`), asks the planner
(:mod:`cce_autotune.planning.planner`) and runs the plan (:mod:`.execute`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..configdb import dispatch
from ..options import Options
from ..planning import planner
from ..variant import KernelVariants, VariantError
from . import execute
from .call import loss_dtype, pred_shape, prepare, raise_landed_checks

__all__ = ["lce_forward", "lce_backward", "start", "run_forward", "run_backward", "no_double_backward"]


def _variants(o: Options, e, c, bias, impl: str) -> tuple:
    """``(variants, dispatched)``: the caller's (checked), or the config database's for this GPU and
    shape (only on the kernels' path); an empty set on the PyTorch path."""
    if o.variants is not None:
        try:
            kv = KernelVariants.from_dict(o.variants)
            kv.validate(elem_bytes=e.element_size(), smem_limit=None)
        except (VariantError, TypeError) as exc:
            raise ValueError(f"variants: {str(exc).removeprefix('variants: ')}") from exc
        return kv, False
    if impl != "triton":
        return KernelVariants(), False
    return dispatch.select_variants(e, c, has_bias=bias is not None, has_softcap=o.softcap is not None), True


def _costs(device):
    """The GPU's cost model: its tuned-config file's ``cost_model`` section over the built-in one (the
    built-in one on the CPU)."""
    return dispatch.costs_for(dispatch.gpu_slug(device) if device.type == "cuda" else None)


def start(e, c, targets, bias, token_weights, o: Options) -> tuple:
    """``(call, plan)``: the call's tensors (:func:`.call.prepare`) and its first plan
    (:func:`~cce_autotune.planning.planner.plan_call`: PyTorch or the kernels, their variants, the
    filter, the classifier's conversion); ``plan`` is None on the PyTorch path."""
    raise_landed_checks()  # (an earlier GPU call's range check, landed without a sync)
    impl = planner.choose_impl(o, e.device)
    variants, dispatched = _variants(o, e, c, bias, impl)
    call = prepare(e, c, targets, bias, token_weights, o, impl)
    if impl == "torch":
        return call, None
    # While a CUDA graph is captured nothing is read back to the host: the call is planned so.
    capturing = e.is_cuda and torch.cuda.is_current_stream_capturing()
    plan = planner.plan_call(o, impl, variants, dispatched, call.problem(e, c, bias), _costs(e.device),
                             measurable=not capturing)
    return call, plan


def _forward(e, c, bias, targets, token_weights, o: Options, needs_grad: bool):
    call, plan = start(e, c, targets, bias, token_weights, o)
    if plan is None:
        return execute.forward_reference(call, e, c, bias)
    plan = planner.plan_forward(plan, call.problem(e, c, bias), c, plan.costs, needs_grad=needs_grad,
                                fused_allowed=planner.fused_allowed(o, plan, c.dtype != e.dtype),
                                max_extra_memory=o.max_extra_memory)
    return execute.forward(plan, call, e, c, bias)


def _backward(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse_out, state, o: Options, shards=None):
    if state is not None and state.fused is not None:
        return execute.scale_fused(state, grad_loss, e)
    if state is not None:
        # The forward's call: the same inputs (saved for the backward: an in-place change of one is
        # refused by autograd), so the same rows, targets and weights; and its plan (what the forward
        # found: the order it walked, its map).
        raise_landed_checks()
        call, plan = state.call, state.plan
    else:
        call, plan = start(e, c, targets, bias, token_weights, o)
    if call.n_rows == 0:
        return torch.zeros_like(e), torch.zeros_like(c), torch.zeros_like(bias) if bias is not None else None
    coef_s, coef_t, coef_u, lse_v = call.coefficients(grad_loss, grad_lse, lse_out)
    if plan is None:
        return execute.backward_reference(call, e, c, bias, lse_v, coef_s, coef_t, coef_u)
    tmap = state.tile_map if state is not None else None
    # (enqueued before the planner's read-back: see execute.MapTargets)
    execute.sort_vocabulary(plan, call, e, c, bias)
    at_map = execute.map_targets(plan, call, tmap)
    ev = planner.Evidence(e=e, c=c, bias=bias, rows=call.rows, targets=call.targets, lse=lse_v, softcap=call.softcap,
                          tile_map=tmap, coef_s=coef_s, coef_t=coef_t, shards=shards)
    plan = planner.plan_gradients(plan, call.problem(e, c, bias, tmap), plan.costs, ev,
                                  fused_allowed=planner.fused_allowed(o, plan, c.dtype != e.dtype),
                                  max_extra_memory=o.max_extra_memory)
    return execute.backward(plan, call, e, c, bias, lse_v, coef_s, coef_t, coef_u, tmap,
                            csum=state.csum if state is not None else None, at_map=at_map,
                            classifier=state.classifier if state is not None else None)


def run_forward(e, c, bias, targets, token_weights, o: Options, needs_grad: bool) -> tuple:
    """``(loss, lse, state)``: the forward of one call, as :func:`lce_forward` runs it, with the state
    its backward takes (None without ``needs_grad``); for an operator that runs the loss on part of a
    call (the vocabulary-parallel loss's shard)."""
    with _NoAutocast(e.device):
        return _forward(e, c, bias, targets, token_weights, o, needs_grad)


def run_backward(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse, state, o: Options, shards=None):
    """``(dE, dC, dbias or None)``: the backward of one call, as :func:`lce_backward` runs it, from
    :func:`run_forward`'s ``state``; ``shards``: the call is one vocabulary shard of a larger call
    (:class:`~cce_autotune.planning.planner.Evidence`'s ``shards``), whose filter the shards choose
    together."""
    with _NoAutocast(e.device):
        return _backward(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse, state, o, shards)


# ----------------------------------------------------------------------------------------------
# The operators


class _NoAutocast:
    """Autocast off inside the operators: the kernels and the PyTorch path choose their own
    precision (the loss's inputs were already cast by the caller where autocast says so)."""

    def __init__(self, device: torch.device):
        # (only where autocast is on: entering and leaving it costs host time, about 50 us a call)
        self.ctx = torch.autocast(device_type=device.type, enabled=False) \
            if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type) else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


# Not for CUDA-graph trees (torch.compile's "reduce-overhead"): a replay runs none of an operator's
# host work (the planner, what rides on the handle), so Inductor keeps the operators out of its graphs.
_TAGS = (torch._C.Tag.cudagraph_unsafe,) if hasattr(torch._C.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("cce_autotune::lce_forward", mutates_args=(), tags=_TAGS)
def lce_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                token_weights: Optional[torch.Tensor], options: str, needs_grad: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, per-position LSE (n,) with 0 at ignored positions, handle); loss and LSE in fp32 (float64
    for float64 ``e``: :func:`~cce_autotune.runtime.call.loss_dtype`)."""
    loss, lse, state = run_forward(e, c, bias, targets, token_weights, Options.decode(options), needs_grad)
    handle = torch.zeros((), dtype=torch.int64)
    if needs_grad:
        handle._cce_state = state
    return loss, lse, handle


@lce_forward.register_fake
def _lce_forward_fake(e, c, bias, targets, token_weights, options, needs_grad):
    o = Options.decode(options)
    shape = pred_shape(e.shape[:-1], o.shift)
    n = math.prod(shape)
    dt = loss_dtype(e.dtype)
    loss = e.new_empty(shape if o.reduction == "none" else (), dtype=dt)
    return loss, e.new_empty((n,), dtype=dt), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("cce_autotune::lce_backward", mutates_args=(), tags=_TAGS)
def lce_backward(grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], e: torch.Tensor,
                 c: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                 token_weights: Optional[torch.Tensor], lse: torch.Tensor, handle: torch.Tensor, options: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, dbias); dbias is an empty tensor when there is no bias."""
    o = Options.decode(options)
    state = getattr(handle, "_cce_state", None)
    if state is not None:
        del handle._cce_state  # used once; a second backward recomputes what it needs
    de, dc, dbias = run_backward(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse, state, o)
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


def no_double_backward(ctx, *grads):
    raise RuntimeError(
        "linear_cross_entropy: second derivatives are not supported (a backward through the gradients, "
        "e.g. torch.autograd.grad(..., create_graph=True) then another backward): the saved log-sum-exp "
        "is not differentiated again; compute such terms with a materialised-logits loss")


lce_backward.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)

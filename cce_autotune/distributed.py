"""The loss over tensors that ``torch.distributed`` places: DTensor arguments of ``linear_cross_entropy``.

- The classifier (and its bias) ``Replicate()``: the local tensors make the ordinary call (``to_local``
  keeps the gradient's placement).
- The classifier ``Shard(0)`` on a 1-D mesh: the **vocabulary-parallel** loss, for tensor parallelism
  (every rank of the mesh holds the same rows of e and the same targets: the layout of torchtitan's
  ``loss_parallel``, a column-wise sharded ``lm_head``). Each rank runs the ordinary call on its
  vocabulary shard (reduction "none", its LSE returned); the per-row LSE and target logit of every
  rank (and, with label smoothing, the row's sum of logits) meet in one ``all_gather`` of 2 (3) floats
  per row; each rank's backward then runs on its shard with the global LSE (the ordinary backward
  operator, which takes the LSE it is given); dE is summed over the mesh with one ``all_reduce``, dC
  and dbias stay on their shard (a DTensor with the classifier's placement). Shards follow
  ``torch.chunk``'s layout, as ``distribute_tensor`` makes them. Each shard's forward records its
  tile map and its backward filters as one process does, except that the shards choose the filter
  together: the accuracy check sums each sampled row's dE and dropped terms over the shards, so the
  error it holds to the limit is the whole vocabulary's (the planner's ``shards``; a shard that cannot
  filter, or pauses, makes every shard run exact). Forward and backward are two custom
  operators (values are read only inside them), so a call compiles with ``fullgraph=True``.
- e a DTensor: ``Replicate()`` is taken as is; rows sharded on a 1-D mesh (``Shard(0)``, sequence or
  batch parallel) are gathered first (``redistribute``). On the classifier's mesh, their dE goes back as
  each rank's part (``Partial()``): DTensor's reduce_scatter sums it, and the loss makes no all_reduce.
  targets and token weights may be DTensors placed the same way.
- Anything else: a ``ValueError`` naming the argument and its placement.

The returned loss is a plain tensor, the same on every rank of the mesh. The ranks check, in the same
gather and one host copy, that they hold the same rows (checksums of the targets and of e) and that no
target is out of range: an lm_head that FSDP2 shards on its own is data parallel, not this layout, and
would otherwise give silently wrong gradients (call the head, as the Hugging Face patch does, or pass
``weight.full_tensor()``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Optional

import torch

from .options import Options
from .runtime import ops
from .runtime.call import Call, loss_dtype, pred_shape, prepare
from .runtime.execute import add_uniform_term, reduce_loss

__all__ = ["has_dtensor", "linear_cross_entropy"]


def _dtensor_type():
    mod = sys.modules.get("torch.distributed.tensor")  # (a DTensor exists only where this is imported)
    return getattr(mod, "DTensor", None) if mod is not None else None


def has_dtensor(*tensors) -> bool:
    """Whether any of ``tensors`` is a DTensor (plain tensors answer at their type, before any lookup)."""
    for t in tensors:
        if t is not None and type(t) is not torch.Tensor:
            cls = _dtensor_type()
            if cls is not None and isinstance(t, cls):
                return True
    return False


def _describe(t) -> str:
    return f"{tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh"


def _replicated(t) -> bool:
    from torch.distributed.tensor import Replicate  # (lazy: only where DTensors are used)

    return all(isinstance(p, Replicate) for p in t.placements)


def _sharded_rows(t) -> bool:
    """Whether DTensor ``t`` is sharded over its first dimension on a 1-D mesh."""
    from torch.distributed.tensor import Shard  # (lazy: only where DTensors are used)

    return t.device_mesh.ndim == 1 and isinstance(t.placements[0], Shard) and t.placements[0].dim == 0


def _full(name: str, t, differentiable: bool, partial_grad: bool = False):
    """A DTensor argument as a local tensor holding all of it: replicated, or rows sharded on a 1-D
    mesh (gathered); a plain tensor as is. ``partial_grad``: the local tensor's gradient is each
    rank's part of a sum (``Partial()``, for a tensor on a 1-D mesh), which DTensor sums as the
    argument is placed (sharded rows: a reduce_scatter)."""
    if not has_dtensor(t):
        return t
    from torch.distributed.tensor import Partial, Replicate  # (lazy: only where DTensors are used)

    grad = [Partial()] if partial_grad else None
    if _replicated(t):
        return t.to_local(grad_placements=grad)
    if _sharded_rows(t):
        full = t.redistribute(t.device_mesh, [Replicate()])
        return full.to_local(grad_placements=grad) if differentiable else full.to_local().detach()
    raise ValueError(f"{name}: a DTensor placed {_describe(t)}; linear_cross_entropy takes it replicated or with its "
                     "rows sharded (Shard(0)) on a 1-D mesh")


def linear_cross_entropy(plain, e, c, targets, bias, token_weights, options: dict, encoded: str, needs_grad: bool):
    """``linear_cross_entropy`` with DTensor arguments (see the module docstring), whose kinds, shapes
    and dtypes it has checked on the whole tensors and whose e it has cast under autocast; ``plain`` is
    the ordinary function, called on local tensors; ``encoded``: the checked options, encoded;
    ``needs_grad``: whether the call takes part in autograd (its token weights detached)."""
    targets = _full("targets", targets, differentiable=False)
    token_weights = _full("token_weights", token_weights, differentiable=False)
    if not has_dtensor(c):
        if has_dtensor(bias):
            raise ValueError(f"bias: a DTensor ({_describe(bias)}) with a classifier that is not one")
        return plain(_full("e", e, differentiable=True), c, targets, bias, token_weights=token_weights, **options)
    if bias is not None and not (has_dtensor(bias) and bias.device_mesh == c.device_mesh
                                 and tuple(bias.placements) == tuple(c.placements)):
        raise ValueError(f"bias: must be a DTensor placed as the classifier ({_describe(c)}), got "
                         + (_describe(bias) if has_dtensor(bias) else "a plain tensor"))
    if _replicated(c):
        return plain(_full("e", e, differentiable=True), c.to_local(), targets,
                     bias.to_local() if bias is not None else None, token_weights=token_weights, **options)
    if not _sharded_rows(c):
        raise ValueError(f"c: a DTensor placed {_describe(c)}; linear_cross_entropy takes a classifier sharded over "
                         "the vocabulary (Shard(0)) on a 1-D mesh, or replicated")
    # dE of the shard is its columns' part of a sum over the mesh: summed by the backward's all_reduce,
    # or, where e's rows are sharded over the same mesh (sequence parallel), by DTensor as it hands each
    # rank its rows' gradient: a reduce_scatter, half an all_reduce's traffic.
    rows_sharded = has_dtensor(e) and e.device_mesh == c.device_mesh and _sharded_rows(e)
    e = _full("e", e, differentiable=True, partial_grad=rows_sharded)
    return _vocab_parallel(e, c, targets, bias, token_weights, options, encoded, needs_grad,
                           reduce_de=not rows_sharded)


def _vocab_parallel(e, c, targets, bias, token_weights, options: dict, encoded: str, needs_grad: bool,
                    reduce_de: bool):
    """The loss of a ``Shard(0)`` classifier (its shapes read here, traceable; the rest in the
    operators)."""
    mesh = c.device_mesh
    W, r = mesh.size(), mesh.get_local_rank()
    V = c.shape[0]
    c_l = c.to_local()
    b_l = bias.to_local() if bias is not None else None
    chunk = -(-V // W)
    lo = min(r * chunk, V)
    if c_l.shape[0] != min(V, lo + chunk) - lo:
        raise ValueError(f"c: rank {r} holds {c_l.shape[0]} of the {V} rows; a Shard(0) classifier must be laid out "
                         f"as torch.chunk lays it out ({chunk} rows a rank), as distribute_tensor does")
    if c_l.shape[0] == 0:
        raise ValueError(f"c: rank {r} of {W} holds no rows of the {V}-row classifier; shard it over fewer ranks")
    loss, lse, _ = torch.ops.cce_autotune.vocab_parallel_forward(e, c_l, b_l, targets, token_weights, encoded, V, lo,
                                                                 mesh.get_group().group_name, reduce_de, needs_grad)
    if options.get("return_lse", False):
        return loss, lse.view(pred_shape(e.shape[:-1], options.get("shift", 0)))
    return loss


def _row_checks(call: Call, rows) -> torch.Tensor:
    """(5,) fp32: whether a target is out of range and the first such, two checksums of the targets
    (exact in fp32: modulo 2^20) and the sum of the rows of e."""
    t, bad = call.raw_targets.long(), call.out_of_range
    pos = torch.arange(1, t.numel() + 1, device=t.device)
    first = t[bad.int().argmax()] if t.numel() else t.new_zeros(())
    return torch.stack([bad.any().float(), first.float(), (t.sum() % 2**20).float(), ((t * pos).sum() % 2**20).float(),
                        rows.sum(dtype=torch.float32)]).to(torch.float32)


def _raise_on_checks(checks: list, V: int, ignore_index: int) -> None:
    """The ValueError of :func:`_row_checks`' findings, gathered from every rank (the same on each)."""
    targets = {tuple(c[2:4]) for c in checks}
    sums = [c[4] for c in checks]
    if len(targets) > 1 or max(sums) - min(sums) > 1e-3 * max(1.0, max(abs(x) for x in sums)):
        raise ValueError(
            "e, targets: the ranks of the classifier's mesh hold different rows; a Shard(0) classifier is taken as "
            "tensor parallel, every rank with the same rows and targets. An lm_head that FSDP2 shards on its own "
            "holds that layout only inside its forward: call the head (cce_autotune's Hugging Face patch does), or "
            "pass weight.full_tensor()")
    for found, value, *_ in checks:
        if found:
            raise ValueError(f"targets: value {int(value)} is outside [0, {V}) and is not ignore_index={ignore_index}")


def _local_options(o: Options) -> Options:
    """The shard's call: per-row losses and the LSE, no smoothing or z-loss (added on the global LSE)."""
    return replace(o, reduction="none", return_lse=True, label_smoothing=0.0, z_loss=0.0)


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group  # (the name -> group map)

    return _resolve_process_group(name)


class _Shards:
    """The vocabulary shards of one call, as the planner takes them
    (:class:`~cce_autotune.planning.planner.Evidence`'s ``shards``): sums and minima over the
    process group, on ``device``."""

    def __init__(self, group, device):
        self.group, self.device = group, device

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist  # (lazy: only where DTensors are used)

        dist.all_reduce(t, group=self.group)
        return t

    def min_(self, values: list) -> list:
        import torch.distributed as dist  # (lazy: only where DTensors are used)

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t.tolist()  # (a host copy: the planner decides on the host)


class _Shard:
    """The call as one rank sees it: ``call`` (over the whole vocabulary's V), the targets in the
    shard's numbering (``t_op``: an off-shard target is its entry 0, with no onehot term there) and
    which rows' targets the shard holds (``in_shard``)."""

    def __init__(self, e, c_l, b_l, targets, token_weights, options: str, V: int, lo: int):
        o = Options.decode(options)
        if o.label_smoothing and o.softcap is not None:
            raise ValueError("label_smoothing: with a softcap, the smoothing term needs every capped logit; a "
                             "vocabulary-sharded classifier supports one or the other")
        # (the kernels' layout of the rows, which the label-smoothing term reads them through)
        self.call = call = prepare(e, c_l, targets, b_l, token_weights, o, "triton", V=V)
        T = e.shape[-2]
        local = call.targets - lo
        self.in_shard = call.valid & ~call.out_of_range & (local >= 0) & (local < c_l.shape[0])
        self.t_op = targets.clone()
        self.t_op.narrow(-1, o.shift, T - o.shift).copy_(
            torch.where(call.valid, torch.where(self.in_shard, local, 0), o.ignore_index).view(call.pred_shape))
        self.local_options = _local_options(o)
        self.rows = e.narrow(-2, 0, T - o.shift)


# The vocabulary-parallel loss as two custom operators, as the one-process loss is
# (:mod:`cce_autotune.runtime.ops`): everything that reads tensor values (the targets' layout, the
# gathered check, the planner) runs inside them, so that ``torch.compile(fullgraph=True)`` traces the
# DTensor arguments around one opaque node each way; the process group travels by its name.


@torch.library.custom_op("cce_autotune::vocab_parallel_forward", mutates_args=())
def vocab_parallel_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                           token_weights: Optional[torch.Tensor], options: str, V: int, lo: int, group: str,
                           reduce_de: bool, needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, per-position global LSE, 0 at ignored positions, handle) of the classifier's shard ``c``
    (and ``bias``), whose vocabulary entries start at ``lo`` of ``V``, over the process group named
    ``group``; ``reduce_de``: the backward sums dE over the group (else each rank returns its part).
    The handle carries the shard's forward state to the backward (its tile map), as
    ``lce_forward``'s does."""
    import torch.distributed as dist  # (lazy: only where DTensors are used)

    sh = _Shard(e, c, bias, targets, token_weights, options, V, lo)
    call, o = sh.call, sh.call.options
    D = e.shape[-1]
    loss_l, lse_l, state = ops.run_forward(e, c, bias, sh.t_op, None, sh.local_options, needs_grad)
    parts = [lse_l, torch.where(sh.in_shard, lse_l - loss_l.reshape(-1), 0.0)]
    if o.label_smoothing:  # Σ_v z_v of each row over the shard: e_i · Σ_v c_v + Σ_v b_v
        zsum = sh.rows.reshape(-1, D).to(call.dtype) @ c.sum(0, dtype=call.dtype)
        if bias is not None:
            zsum = zsum + bias.sum(dtype=call.dtype)
        parts.append(zsum)
    # With the rows' parts go what every rank checks at once, in the same gather: a target out of
    # range, and whether the ranks hold the same rows (the layout this loss is for).
    checks = _row_checks(call, sh.rows)
    local_parts = torch.cat([torch.stack(parts).reshape(-1), checks])
    pg = _group(group)
    W = dist.get_world_size(pg)
    everyone = local_parts.new_empty(W * local_parts.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (its name since 2.13)
    gather(everyone, local_parts, group=pg)
    everyone = everyone.view(W, -1)
    _raise_on_checks(everyone[:, -checks.numel():].tolist(), V, o.ignore_index)  # (one host copy)
    everyone = everyone[:, :-checks.numel()].reshape(W, len(parts), -1)
    zsum = everyone[:, 2].sum(0) if o.label_smoothing else None
    loss, lse = reduce_loss(call, torch.logsumexp(everyone[:, 0], dim=0), everyone[:, 1].sum(0), zsum)
    handle = torch.zeros((), dtype=torch.int64)
    if needs_grad:
        handle._cce_state = state
    return loss, lse, handle


@vocab_parallel_forward.register_fake
def _vocab_parallel_forward_fake(e, c, bias, targets, token_weights, options, V, lo, group, reduce_de, needs_grad):
    o = Options.decode(options)
    shape = pred_shape(e.shape[:-1], o.shift)
    dt = loss_dtype(e.dtype)
    loss = e.new_empty(shape if o.reduction == "none" else (), dtype=dt)
    return (loss, e.new_empty((math.prod(shape),), dtype=dt),
            torch.empty((), dtype=torch.int64, device="cpu"))


@torch.library.custom_op("cce_autotune::vocab_parallel_backward", mutates_args=())
def vocab_parallel_backward(grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], e: torch.Tensor,
                            c: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                            token_weights: Optional[torch.Tensor], lse: torch.Tensor, handle: torch.Tensor,
                            options: str, V: int, lo: int, group: str, reduce_de: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE summed over the group, or this rank's part of it without ``reduce_de``, the shard's dC, its
    dbias or an empty tensor) of :func:`vocab_parallel_forward`'s loss; ``lse``: its global LSE;
    ``handle``: its handle. The shards choose their filter together (the planner's ``shards``)."""
    import torch.distributed as dist  # (lazy: only where DTensors are used)

    sh = _Shard(e, c, bias, targets, token_weights, options, V, lo)
    call = sh.call
    coef_s, coef_t, coef_u, _ = call.coefficients(grad_loss, grad_lse, lse)
    coef_t = torch.where(sh.in_shard, coef_t, 0.0)  # (a target's onehot term on the shard that holds it)
    state = getattr(handle, "_cce_state", None)
    if state is not None:
        del handle._cce_state  # used once; a second backward plans without it
    pg = _group(group)
    de, dc, db = ops.run_backward(coef_t, coef_s - coef_t, e, c, bias, sh.t_op, None, lse, state,
                                  sh.local_options, shards=_Shards(pg, e.device))
    if coef_u is not None:  # the smoothing term, with the shard's column sum (dE's sums over the shards)
        de, dc, db = add_uniform_term(e, call, coef_u, c.sum(0, dtype=call.dtype), de, dc, db)
    if reduce_de:
        dist.all_reduce(de, group=pg)
    return de, dc, db if db is not None else e.new_empty((0,))


@vocab_parallel_backward.register_fake
def _vocab_parallel_backward_fake(grad_loss, grad_lse, e, c, bias, targets, token_weights, lse, handle, options, V, lo,
                                  group, reduce_de):
    return torch.empty_like(e), torch.empty_like(c), torch.empty_like(bias) if bias is not None else e.new_empty((0,))


def _setup_context(ctx, inputs, output):
    e, c, bias, targets, token_weights, options, V, lo, group, reduce_de, needs_grad = inputs
    ctx.args = (options, V, lo, group, reduce_de)
    ctx.has_bias, ctx.has_weights = bias is not None, token_weights is not None
    _, lse, handle = output
    ctx.save_for_backward(e, c, bias if bias is not None else lse, targets,
                          token_weights if token_weights is not None else lse, lse, handle)


def _autograd_backward(ctx, grad_loss, grad_lse, grad_handle):
    e, c, bias, targets, token_weights, lse, handle = ctx.saved_tensors
    de, dc, db = vocab_parallel_backward(grad_loss, grad_lse, e, c, bias if ctx.has_bias else None, targets,
                                         token_weights if ctx.has_weights else None, lse, handle, *ctx.args)
    return de, dc, db if ctx.has_bias else None, None, None, None, None, None, None, None, None


vocab_parallel_forward.register_autograd(_autograd_backward, setup_context=_setup_context)
vocab_parallel_backward.register_autograd(ops.no_double_backward, setup_context=lambda ctx, inputs, output: None)

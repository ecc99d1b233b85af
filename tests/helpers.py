"""Oracles and tolerances shared by the tests."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

NO_CHUNK_HOST = dict(chunk_ms=0.0, tile_chunk_ms=0.0, gather_chunk_ms=0.0)
"""The cost model's host time per chunk of the chunked loop (each way of forming its products, and the
gather of a sorted order) set to nothing: at the tests' tiny sizes it, not the device's work, would
decide the plan."""


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    denom = ref.norm()
    if denom == 0:
        return float((x - ref).norm())
    return float((x - ref).norm() / denom)


def materialised_logits(e, c, bias=None, softcap=None, compute_dtype=None):
    """softcap(e @ c.T + bias) with the matmul in ``compute_dtype`` (default e's), returned in
    fp32 (fp64 for an fp64 compute dtype)."""
    dt = compute_dtype or e.dtype
    z = e.to(dt) @ c.to(dt).T
    if bias is not None:
        z = z + bias.to(dt)
    z = z.to(torch.float64 if dt == torch.float64 else torch.float32)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def torch_loss(e, c, targets, bias=None, *, softcap=None, reduction="mean", shift=0, ignore_index=-100,
               compute_dtype=None, return_lse=False):
    """Plain PyTorch: materialise the logits (in ``compute_dtype``, default the inputs'), then
    F.cross_entropy in fp32/fp64. Used as the float64 oracle and as 'PyTorch in the same dtype'."""
    T = e.shape[-2]
    z = materialised_logits(e, c, bias, softcap, compute_dtype).narrow(-2, 0, T - shift)
    t = targets.narrow(-1, shift, T - shift)
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), t.reshape(-1), ignore_index=ignore_index, reduction=reduction)
    if reduction == "none":
        loss = loss.view(t.shape)
    if return_lse:
        lse = torch.logsumexp(z, dim=-1) * (t != ignore_index)
        return loss, lse
    return loss


def grads_of(fn, *tensors):
    """Run fn on detached, grad-requiring copies of tensors; returns (output, grads)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None and t.dtype.is_floating_point else t for t in tensors]
    out = fn(*leaves)
    loss = out if not isinstance(out, tuple) else out[0]
    if loss.dim() > 0:
        g = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype, device=loss.device).view(loss.shape)
        (loss * g).sum().backward()
    else:
        loss.backward()
    return out, [t.grad if t is not None and t.dtype.is_floating_point else None for t in leaves]


def make_inputs(batch, V, D, dtype, *, bias=False, seed=0, peaked=0.0, device="cpu"):
    """Random inputs; ``peaked`` > 0 pulls each embedding towards its target's row (peaked softmax)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(*batch, D, generator=g) / D**0.25
    c = torch.randn(V, D, generator=g) / D**0.25
    t = torch.randint(0, V, batch, generator=g)
    if peaked:
        e = e + peaked * c[t]
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    cast = lambda x: x.to(device=device, dtype=dtype) if x is not None else None
    return cast(e), cast(c), t.to(device), cast(b)


@contextlib.contextmanager
def unwritten_is_nan():
    """Within: ``torch.empty`` hands out floating buffers filled with NaN, so that any element a
    kernel or product leaves unwritten shows up in the result."""
    empty = torch.empty

    def poisoned(*a, **k):
        x = empty(*a, **k)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty

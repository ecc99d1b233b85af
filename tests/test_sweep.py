"""Random configurations of the kernels' path against the float64 PyTorch path, four calls each (the
classifier changed in place between them, as an optimizer step does, and the targets on the last):
loss, LSE and gradients. Each configuration draws every option at once (dtype, batch shape, odd V and
D, shift, bias, softcap, reduction, label smoothing, z-loss, token weights, ignored positions, an fp32
classifier, a forced strategy, filtering, a memory budget, determinism, peaked rows, a tile map, tile
sizes, strided e, int32 targets, another ignore_index, the returned LSE, gradients of e or C alone):
a sweep of this kind found a NaN dE (the fused strategy's padding), a float32 loss for float64 inputs
and a wrong loss under the interpreter's truncating cast, which the hand-written cases had not. The
seeds are fixed: the same configurations every run."""

import random

import pytest
import torch

from cce_autotune import linear_cross_entropy
from cce_autotune.variant import BackwardVariant, IndexedDotVariant, KernelVariants, LSEForwardVariant
from test_loss_terms import terms_loss

TOL = {torch.float32: 1e-2, torch.bfloat16: 3e-2, torch.float16: 2e-2}


def _err(x, ref) -> float:
    """Relative error of x against ref (norms), absolute below a norm of 1e-2 per element's root."""
    if x is None and ref is None:
        return 0.0
    x, ref = x.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return float((x - ref).norm() / max(float(ref.norm()), 1e-2 * max(1, ref.numel()) ** 0.5))


def _configuration(seed: int):
    r = random.Random(seed)
    dtype = r.choice([torch.float32, torch.bfloat16, torch.bfloat16, torch.float16])
    batch = r.choice([(r.choice([7, 40, 97, 130]),), (r.choice([1, 2, 3]), r.choice([5, 16, 33])), (2, 2, 9)])
    V, D = r.choice([7, 9, 33, 64, 257, 301]), r.choice([8, 24, 45, 64])
    o = dict(shift=r.choice([0, 0, 1, 2]) if batch[-1] > 2 else 0, softcap=r.choice([None, None, 5.0, 30.0]),
             reduction=r.choice(["mean", "mean", "sum", "none"]), label_smoothing=r.choice([0.0, 0.0, 0.1]),
             z_loss=r.choice([0.0, 0.0, 1e-2]), ignore_index=r.choice([-100, -100, -1]),
             return_lse=r.random() < 0.25)
    run = dict(filter_eps=r.choice([None, "auto"]), max_extra_memory=r.choice(["auto", None, 20000, 60000, 200000]))
    strategy = r.choice([None, "chunked", "sparse", "fused"])
    bb, bv = r.choice([16, 32]), r.choice([16, 32, 64])
    run["variants"] = KernelVariants(
        indexed_dot=IndexedDotVariant(block_b=16, block_d=16),
        lse_forward=LSEForwardVariant(block_b=bb, block_v=bv, block_d=16, num_splits=r.choice([1, 3]), group_b=2),
        backward=BackwardVariant(block_b=bb, block_v=bv, block_d=16, group_b=2, tile_map=r.random() < 0.5,
                                 chunk_v=r.choice([64, 128, 1024]), **({"strategy": strategy} if strategy else {})))
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(*batch, D, generator=g) / D**0.25
    c = torch.randn(V, D, generator=g) / D**0.25
    t = torch.randint(0, V, batch, generator=g)
    e = e + r.choice([0.0, 2.0, 4.0]) * c[t] / D**0.25  # (peaked rows)
    t = torch.where(torch.rand(batch, generator=g) < r.choice([0.0, 0.2, 1.0 if r.random() < 0.1 else 0.3]),
                    o["ignore_index"], t)
    t = t.to(torch.int32) if r.random() < 0.2 else t
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if r.random() < 0.3 else None
    w = torch.rand(batch, generator=g) * 2 if r.random() < 0.3 else None
    c = c.to(torch.float32 if dtype != torch.float32 and r.random() < 0.3 else dtype)
    e = e.to(dtype)
    if r.random() < 0.3:  # e a strided view: every other element of a wider tensor
        e = torch.stack([e, torch.zeros_like(e)], -1).flatten(-2)[..., ::2]
    grads = r.choice(["both", "both", "e", "c"])
    return dict(e=e, c=c, t=t, b=b, w=w, o=o, run=run, grads=grads, deterministic=r.random() < 0.2,
                drift=r.choice([0.0, 0.01, 1.0]), new_targets=r.random() < 0.3)


@pytest.mark.parametrize("seed", range(24))
def test_random_configurations_match_the_float64_path(seed, device):
    cfg = _configuration(seed)
    o, run = cfg["o"], cfg["run"]
    e, b, w = cfg["e"].to(device), cfg["b"], cfg["w"]
    b = b.to(device) if b is not None else None
    c = cfg["c"].to(device).clone()  # (one storage, changed in place between calls)
    V = c.shape[0]
    tol = TOL[e.dtype] * (3 if run["filter_eps"] else 1)
    for call in range(4):
        if call >= 2 and cfg["drift"]:
            with torch.no_grad():
                noise = torch.randn(c.shape, generator=torch.Generator().manual_seed(seed + call))
                c.add_(noise.to(device=device, dtype=c.dtype), alpha=cfg["drift"])
        t = cfg["t"]
        if call == 3 and cfg["new_targets"]:
            t = torch.where(t == o["ignore_index"], t, (t + 1) % V)
        t = t.to(device)
        kw = dict(o, token_weights=w.to(device) if w is not None else None)
        # The float64 oracle: the PyTorch path on the inputs as the kernels see them (an fp32
        # classifier with 16-bit e: its logits are those of C rounded to e's dtype).
        ref_in = [x.detach().double().requires_grad_() if x is not None else None
                  for x in (e, c.to(e.dtype) if c.dtype != e.dtype else c, b)]
        ref = linear_cross_entropy(ref_in[0], ref_in[1], t, ref_in[2], impl="torch", **kw)
        ref, ref_lse = ref if o["return_lse"] else (ref, None)
        if call == 0:
            mat = terms_loss(*ref_in[:2], t.long(), ref_in[2], token_weights=kw["token_weights"],
                             **{k: v for k, v in o.items() if k != "return_lse"})
            assert _err(ref.nan_to_num(), mat.nan_to_num()) < 1e-9  # (NaN: every position ignored, as torch)
        up = torch.linspace(0.5, 1.5, ref.numel(), dtype=torch.float64, device=device).view(ref.shape)
        up_lse = torch.linspace(-1, 1, ref_lse.numel(), dtype=torch.float64, device=device).view(ref_lse.shape) \
            if ref_lse is not None else None

        def total(loss, lse):
            s = (loss * up.to(loss.dtype)).sum()
            return s + (lse * up_lse.to(lse.dtype)).sum() if lse is not None else s

        total(ref, ref_lse).backward()
        xs = [e.detach().clone(), c, b.detach().clone() if b is not None else None]
        for j, x in enumerate(xs):
            if x is not None:
                x.grad = None
                x.requires_grad_(cfg["grads"] == "both" or (cfg["grads"] == "e") == (j == 0) or j == 2)
        torch.use_deterministic_algorithms(cfg["deterministic"])  # (the kernels' call only: not the oracle's)
        try:
            out = linear_cross_entropy(xs[0], xs[1], t, xs[2], impl="triton", **run, **kw)
            out, lse = out if o["return_lse"] else (out, None)
            total(out, lse).backward()
        finally:
            torch.use_deterministic_algorithms(False)
        c.requires_grad_(False)
        errors = {"loss": _err(out.nan_to_num(), ref.nan_to_num()), "lse": _err(lse, ref_lse)}
        for name, x, r in zip(("dE", "dC", "dbias"), xs, ref_in):
            if x is not None and x.requires_grad:
                assert x.grad.dtype == x.dtype and torch.isfinite(x.grad).all(), (name, call)
                errors[name] = _err(x.grad, r.grad)
        assert max(errors.values()) < tol, (call, errors, {k: v for k, v in cfg.items() if k not in "ectbw"})

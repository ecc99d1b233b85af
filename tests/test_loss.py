"""linear_cross_entropy against a float64 PyTorch oracle: values, LSE and gradients.

Kernels run through Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by conftest.py) or on
the GPU when there is one. Tolerance: no worse than plain PyTorch in the same dtype, times 2, plus a
small floor; filtered mode additionally within the bound that filter_eps implies.
"""

import math

import pytest
import torch

from cce_autotune import (
    BackwardVariant,
    IndexedDotVariant,
    KernelVariants,
    LinearCrossEntropy,
    LSEForwardVariant,
    linear_cross_entropy,
)
from cce_autotune.options import Options
from helpers import grads_of, make_inputs, rel_err, torch_loss

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 5e-4}

SMALL = KernelVariants(
    indexed_dot=IndexedDotVariant(block_b=16, block_d=16),
    lse_forward=LSEForwardVariant(block_b=16, block_v=32, block_d=16, num_splits=4, group_b=2),
    backward=BackwardVariant(block_b=16, block_v=32, block_d=16, group_b=2),
)


def run_case(batch, V, D, dtype, *, impl="triton", bias=False, softcap=None, reduction="mean", shift=0,
             ignore=0.0, variants=SMALL, filter_eps=None, peaked=0.0, seed=0, return_lse=False, device="cpu",
             walk=None):
    """Compare one configuration with the oracle; returns the measured errors and the tolerances.

    ``walk``: "sorted" or "random" primes the remembered vocabulary order of the classifier (as a
    previous training step would), so that variants with a tile map take their map path."""
    e, c, t, b = make_inputs(batch, V, D, dtype, bias=bias, seed=seed, peaked=peaked, device=device)
    if ignore:
        g = torch.Generator().manual_seed(seed + 1)
        t = t.clone()
        t[(torch.rand(t.shape, generator=g) < ignore).to(t.device)] = -100
    kw = dict(softcap=softcap, reduction=reduction, shift=shift)

    def ours(e_, c_, b_):
        if walk is not None:
            prime_order(c_, e_, walk)
        out = linear_cross_entropy(e_, c_, t, b_, impl=impl, variants=variants, filter_eps=filter_eps,
                                   return_lse=return_lse, **kw)
        if return_lse:  # z-loss style use of the LSE, so that its gradient path is exercised
            loss, lse = out
            return loss + 0.1 * (lse**2).sum() if loss.dim() == 0 else loss + 0.1 * lse**2
        return out

    def oracle(e_, c_, b_, dt=None):
        out = torch_loss(e_, c_, t, b_, compute_dtype=dt, return_lse=return_lse, **kw)
        if return_lse:
            loss, lse = out
            return loss + 0.1 * (lse**2).sum() if loss.dim() == 0 else loss + 0.1 * lse**2
        return out

    out, g_ours = grads_of(ours, e, c, b)
    d64 = lambda x: x.double() if x is not None else None
    ref, g_ref = grads_of(oracle, d64(e), d64(c), d64(b))
    pt, g_pt = grads_of(lambda *a: oracle(*a, dt=dtype), e, c, b)
    names = ["dE", "dC", "dbias"]
    res = {"loss": (rel_err(out.detach(), ref.detach()), 2 * rel_err(pt.detach(), ref.detach()) + FLOOR[dtype])}
    for n, go, gr, gp in zip(names, g_ours, g_ref, g_pt):
        if gr is None:
            continue
        assert go is not None and go.dtype == dtype and go.shape == gr.shape, n
        res[n] = (rel_err(go, gr), 2 * rel_err(gp, gr) + FLOOR[dtype])
    return res, (e, c, t, b)


def prime_order(c, e, kind):
    """Remember an order for classifier ``c``: by descending average logit, or a random one."""
    from cce_autotune import memory

    if kind == "sorted":
        perm = torch.argsort(c.detach().float() @ e.detach().float().reshape(-1, e.shape[-1]).sum(0), descending=True)
    else:
        perm = torch.randperm(c.shape[0], generator=torch.Generator().manual_seed(1)).to(c.device)
    memory.remember_order(c, perm.to(torch.int32))


def assert_within(res):
    bad = {k: v for k, v in res.items() if not (v[0] <= v[1]) or math.isnan(v[0])}
    assert not bad, f"errors above tolerance (err, tol): {bad}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("features", ["plain", "bias+softcap+shift"])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_matches_float64_oracle(dtype, reduction, features, impl, device):
    full = features != "plain"
    res, _ = run_case((37,), 301, 45, dtype, impl=impl, bias=full, softcap=12.0 if full else None,
                      shift=1 if full else 0, reduction=reduction, ignore=0.1, device=device)
    assert_within(res)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_batch_dims_shift_and_lse(impl, device):
    # (3, 13) batch: shift acts on the last batch dim; LSE returned and differentiated (z-loss).
    for reduction in ("mean", "none"):
        res, _ = run_case((3, 13), 97, 40, torch.float32, impl=impl, shift=2, reduction=reduction,
                          return_lse=True, ignore=0.2, bias=True, device=device)
        assert_within(res)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_return_lse_values(impl, device):
    e, c, t, b = make_inputs((5, 7), 64, 32, torch.float32, bias=True, device=device)
    t[0, 3] = -100
    loss, lse = linear_cross_entropy(e, c, t, b, reduction="none", shift=1, return_lse=True, impl=impl, variants=SMALL)
    ref_loss, ref_lse = torch_loss(e.double(), c.double(), t, b.double(), reduction="none", shift=1, return_lse=True)
    assert lse.shape == t[:, 1:].shape and loss.shape == t[:, 1:].shape
    assert rel_err(lse, ref_lse) < 1e-5 and rel_err(loss, ref_loss) < 1e-5
    assert lse[0, 2] == 0 and loss[0, 2] == 0  # the ignored position


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(impl, reduction, device):
    e, c, t, b = make_inputs((9,), 50, 16, torch.float32, bias=True, device=device)
    t[:] = -100
    out, grads = grads_of(lambda e_, c_, b_: linear_cross_entropy(e_, c_, t, b_, reduction=reduction, impl=impl,
                                                                  variants=SMALL), e, c, b)
    ref = torch_loss(e, c, t, b, reduction=reduction)
    if reduction == "mean":
        assert torch.isnan(out) and torch.isnan(ref)  # torch's answer: 0/0
    else:
        assert torch.equal(out.detach(), ref.detach())
    for g in grads:
        assert torch.count_nonzero(g) == 0


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_non_contiguous_inputs(impl, device):
    g = torch.Generator().manual_seed(3)
    base_e = torch.randn(40, 6, 24, generator=g).to(device)
    e = base_e.transpose(0, 1)[:, ::2, :]  # (6, 20, 24), non-contiguous batch strides
    base_c = torch.randn(64, 48, generator=g).to(device)
    c = base_c[:, ::2]  # (64, 24), D stride 2
    t = torch.randint(0, 64, (20, 6), generator=g).to(device).T  # (6, 20) non-contiguous
    assert not e.is_contiguous() and not c.is_contiguous() and not t.is_contiguous()
    out, (ge, gc) = grads_of(lambda e_, c_: linear_cross_entropy(e_, c_, t, shift=1, impl=impl, variants=SMALL), e, c)
    ref, (re, rc) = grads_of(lambda e_, c_: torch_loss(e_, c_, t, shift=1), e.double(), c.double())
    assert rel_err(out.detach(), ref.detach()) < 1e-5
    assert rel_err(ge, re) < 1e-5 and rel_err(gc, rc) < 1e-5


def test_module_wrapper(device):
    e, c, t, b = make_inputs((2, 11), 70, 32, torch.float32, bias=True, device=device)
    m = LinearCrossEntropy(reduction="sum", shift=1, softcap=20.0, impl="triton", variants=SMALL)
    assert "reduction='sum'" in repr(m)
    got = m(e, c, t, b)
    ref = torch_loss(e.double(), c.double(), t, b.double(), reduction="sum", shift=1, softcap=20.0)
    assert rel_err(got, ref) < 1e-5


def test_triton_and_torch_paths_agree_in_default_mode(device):
    e, c, t, b = make_inputs((33,), 200, 48, torch.bfloat16, bias=True, device=device, peaked=2.0)
    a, ga = grads_of(lambda *x: linear_cross_entropy(*x[:2], t, x[2], impl="torch"), e, c, b)
    k, gk = grads_of(lambda *x: linear_cross_entropy(*x[:2], t, x[2], impl="triton", variants=SMALL), e, c, b)
    assert rel_err(k.detach(), a.detach()) < 1e-4
    for x, y in zip(gk, ga):
        assert rel_err(x, y) < 1e-2


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_nan_and_inf_propagate(value, impl, device):
    e, c, t, _ = make_inputs((8,), 40, 16, torch.float32, device=device)
    e[2, 5] = value
    out = linear_cross_entropy(e, c, t, reduction="none", impl=impl, variants=SMALL)
    ref = torch_loss(e, c, t, reduction="none")
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.isfinite(out[[0, 1, 3]]).all()


@pytest.mark.parametrize("case", ["dense", "gathered-aligned", "gathered-unaligned"])
def test_row_layouts(case, device):
    # The kernels address E densely (no ignored rows, no shift, flat batch), through an offset table
    # with a 16-byte alignment hint, or through a plain table; all three must agree with the oracle.
    from cce_autotune.runtime import ops

    D = 45 if case == "gathered-unaligned" else 48
    e, c, t, _ = make_inputs((4, 9), 130, D, torch.float32, device=device)
    shift = 0 if case == "dense" else 1
    p, _ = ops.start(e, c, t, None, None, Options(shift=shift, impl="triton", variants=SMALL.to_dict()))
    assert (p.layout.dense_stride is not None) == (case == "dense")
    assert p.layout.aligned == (case != "gathered-unaligned")
    out, (ge, gc) = grads_of(lambda e_, c_: linear_cross_entropy(e_, c_, t, shift=shift, impl="triton", variants=SMALL), e, c)
    ref, (re, rc) = grads_of(lambda e_, c_: torch_loss(e_, c_, t, shift=shift), e.double(), c.double())
    assert rel_err(out.detach(), ref.detach()) < 1e-5
    assert rel_err(ge, re) < 1e-5 and rel_err(gc, rc) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernels_read_through_descriptors_where_the_layout_allows(monkeypatch, dtype, device):
    # The LSE kernel and the chunked gradient kernel read E through a TMA tensor descriptor where rows
    # are dense, and C through one where its rows are walked by position and it is of e's 16-bit
    # dtype (partial tiles of rows, columns and D read as zeros); else through pointers, each operand
    # on its own. Every combination reads the same logits.
    from cce_autotune.runtime.call import prepare
    from cce_autotune.strategies import chunked, common
    from cce_autotune.strategies import forward as fwd

    if device != "cpu" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need compute capability 9.0 (Hopper) or more")
    real = common.tma_descriptors
    used = {"forward": [], "chunked": []}

    def patch(keep):  # the real descriptors, then only the operands `keep` names
        for name, mod in (("forward", fwd), ("chunked", chunked)):
            def f(*a, _n=name, **k):
                d = real(*a, **k)
                used[_n].append(d)
                return tuple(x if op in keep else None for x, op in zip(d, "EC"))
            monkeypatch.setattr(mod, "tma_descriptors", f)

    e, c, t, b = make_inputs((2, 21), 301, 40, dtype, bias=True, device=device)  # 42 rows, D = 40: partial tiles
    variants = SMALL.replace(backward=SMALL.backward.replace(strategy="chunked", chunk_v=64))  # several chunks
    kw = dict(impl="triton", variants=variants, filter_eps=None, softcap=20.0, return_lse=True)
    seen = {}

    def call(e_, c_, b_):
        loss, seen["lse"] = linear_cross_entropy(e_, c_, t, b_, **kw)
        return loss

    results = {}
    for keep in ("EC", "E", "C", ""):
        patch(keep)
        results[keep] = grads_of(call, e, c, b)[1], seen["lse"].detach()
    assert used["forward"] and all(x is not None for d in used["forward"] for x in d)
    assert used["chunked"] and all(x is not None for d in used["chunked"] for x in d)
    grads_pointers, lse_pointers = results[""]
    for keep in ("EC", "E", "C"):
        grads, lse = results[keep]
        torch.testing.assert_close(lse, lse_pointers, rtol=0, atol=1e-5)
        for g, gp in zip(grads, grads_pointers):
            # (bit-equal in the interpreter; on a GPU the products' order may differ, and g is rounded)
            assert rel_err(g, gp) < (1e-9 if device == "cpu" else 1e-3), (keep, rel_err(g, gp))
    z = torch.nn.functional.linear(e.double(), c.double(), b.double())
    lse = results["EC"][1]
    torch.testing.assert_close(lse.double(), torch.logsumexp(20.0 * torch.tanh(z / 20.0), -1), rtol=0, atol=1e-5)
    # E not where rows are gathered (shift) or a row stride is not 16 bytes; C not where a walked
    # order gathers its rows or the classifier is wider than e.
    o = Options(impl="triton", variants=SMALL.to_dict())
    v = SMALL.lse_forward
    dense = prepare(e, c, t, None, None, o, "triton").layout
    has = lambda d: tuple(x is not None for x in d)  # noqa: E731
    assert has(real(e, c, dense.n, dense.dense_stride, v, c_by_position=True)) == (True, True)
    assert has(real(e, c, dense.n, dense.dense_stride, v, c_by_position=False)) == (True, False)
    shifted = prepare(e, c, t, None, None, Options(impl="triton", shift=1, variants=SMALL.to_dict()), "triton").layout
    assert shifted.dense_stride is None
    assert has(real(e, c, shifted.n, shifted.dense_stride, v, c_by_position=True)) == (False, True)
    assert has(real(e, c.float(), dense.n, dense.dense_stride, v, c_by_position=True)) == (True, False)
    odd = torch.zeros((42, 41), dtype=dtype, device=e.device)[:, :40]  # rows 82 bytes apart
    assert has(real(odd, c, 42, 41, v, c_by_position=True)) == (False, True)
    strided = torch.zeros((42, 80), dtype=dtype, device=e.device)[:, ::2]  # e not contiguous along D
    assert has(real(strided, c, 42, 80, v, c_by_position=True)) == (False, True)


def test_a_walked_order_reads_e_through_a_descriptor(monkeypatch, device):
    # A call that walks a remembered order (a filtered training step's) gathers C's rows through
    # pointers while E still comes through a descriptor; with an fp32 classifier converted in chunks
    # (a budget below the converted classifier's 44 KB), the chunks are laid out by walked position,
    # so C comes through one too. The results are the pointers'.
    from cce_autotune.strategies import chunked, common
    from cce_autotune.strategies import forward as fwd

    if device != "cpu" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptors need compute capability 9.0 (Hopper) or more")
    real, real_lse = common.tma_descriptors, fwd.lse_forward
    e, c, t, _ = make_inputs((64,), 700, 32, torch.bfloat16, device=device)
    for c_, budget, expect in ((c, None, (True, False)), (c.float(), 30_000, (True, True))):
        results = []
        for on in (True, False):
            used, walks = [], []

            def descriptors(*a, _on=on, _used=used, **k):
                d = real(*a, **k) if _on else (None, None)
                _used.append(tuple(x is not None for x in d))
                return d

            def lse_forward(*a, _walks=walks, _used=used, **k):
                _walks.append(k.get("perm") is not None)
                n = len(_used)
                out = real_lse(*a, **k)
                _walks[-1] = (_walks[-1], _used[n:])  # the descriptors of this forward's launches
                return out

            for mod in (fwd, chunked):
                monkeypatch.setattr(mod, "tma_descriptors", descriptors)
            monkeypatch.setattr(fwd, "lse_forward", lse_forward)

            def call(e_, c2):
                prime_order(c2, e_, "sorted")
                kw = {} if budget is None else dict(max_extra_memory=budget)
                return linear_cross_entropy(e_, c2, t, impl="triton", variants=SMALL, filter_eps=2.0**-12, **kw)

            results.append(grads_of(call, e, c_))
            if on:
                assert len(walks) == 1 and walks[0][0], walks  # the forward walked the remembered order
                assert walks[0][1] and all(d == expect for d in walks[0][1]), walks
        (l1, g1), (l0, g0) = results
        assert rel_err(l1.detach(), l0.detach()) < 1e-6
        for a_, b_ in zip(g1, g0):
            assert rel_err(a_, b_) < (1e-9 if device == "cpu" else 1e-3)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_shift_runs_as_ignored_targets_on_dense_rows(monkeypatch, reduction, device):
    # Where e's batch dimensions flatten, the API moves the targets `shift` places left and ignores
    # the last `shift` positions of each sequence: the operator sees shift 0 and every row (dense
    # rows), and the loss, LSE and gradients equal the shifted call's on gathered rows (the same
    # values in a layout whose batch dimensions do not flatten, which keeps the shift).
    from cce_autotune.runtime import ops

    seen = []
    real_start = ops.start

    def start(e_, c_, t_, b_, w_, o):
        seen.append((o.shift, tuple(t_.shape), w_ is not None))
        return real_start(e_, c_, t_, b_, w_, o)

    monkeypatch.setattr(ops, "start", start)
    e, c, t, _ = make_inputs((3, 11), 97, 40, torch.float32, device=device)
    t = t.clone()
    t[0, 4] = -100
    w = torch.rand(t.shape, generator=torch.Generator().manual_seed(3)).to(t.device)
    kw = dict(shift=2, reduction=reduction, return_lse=True, impl="triton", variants=SMALL, token_weights=w)

    def run(e_):
        leaf = e_.detach().requires_grad_()
        cc = c.detach().requires_grad_()
        loss, lse = linear_cross_entropy(leaf, cc, t, **kw)
        (loss.sum() + 0.1 * (lse**2).sum()).backward()
        return loss.detach(), lse.detach(), leaf.grad, cc.grad

    dense = run(e)
    assert seen[-1] == (0, (3, 11), True)
    gathered_e = e.transpose(0, 1).contiguous().transpose(0, 1)  # the same values; rows 120 elements apart
    gathered = run(gathered_e)
    assert seen[-1] == (2, (3, 11), True)
    assert dense[0].shape == gathered[0].shape == ((3, 9) if reduction == "none" else ())
    assert dense[1].shape == gathered[1].shape == (3, 9) and dense[1].is_contiguous()
    for a, b in zip(dense, gathered):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not dense[2][:, 9:].any()  # the last positions of each sequence predict nothing


def test_dispatched_variants_leave_the_strategy_to_the_planner(monkeypatch, device):
    # A tuned entry's strategy was measured on the tuner's data; for dispatched variants the planner
    # decides per call (strategy "auto"), filtered or exact. Explicit variants keep theirs.
    from cce_autotune.configdb import dispatch
    from cce_autotune.runtime import ops

    tuned = KernelVariants(backward=BackwardVariant(block_b=16, block_v=32, block_d=16, strategy="sparse"))
    monkeypatch.setattr(dispatch, "select_variants", lambda e, c, **kw: tuned)
    e, c, t, _ = make_inputs((20,), 64, 32, torch.float32, device=device)
    for eps in (None, "auto"):
        _, dispatched = ops.start(e, c, t, None, None, Options(filter_eps=eps, impl="triton"))
        assert dispatched.variants.backward.strategy == "auto"
        assert dispatched.variants.backward.block_b == 16  # the rest of the tuned entry is kept
    _, explicit = ops.start(e, c, t, None, None, Options(filter_eps=None, impl="triton", variants=tuned.to_dict()))
    assert explicit.variants.backward.strategy == "sparse"
    out, (ge, gc) = grads_of(lambda e_, c_: linear_cross_entropy(e_, c_, t, filter_eps=None, impl="triton"), e, c)
    ref, (re, rc) = grads_of(lambda e_, c_: torch_loss(e_, c_, t), e.double(), c.double())
    assert rel_err(ge, re) < 1e-5 and rel_err(gc, rc) < 1e-5


@pytest.mark.parametrize("mode, loss_scale", [(dict(filter_eps=None), 1.0), (dict(max_extra_memory=None), 1.0),
                                              (dict(deterministic=True), 1.0), (dict(filter_eps=None), 2.0**16)],
                         ids=["exact", "fused", "deterministic", "loss scaled by 2^16"])
def test_fp16_gradients_keep_the_small_softmax_terms(mode, loss_scale, device):
    # fp16's smallest normal number is 6e-5: "mean" over 1024 rows makes each row's gradient of the
    # logits coef * softmax with coef = 1/1024, and most of a peaked row's terms fell below it when the
    # kernels rounded g (dE 1.1e-3, dC 5.5e-4, the deterministic dbias 6.1e-4 here; 1.6e-2 at
    # 3000 x 32000 x 2048 on the GPU). The coefficients are scaled by a power of two first and the
    # gradients back after (execute.gradient_scale): dE 3.3e-4 here. A loss scaled by 2^16 (as
    # GradScaler does) must not overflow the scaled gradients either.
    from cce_autotune.data import make_data

    e, c, t = make_data("lm", 1024, 1024, 32, dtype=torch.float16, seed=1, device=device)
    b = (torch.randn(1024, generator=torch.Generator().manual_seed(2)) * 0.5).to(device=device, dtype=torch.float16)
    _, ref = grads_of(lambda e_, c_, b_: torch_loss(e_, c_, t, bias=b_, softcap=30.0) * loss_scale,
                      e.double(), c.double(), b.double())
    ee, cc, bb = (x.clone().requires_grad_() for x in (e, c, b))
    (linear_cross_entropy(ee, cc, t, bias=bb, softcap=30.0, impl="triton", **mode) * loss_scale).backward()
    for got, want in zip((ee.grad, cc.grad, bb.grad), ref):
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < 5e-4, (rel_err(ee.grad, ref[0]), rel_err(cc.grad, ref[1]), rel_err(bb.grad, ref[2]))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_the_backward_takes_the_forward_s_call(monkeypatch, impl, device):
    """One call prepares its rows, targets and weights once: the backward takes the forward's (its
    inputs are the forward's), and a second backward through a retained graph prepares them again."""
    from cce_autotune.runtime import ops

    made = []
    prepare = ops.prepare
    monkeypatch.setattr(ops, "prepare", lambda *a, **k: made.append(1) or prepare(*a, **k))
    e, c, t, _ = make_inputs((2, 9), 70, 16, torch.float32, device=device)
    e.requires_grad_(); c.requires_grad_()
    loss = linear_cross_entropy(e, c, t, impl=impl, variants=SMALL, shift=1)
    loss.backward(retain_graph=True)
    assert len(made) == 1
    first = (e.grad.clone(), c.grad.clone())
    e.grad = c.grad = None
    loss.backward()  # (the state was used once: prepared and planned again, the same gradients)
    assert len(made) == 2
    # (equal up to the order of a GPU strategy's float atomics)
    torch.testing.assert_close(e.grad, first[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(c.grad, first[1], rtol=1e-6, atol=1e-7)


def test_row_offsets_are_kept_per_shape_and_read_only(device):
    from cce_autotune.runtime import call as call_mod

    call_mod._OFFSETS.clear()
    a = call_mod._grid_offsets((3, 5), [7, 1], torch.device(device))
    assert a is call_mod._grid_offsets((3, 5), [7, 1], torch.device(device))
    assert a.tolist() == [7 * i + j for i in range(3) for j in range(5)]
    assert call_mod._grid_offsets((3, 5), [8, 1], torch.device(device)) is not a
    with torch.inference_mode():  # (an inference tensor is not kept for later calls)
        b = call_mod._grid_offsets((4, 4), [4, 1], torch.device(device))
    assert call_mod._grid_offsets((4, 4), [4, 1], torch.device(device)) is not b
    for i in range(call_mod._OFFSETS_KEPT + 5):
        call_mod._grid_offsets((i + 1,), [1], torch.device(device))
    assert len(call_mod._OFFSETS) <= call_mod._OFFSETS_KEPT


def test_row_offsets_under_graph_capture_are_the_graph_s_own(monkeypatch, device):
    # A captured graph's replays read the offsets it captured: not a kept tensor that may be dropped
    # (its memory reused) later; and nothing made under capture is kept.
    from cce_autotune.runtime import call as call_mod

    call_mod._OFFSETS.clear()
    kept = call_mod._grid_offsets((3, 5), [5, 1], torch.device(device))
    monkeypatch.setattr(call_mod, "_capturing", lambda device: True)
    fresh = call_mod._grid_offsets((3, 5), [5, 1], torch.device(device))
    assert fresh is not kept and torch.equal(fresh, kept)
    call_mod._grid_offsets((2, 2), [2, 1], torch.device(device))
    assert [k[:2] for k in call_mod._OFFSETS] == [((3, 5), (5, 1))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_offsets_are_kept_per_stream():
    # A call on another stream could read kept offsets before the kernels that made them ran.
    from cce_autotune.runtime import call as call_mod

    dev = torch.device("cuda", torch.cuda.current_device())
    call_mod._OFFSETS.clear()
    a = call_mod._grid_offsets((3, 5), [5, 1], dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        b = call_mod._grid_offsets((3, 5), [5, 1], dev)
        assert b is not a and call_mod._grid_offsets((3, 5), [5, 1], dev) is b
    torch.cuda.synchronize()
    assert call_mod._grid_offsets((3, 5), [5, 1], dev) is a and torch.equal(a, b)

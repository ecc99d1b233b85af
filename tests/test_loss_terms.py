"""Label smoothing, token weights, the z-loss, mixed precision (an fp32 classifier with 16-bit e) and
autocast, on both paths, against a float64 oracle with the tolerances of test_loss.py (no worse than
plain PyTorch in the same dtype, times 2, plus a floor)."""

import pytest
import torch
import torch.nn.functional as F

from cce_autotune import linear_cross_entropy
from helpers import grads_of, make_inputs, materialised_logits, rel_err
from test_loss import FLOOR, SMALL, assert_within, prime_order
from test_tile_map import MAPPED
from test_variants import assert_within_bound


def terms_loss(e, c, t, b=None, *, softcap=None, reduction="mean", shift=0, label_smoothing=0.0, token_weights=None,
               z_loss=0.0, compute_dtype=None, ignore_index=-100):
    """Plain PyTorch with the logits materialised (in ``compute_dtype``, default e's; an fp32
    classifier is first rounded to e's dtype, as autocast's matmul would)."""
    if c.dtype != e.dtype and c.dtype == torch.float32 and e.dtype in (torch.bfloat16, torch.float16):
        c = c.to(e.dtype)
    T = e.shape[-2]
    z = materialised_logits(e, c, b, softcap, compute_dtype)
    z = z.narrow(-2, 0, T - shift).reshape(-1, z.shape[-1])
    tt = t.narrow(-1, shift, T - shift).reshape(-1)
    row = F.cross_entropy(z, tt, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = (tt != ignore_index).to(z.dtype)
    row = row + z_loss * torch.logsumexp(z, -1) ** 2 * valid
    w = valid if token_weights is None else valid * token_weights.narrow(-1, shift, T - shift).reshape(-1).to(z.dtype)
    row = row * w
    if reduction == "none":
        return row.view(tt.shape if t.dim() == 1 else t.narrow(-1, shift, T - shift).shape)
    return row.sum() if reduction == "sum" else row.sum() / w.sum()


def compare(e, c, t, b, dtype, *, impl, variants=SMALL, filter_eps=None, max_extra_memory="auto", walk=None, **kw):
    """(err, tol) of the loss and each gradient, and checks the gradients' dtypes (e's for dE, the
    classifier's and bias's own for dC, dbias). ``walk``: an order remembered for the classifier the
    call gets (a copy of ``c``: see ``prime_order``) first, as a previous training step would leave
    one, so that variants with a tile map take their map path."""

    def ours(e_, c_, b_):
        if walk is not None:
            prime_order(c_, e_, walk)
        return linear_cross_entropy(e_, c_, t, b_, impl=impl, variants=variants, filter_eps=filter_eps,
                                    max_extra_memory=max_extra_memory, **kw)

    out, g_ours = grads_of(ours, e, c, b)
    d64 = lambda x: x.double() if x is not None else None
    # The oracle differentiates the classifier as the kernels use it: rounded to e's dtype when wider.
    c_used = c.to(e.dtype) if c.dtype != e.dtype else c
    ref, g_ref = grads_of(lambda e_, c_, b_: terms_loss(e_, c_, t, b_, **kw), d64(e), d64(c_used), d64(b))
    pt, g_pt = grads_of(lambda e_, c_, b_: terms_loss(e_, c_, t, b_, compute_dtype=dtype, **kw), e, c, b)
    res = {"loss": (rel_err(out.detach(), ref.detach()), 2 * rel_err(pt.detach(), ref.detach()) + FLOOR[dtype])}
    for name, x, go, gr, gp in zip(["dE", "dC", "dbias"], (e, c, b), g_ours, g_ref, g_pt):
        if gr is None:
            continue
        assert go is not None and go.dtype == x.dtype and go.shape == gr.shape, name
        res[name] = (rel_err(go, gr), 2 * rel_err(gp, gr) + FLOOR[dtype])
    return res


def weights_for(t, seed=3):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(t.shape, generator=g) * 2
    w[torch.rand(t.shape, generator=g) < 0.2] = 0.0  # a loss mask in places
    return w.to(t.device)


def with_ignored(t, share=0.15, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = t.clone()
    t[(torch.rand(t.shape, generator=g) < share).to(t.device)] = -100
    return t


CASES = {
    "smoothing": dict(label_smoothing=0.1),
    "weights": dict(weights=True),
    "z-loss": dict(z_loss=0.02),
    "all+bias+shift": dict(label_smoothing=0.2, weights=True, z_loss=0.01, bias=True, shift=1),
    "smoothing+softcap": dict(label_smoothing=0.1, softcap=8.0, bias=True),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_loss_terms_match_float64_oracle(impl, case, reduction, device):
    spec = dict(CASES[case])
    bias = spec.pop("bias", False)
    e, c, t, b = make_inputs((3, 13), 97, 40, torch.float32, bias=bias, device=device)
    t = with_ignored(t)
    if spec.pop("weights", False):
        spec["token_weights"] = weights_for(t)
    res = compare(e, c, t, b, torch.float32, impl=impl, reduction=reduction, **spec)
    assert_within(res)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_inputs_pass_gradcheck(reduction):
    # float64 embeddings (the PyTorch path): the loss, the LSE and the per-row terms are float64 too,
    # as F.cross_entropy's, so that torch.autograd.gradcheck's finite differences see the loss's own
    # precision (with them in fp32 every numerical derivative was off by about 0.2).
    g = torch.Generator().manual_seed(0)
    e = torch.randn(2, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    c = torch.randn(11, 8, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (2, 6), generator=g)
    t[0, 2] = -100
    w = torch.rand(2, 6, generator=g, dtype=torch.float64)
    for kw in (dict(), dict(shift=1, softcap=5.0, label_smoothing=0.1, z_loss=0.01, token_weights=w)):
        loss, lse = linear_cross_entropy(e, c, t, b, reduction=reduction, return_lse=True, **kw)
        assert loss.dtype == lse.dtype == torch.float64
        assert torch.autograd.gradcheck(lambda *x: linear_cross_entropy(*x[:2], t, x[2], reduction=reduction, **kw),
                                        (e, c, b))
        assert torch.autograd.gradcheck(
            lambda *x: linear_cross_entropy(*x[:2], t, x[2], reduction=reduction, return_lse=True, **kw)[1], (e, c, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_loss_terms_in_16_bit(impl, dtype, device):
    e, c, t, b = make_inputs((37,), 301, 45, dtype, bias=True, device=device)
    t = with_ignored(t)
    res = compare(e, c, t, b, dtype, impl=impl, label_smoothing=0.1, token_weights=weights_for(t), z_loss=0.01)
    assert_within(res)


@pytest.mark.parametrize("strategy", ["chunked", "sparse"])
def test_loss_terms_with_filtering_and_a_tile_map(strategy, device):
    # Filtered, mapped backward: the smoothing term is added outside the kernels exactly; only the
    # softmax part is filtered (within the bound filter_eps implies).
    e, c, t, b = make_inputs((61,), 300, 45, torch.float32, bias=True, peaked=2.0, device=device)
    t = with_ignored(t)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(strategy=strategy, filter_eps=2.0**-10))
    res = compare(e, c, t, b, torch.float32, impl="triton", variants=kv, filter_eps="auto", walk="sorted",
                  label_smoothing=0.1, token_weights=weights_for(t), z_loss=0.01)
    assert_within_bound(res, e, c, t, b, kv.backward.filter_eps)


def test_fused_strategy_with_token_weights(device):
    e, c, t, b = make_inputs((40,), 200, 32, torch.float32, bias=True, device=device)
    t = with_ignored(t)
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="fused"))
    for reduction in ("mean", "sum"):
        res = compare(e, c, t, b, torch.float32, impl="triton", variants=kv, reduction=reduction,
                      token_weights=weights_for(t))
        assert_within(res)
    # An fp32 classifier small enough to be converted whole runs the fused strategy too (dC in fp32).
    e16 = e.to(torch.bfloat16)
    res = compare(e16, c, t, b, torch.bfloat16, impl="triton", variants=kv, token_weights=weights_for(t))
    assert_within(res)


@pytest.mark.parametrize("V", [203, 208])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_strategy_at_an_odd_vocabulary(V, dtype, device, planned, monkeypatch):
    # g's rows are a multiple of 16 elements apart; at a V that is not one, the kernels write the columns
    # past V as zeros (their masks' bound is the row's width, so that they vectorize), which the
    # products may read: none of it reaches the gradients, even where the strategy's buffers start as
    # NaN. Blocks of fewer rows than the call (the last partial, over the previous block's rows) and a
    # softcap.
    from cce_autotune.strategies import fused

    class NaNEmpty:  # (the strategy's torch, whose empty float buffers hold NaN)
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, **kw):
            x = torch.empty(*shape, **kw)
            return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(fused, "torch", NaNEmpty())
    e, c, t, b = make_inputs((150,), V, 32, dtype, bias=True, seed=4, device=device)
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="fused"))
    assert fused._aligned(V) % 16 == 0 and fused._aligned(V) - V < 16
    for softcap in (None, 20.0):
        res = compare(e, c, t, b, dtype, impl="triton", variants=kv, softcap=softcap, max_extra_memory=70_000)
        assert_within(res)
        plan = planned[-1].plan
        assert plan.strategy == "fused" and 0 < plan.row_block < 150 and 150 % plan.row_block  # (a last, partial block)


def test_exact_fused_strategy_sums_a_16_bit_dc_in_fp32(device):
    # Exact mode, a 16-bit classifier, blocks of fewer rows than the call: dC is summed over the blocks
    # in an fp32 accumulator (one rounding, as the four-matmul plans), which the budget holds.
    from cce_autotune.planning import explain
    from cce_autotune.plans import CallProblem
    from cce_autotune.strategies import fused

    e, c, t, b = make_inputs((256,), 200, 32, torch.float16, device=device)
    p = CallProblem(n=256, n_all=256, V=200, D=32, elem=2, grad_bytes=2 * (256 + 200) * 32)
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="fused"))
    with explain.recording() as plans:
        res = compare(e, c, with_ignored(t), None, torch.float16, impl="triton", variants=kv,
                      max_extra_memory=fused.extra_bytes(p, 16, kv.lse_forward.block_v, dc_fp32=True))
    assert_within(res)
    ran = [r.plan for r in plans if r.plan.strategy == "fused"]
    assert ran and all(x.dc_fp32 and x.row_block == 16 for x in ran)


def test_exact_chunked_strategy_runs_with_the_forwards_tiles(device):
    # An exact backward computes every tile as the forward does: it runs with the forward variant's
    # tiling (the backward variant's is tuned for the mapped backward), here 16 x 32 x 16 against
    # 16 x 16 x 16, in one chunk of the whole vocabulary (301 columns: not whole tiles).
    from cce_autotune.planning import explain

    e, c, t, b = make_inputs((37,), 301, 45, torch.float32, bias=True, device=device)
    kv = SMALL.replace(backward=SMALL.backward.replace(block_v=16, chunk_v=64, strategy="chunked"))
    with explain.recording() as plans:
        res = compare(e, c, with_ignored(t), b, torch.float32, impl="triton", variants=kv, softcap=10.0,
                      max_extra_memory=None)
    assert_within(res)
    ran = [r.call.backward for r in plans if r.call is not None and r.call.backward is not None]
    assert ran and ran[0].chunk_v >= 301 and ran[0].tiles == {
        k: getattr(kv.lse_forward, k) for k in ("block_b", "block_v", "block_d", "group_b", "num_warps", "num_stages")}


def test_exact_chunks_between_powers_of_two(device):
    # An exact backward's chunks are the widest multiple of 256 columns that fits the budget (here
    # 768 of 1100, where the powers of two would give 512): three chunks, the last a partial one
    # that no tile width divides (1100 - 768 = 332 columns).
    from cce_autotune.planning import explain
    from cce_autotune.plans import CallProblem
    from cce_autotune.strategies import chunked

    e, c, t, b = make_inputs((40,), 1100, 16, torch.bfloat16, bias=True, device=device)
    p = CallProblem(n=40, n_all=40, V=1100, D=16, elem=2, grad_bytes=2 * (40 + 1100) * 16)
    budget = (chunked.extra_bytes(p, 768, True, False) + chunked.extra_bytes(p, 1024, True, False)) // 2
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="chunked"))
    with explain.recording() as plans:
        res = compare(e, c, with_ignored(t), b, torch.bfloat16, impl="triton", variants=kv, softcap=10.0,
                      max_extra_memory=budget)
    assert_within(res)
    ran = [r.call.backward for r in plans if r.call is not None and r.call.backward is not None]
    assert ran and ran[0].chunk_v == 768 and ran[0].de_fp32, [(x.chunk_v, x.de_fp32) for x in ran]


@pytest.mark.parametrize("strategy", ["chunked", "sparse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mixed_precision_fp32_classifier(dtype, strategy, device, set_costs, monkeypatch):
    # 16-bit e with the fp32 master classifier (and bias): dC and dbias come back in fp32, dE in e's
    # dtype. C is converted to e's dtype a chunk at a time (here 2 tiles, so that several chunks
    # run) or its tiles in registers (sparse), as when its whole copy does not fit the memory
    # budget (forced here: the small budget it would take would also change the strategy). Mapped
    # strategies included.
    from cce_autotune.planning import explain, planner

    monkeypatch.setattr(planner, "converts_whole", lambda *a: False)
    set_costs(convert_bytes=2 * 32 * 45 * 2)
    e, _, t, _ = make_inputs((3, 17), 300, 45, dtype, device=device)
    _, c, _, b = make_inputs((3, 17), 300, 45, torch.float32, bias=True, device=device)
    t = with_ignored(t)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(strategy=strategy, filter_eps=1e-30))
    with explain.recording() as plans:
        res = compare(e, c, t, b, dtype, impl="triton", variants=kv, filter_eps="auto", walk="sorted", softcap=10.0,
                      shift=1)
    assert_within(res)
    assert [r.plan.strategy for r in plans] == [strategy] and plans[0].plan.use_map  # (the walk records the map)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_classifier_conversion_rounds_like_torch(dtype, device):
    # The conversion kernel (templates/convert.py.j2), plain and gathered, is torch's rounding to
    # nearest, including NaN and values that overflow the 16-bit range.
    from cce_autotune.strategies.common import convert_rows

    c = torch.randn(300, 45, generator=torch.Generator().manual_seed(0)) * 3
    c[5, 3], c[6, 4], c[7, 0] = float("nan"), 3.4e38, -7e4
    c = c.to(device)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.int32)
    buf = torch.empty(100, 45, dtype=dtype, device=device)
    for lo, order, ref in ((50, perm, c[perm[50:150].long()]), (0, None, c[:100])):
        out = convert_rows(c, lo, 100, order, buf)
        assert torch.equal(out.isnan(), ref.to(dtype).isnan())
        assert torch.equal(out.float().nan_to_num(), ref.to(dtype).float().nan_to_num())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gradient_scaling_rounds_once(dtype, device):
    # The scaling of the fused gradients (templates/scale.py.j2): x times an fp32 device factor, in
    # fp32, rounded once to x's dtype (torch's own mixed-dtype product), NaN and infinities kept;
    # a tensor it cannot address as one run of elements is refused by name.
    from cce_autotune.strategies.common import scale_in_place

    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)) * 100
    x[7], x[8] = float("nan"), float("inf")
    x = x.to(dtype).to(device)
    f = torch.tensor(0.3, device=device)
    ref = (x.float() * f).to(dtype)
    scale_in_place(x, f)
    assert torch.equal(x.isnan(), ref.isnan())
    assert torch.equal(x.float().nan_to_num(), ref.float().nan_to_num())
    for factor in (1.0, -1.0, 2.0):  # (a factor of 1 leaves every bit as it was; others scale)
        y = x.clone()
        scale_in_place(y, torch.tensor(factor, device=device))
        assert torch.equal(y.float().nan_to_num(), (x.float() * factor).to(dtype).float().nan_to_num())
    with pytest.raises(ValueError, match="^t: "):
        scale_in_place(torch.zeros(4, 4, device=device).T[:2], f)


@pytest.mark.parametrize("acc_dtype,c_dtype,softcap", [(torch.float32, torch.float32, None),
                                                      (torch.bfloat16, torch.float32, 5.0),
                                                      (torch.float32, torch.bfloat16, None)], ids=str)
def test_target_terms_match_float64(acc_dtype, c_dtype, softcap, device):
    # The onehot terms outside the launched tiles (templates/target_terms.py.j2): rows gathered from a
    # larger E (ignored rows between them), repeated targets (one with 40 rows: more than one step of
    # the per-target loop), rows of weight 0 (their tile was launched: nothing added, and a target
    # whose rows all weigh 0 leaves dC untouched), D not a power of two; against float64, into
    # accumulators that already hold values; the same bits on a second run.
    from cce_autotune.strategies.common import RowLayout, add_target_terms, target_weight

    gen = torch.Generator().manual_seed(3)
    n, V, D = 70, 50, 45
    e_all = torch.randn(2 * n, D, generator=gen).to(torch.bfloat16)
    c = (torch.randn(V, D, generator=gen) * 2).to(c_dtype)
    keep = torch.randperm(2 * n, generator=gen)[:n].sort().values
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[:40] = 7
    targets[40:44] = 11
    coef = torch.rand(n, generator=gen) + 0.5
    coef[torch.rand(n, generator=gen) < 0.3] = 0.0
    coef[40:44] = 0.0  # target 11: no term
    zt = torch.randn(n, generator=gen) * 3
    acc0 = torch.randn(2 * n, D, generator=gen).to(acc_dtype)
    dc0 = torch.randn(V, D, generator=gen).to(acc_dtype)
    db0 = torch.randn(V, generator=gen)

    w = target_weight(coef, zt, softcap).double()
    acc_ref, dc_ref, db_ref = acc0.double(), dc0.double(), db0.double()
    c_r = c.to(torch.bfloat16).double()
    acc_ref[keep] -= w[:, None] * c_r[targets]
    dc_ref.index_add_(0, targets, -w[:, None] * e_all[keep].double())
    db_ref.index_add_(0, targets, -w)

    outs = []
    for _ in range(2):
        acc, dc, db = acc0.clone().to(device), dc0.clone().to(device), db0.clone().to(device)
        rows = RowLayout(offsets=(keep * D).to(device), de_offsets=(keep * D).to(device))
        add_target_terms(c.to(device), e_all.to(device), rows, targets.to(device), coef.to(device), zt.to(device),
                         softcap, acc, dc, db)
        outs.append((acc.cpu(), dc.cpu(), db.cpu()))
    tol = 1e-5 if acc_dtype == torch.float32 else 8e-3
    for got, ref in zip(outs[0], (acc_ref, dc_ref, db_ref)):
        assert (got.double() - ref).abs().max() <= tol * ref.abs().max()
    assert torch.equal(outs[0][1][11], dc0[11])
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_mixed_precision_forward_converts_chunks_like_a_16_bit_classifier(device):
    # The LSE and the tile map of an fp32 classifier, converted a chunk at a time in the walked order,
    # are those of the classifier rounded to e's dtype (the map's tiles land at their global index).
    from cce_autotune.strategies import forward as kernels
    from cce_autotune.strategies.common import RowLayout

    chunk = kernels.convert_width(333, 40, MAPPED.lse_forward.block_v, 2, 3 * 32 * 40 * 2)  # three tiles
    e, _, t, _ = make_inputs((50,), 333, 40, torch.bfloat16, device=device)
    _, c, _, b = make_inputs((50,), 333, 40, torch.float32, bias=True, device=device)
    rows = RowLayout.dense(50, 40, device)
    perm = torch.randperm(333, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.int32)
    variant = MAPPED.lse_forward
    zt = kernels.indexed_dot(e, c, b, rows, t, None, SMALL.indexed_dot)
    zt16 = kernels.indexed_dot(e, c.to(e.dtype), b, rows, t, None, SMALL.indexed_dot)
    # (the target logits of C rounded in the kernel: to nearest, as torch, also under Triton's
    # interpreter, whose own casts to bfloat16 truncate)
    assert torch.equal(zt, zt16)
    lse, tmap = kernels.lse_forward(e, c, b, rows, None, variant, perm=perm, zt=zt16, convert_chunk=chunk)
    lse16, tmap16 = kernels.lse_forward(e, c.to(e.dtype), b, rows, None, variant, perm=perm, zt=zt16)
    assert torch.equal(tmap.q, tmap16.q)
    assert rel_err(lse, lse16) < 1e-6
    plain, _ = kernels.lse_forward(e, c, b, rows, None, variant, convert_chunk=chunk)
    assert rel_err(plain, lse16) < 1e-6


@pytest.mark.parametrize("merge", ["buffer", "lock"])
def test_a_walked_forward_copying_c_in_chunks_matches_the_kernel_s_own_gather(merge, device):
    # A 16-bit classifier walked in an order: copied a chunk of the order at a time (each chunk read
    # by position; every chunk's split LSEs merged once, or each merged under the locks into one
    # result) or gathered by the kernel itself, the LSE and the tile map are the same.
    from cce_autotune.strategies import forward as kernels
    from cce_autotune.strategies.common import RowLayout

    variant = MAPPED.lse_forward.replace(merge=merge)
    chunk = kernels.convert_width(333, 40, variant.block_v, 2, 2 * 32 * 40 * 2)  # two tiles: a short last chunk
    e, c, t, b = make_inputs((50,), 333, 40, torch.bfloat16, bias=True, device=device)
    rows = RowLayout.dense(50, 40, device)
    perm = torch.randperm(333, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=torch.int32)
    zt = kernels.indexed_dot(e, c, b, rows, t, None, SMALL.indexed_dot)
    lse, tmap = kernels.lse_forward(e, c, b, rows, None, variant, perm=perm, zt=zt, convert_chunk=chunk)
    ref, tref = kernels.lse_forward(e, c, b, rows, None, variant, perm=perm, zt=zt)
    assert 333 > chunk and torch.equal(tmap.q, tref.q)
    assert rel_err(lse, ref) < 1e-6
    assert rel_err(lse, torch.logsumexp(e.float() @ c.float().T + b.float(), dim=1)) < 1e-5


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_mixed_precision_exact_and_smoothing(impl, device):
    e, _, t, _ = make_inputs((37,), 301, 45, torch.bfloat16, device=device)
    _, c, _, b = make_inputs((37,), 301, 45, torch.float32, bias=True, device=device)
    res = compare(e, c, with_ignored(t), b, torch.bfloat16, impl=impl, label_smoothing=0.1, z_loss=0.01)
    assert_within(res)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_autocast_casts_e_not_the_classifier(impl, device):
    # Inside autocast, fp32 hidden states (a final norm's output) and the fp32 classifier give what
    # the bf16 hidden states with the fp32 classifier give outside it; dE comes back in fp32 (through
    # the cast), dC in fp32.
    e, c, t, _ = make_inputs((29,), 97, 40, torch.float32, device=device)
    ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        loss = linear_cross_entropy(ee, cc, t, impl=impl, variants=SMALL)
    loss.backward()
    e16 = e.to(torch.bfloat16).requires_grad_()
    c2 = c.clone().requires_grad_()
    ref = linear_cross_entropy(e16, c2, t, impl=impl, variants=SMALL)
    ref.backward()
    assert loss.dtype == torch.float32 and ee.grad.dtype == torch.float32 and cc.grad.dtype == torch.float32
    assert torch.equal(loss, ref)
    assert torch.equal(ee.grad, e16.grad.float()) and torch.equal(cc.grad, c2.grad)


def test_an_fp32_classifier_converted_whole_is_converted_once_a_call(device, monkeypatch):
    # The plan converts the fp32 classifier whole once a call: the forward's copy serves the backward
    # (PyTorch's path under autocast keeps the same copy for its backward). A second backward of the
    # same graph (retain_graph), which has no forward state, converts again and gives the same gradients.
    from cce_autotune.runtime import execute

    made = []
    real = execute.fwd.converted_classifier
    monkeypatch.setattr(execute.fwd, "converted_classifier", lambda c, dtype: made.append(1) or real(c, dtype))
    e, _, t, _ = make_inputs((29,), 97, 40, torch.bfloat16, device=device)
    _, c, _, _ = make_inputs((29,), 97, 40, torch.float32, device=device)
    ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
    loss = linear_cross_entropy(ee, cc, t, impl="triton", variants=SMALL, filter_eps=None)
    loss.backward(retain_graph=True)
    assert len(made) == 1
    first = (ee.grad.clone(), cc.grad.clone())
    ee.grad = cc.grad = None
    loss.backward()
    assert len(made) == 2
    assert torch.equal(ee.grad, first[0]) and torch.equal(cc.grad, first[1])
    e16, c2 = e.clone().requires_grad_(), c.to(torch.bfloat16).float().requires_grad_()
    ref = linear_cross_entropy(e16, c2, t, impl="triton", variants=SMALL, filter_eps=None)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(ee.grad, e16.grad)
    # A copy that is not the plan's (here in fp32: not e's dtype) is refused, not read.
    real_backward = execute.backward
    monkeypatch.setattr(execute, "backward", lambda *a, classifier=None, **k: real_backward(
        *a, classifier=None if classifier is None else classifier.float(), **k))
    loss = linear_cross_entropy(e.clone().requires_grad_(), c.clone().requires_grad_(), t, impl="triton",
                                variants=SMALL, filter_eps=None)
    with pytest.raises(ValueError, match="^classifier: "):
        loss.backward()


def test_bad_arguments_name_the_argument(device):
    e, c, t, _ = make_inputs((5,), 20, 8, torch.float32, device=device)
    cases = [
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
        (dict(z_loss=-1e-4), ValueError, "z_loss"),
        (dict(token_weights=torch.ones(4)), ValueError, "token_weights"),
        (dict(token_weights=torch.ones(5, dtype=torch.int64)), TypeError, "token_weights"),
        (dict(token_weights=[1.0] * 5), TypeError, "token_weights"),
    ]
    for kw, exc, name in cases:
        with pytest.raises(exc, match=name):
            linear_cross_entropy(e, c, t, **kw)
    with pytest.raises(TypeError, match="^c: "):
        linear_cross_entropy(e.to(torch.bfloat16), c.to(torch.float16), t)
    with pytest.raises(TypeError, match="^c: "):
        linear_cross_entropy(e, c.to(torch.bfloat16), t)  # a classifier narrower than e


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_non_finite_values_at_ignored_positions_stay_out(impl, device):
    # An all-padding sequence's token weights are 1/0 (inf or NaN) at its ignored positions, and an
    # upstream gradient may be infinite there with reduction="none": both are selected out, not
    # multiplied by zero, so the loss and every gradient stay finite, as PyTorch's.
    e, c, t, _ = make_inputs((2, 9), 40, 16, torch.float32, device=device)
    t = t.clone()
    t[1] = -100  # the second sequence is padding
    w = torch.ones(2, 9, device=device)
    w[1] = float("inf")
    w[1, 3] = float("nan")
    kw = dict(impl=impl, variants=SMALL, filter_eps=None)
    loss, (ge, gc) = grads_of(lambda e_, c_: linear_cross_entropy(e_, c_, t, token_weights=w, **kw), e, c)
    ref, (re, rc) = grads_of(lambda e_, c_: terms_loss(e_, c_, t, token_weights=torch.where(t != -100, w, 0.0)),
                             e.double(), c.double())
    assert torch.isfinite(loss) and rel_err(loss.detach(), ref.detach()) < 1e-5
    assert rel_err(ge, re) < 1e-5 and rel_err(gc, rc) < 1e-5
    ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
    rows = linear_cross_entropy(ee, cc, t, reduction="none", **kw)
    upstream = torch.ones_like(rows)
    upstream[1] = float("inf")  # at the ignored rows only
    rows.backward(upstream)
    assert torch.isfinite(rows).all() and torch.isfinite(ee.grad).all() and torch.isfinite(cc.grad).all()
    assert ee.grad[1].abs().max() == 0


@pytest.mark.parametrize("softcap", [1e5, 1e6, 1e8])
def test_large_softcaps_keep_the_logits(softcap, device):
    # softcap * tanh(z / softcap) ~ z for a large softcap: tanh as 2 * sigmoid(2x) - 1 cancels there
    # (every logit 0 at 1e8); the kernels' tanh keeps its relative accuracy near 0.
    e, c, t, b = make_inputs((23,), 70, 16, torch.float32, bias=True, seed=5, device=device)
    res = compare(e, c, t, b, torch.float32, impl="triton", softcap=softcap)
    for name, (err, tol) in res.items():
        assert err < 1e-5, (name, err, tol)


def _same(a, b, rtol=0.0):
    """Equal (NaN where the other is NaN), to ``rtol`` where given."""
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=0.0, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("terms", [dict(), dict(label_smoothing=0.1, z_loss=1e-3)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("clean", [True, False])
def test_row_kernels_compute_what_the_pytorch_path_does(reduction, terms, weighted, clean, device):
    # The kernels' path reduces the loss (execute.reduce_loss) and forms the gradient's coefficients
    # (Call.coefficients) in one launch each (strategies.rows): the same per-row values as the PyTorch
    # path's element-wise ops (the same bits), the same sum to fp32 rounding, over several blocks of
    # rows; with rows that are ignored, out of range (NaN), with an infinite LSE (NaN), an incoming
    # gradient per row or a scalar, with and without the LSE's own gradient.
    from cce_autotune.options import Options
    from cce_autotune.runtime import execute
    from cce_autotune.runtime.call import prepare
    from cce_autotune.strategies.rows import ROWS_BLOCK

    g = torch.Generator().manual_seed(5)
    B, T, V, D = 2, ROWS_BLOCK + 77, 40, 8
    t = torch.randint(0, V + (0 if clean else 3), (B, T), generator=g)
    t[torch.rand(B, T, generator=g) < 0.2] = -100
    tw = torch.rand(B, T, generator=g)
    tw[t == -100] = float("nan")  # (never reaches the loss or the gradients)
    o = Options.check(reduction=reduction, **terms)
    t, tw = t.to(device), tw.to(device)
    e, c = torch.zeros(B, T, D, device=device), torch.zeros(V, D, device=device)
    ours, ref = (prepare(e, c, t, None, tw if weighted else None, o, impl) for impl in ("triton", "torch"))
    n = ours.n_rows
    lse = (torch.randn(n, generator=g) * 3 + 5).to(device)
    if not clean:
        lse[3], lse[7] = float("inf"), -float("inf")
    zt, zsum = (torch.randn(n, generator=g) * s for s in (1.0, 10.0))
    zt, zsum = zt.to(device), zsum.to(device)
    (loss, lse_out), (loss_ref, lse_ref) = (execute.reduce_loss(x, lse, zt, zsum) for x in (ours, ref))
    assert _same(lse_out, lse_ref)
    assert _same(loss, loss_ref, rtol=0.0 if reduction == "none" else 1e-6)
    assert bool(torch.isfinite(loss).all()) == clean
    if reduction == "mean":
        assert _same(ours.denominator(), ref.denominator(), rtol=1e-6)
    grad = torch.randn(loss.shape, generator=g).to(device)
    expanded = torch.ones((), device=device).expand(loss.shape)  # (strides 0: loss.sum()'s gradient)
    for grad_loss, grad_lse in ((grad, None), (expanded, None), (grad, torch.randn(n, generator=g).to(device)),
                                (None, torch.ones((), device=device).expand(n))):
        a = ours.coefficients(grad_loss, grad_lse, lse_out)
        b = ref.coefficients(grad_loss, grad_lse, lse_ref)
        for name, x, y in zip(("coef_s", "coef_t", "coef_u", "lse_v"), a, b):
            assert (x is None) == (y is None), name
            if x is not None:  # ("mean" divides by the denominator, summed in another order)
                assert _same(x, y, rtol=1e-6 if reduction == "mean" else 0.0), name
        assert (a[0] is a[1]) == (not terms and grad_lse is None)

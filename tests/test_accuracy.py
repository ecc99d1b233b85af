"""The measured filter check (cce_autotune.planning.accuracy): its estimate against a brute-force oracle
and against the kernels' own error, and the choice the planner remembers per classifier."""

import math

import pytest
import torch

from cce_autotune import linear_cross_entropy, memory
from cce_autotune.planning import accuracy, costs, explain, filters, planner
from cce_autotune.plans import CallProblem
from helpers import NO_CHUNK_HOST, grads_of, make_inputs, rel_err, torch_loss
from test_loss import prime_order
from test_tile_map import MAPPED, _forward_map


def _brute_force(e, c, bias, t, lse, softcap, tile, block_b, eps, cs, ct):
    """float64: ||dE of the softmax terms in tiles whose whole row block stays below eps|| / ||dE||,
    for the gradient cs * softmax - ct * onehot."""
    z = e @ c.T + (bias if bias is not None else 0)
    th = torch.tanh(z / softcap) if softcap else None
    if softcap:
        z = softcap * th
    p = torch.exp(z - torch.where(torch.isfinite(lse), lse, 0)[:, None]) * torch.isfinite(lse)[:, None]
    d = 1 - th * th if softcap else torch.ones_like(p)
    g = p * cs[:, None]
    g[torch.arange(len(t)), t] -= torch.isfinite(lse).double() * ct
    g = g * d
    dead = torch.zeros_like(p, dtype=torch.bool)
    for b0 in range(0, e.shape[0], block_b):
        for k in range(int(tile.max()) + 1):
            cols = tile == k
            if p[b0 : b0 + block_b][:, cols].max() < eps:
                dead[b0 : b0 + block_b, cols] = True
    return float(((p * cs[:, None] * d * dead) @ c).norm() / (g @ c).norm())


def _dead_tiles(p, tile, block_b, eps_list):
    """(candidates, rows, tiles) bool: the tiles (``tile``: each column's) whose softmax ``p`` stays
    below each filter over a whole block of ``block_b`` rows."""
    n = p.shape[0]
    tmax = torch.zeros(n // block_b, int(tile.max()) + 1, dtype=p.dtype)
    tmax.scatter_reduce_(1, tile.expand(n // block_b, -1), p.view(n // block_b, block_b, -1).amax(1), reduce="amax")
    return torch.stack([(tmax < x).repeat_interleave(block_b, dim=0) for x in eps_list])


@pytest.mark.parametrize("softcap, with_bias", [(None, False), (30.0, True)])
def test_filter_errors_against_brute_force(softcap, with_bias):
    torch.manual_seed(0)
    n, V, D, bb, bv = 48, 200, 24, 4, 8
    e, c = torch.randn(n, D, dtype=torch.float64), 1.5 * torch.randn(V, D, dtype=torch.float64)
    t = torch.randint(0, V, (n,))
    bias = 0.1 * torch.randn(V, dtype=torch.float64) if with_bias else None
    z = e @ c.T + (bias if bias is not None else 0)
    lse = torch.logsumexp(softcap * torch.tanh(z / softcap) if softcap else z, 1)
    lse[5] = math.inf  # an ignored row: no gradient, dropped or not
    perm = torch.randperm(V).to(torch.int32)
    tile = accuracy.column_tiles(V, bv, perm, "cpu")
    eps = [1e-2, 1e-4, 1e-5]
    p = torch.softmax(softcap * torch.tanh(z / softcap) if softcap else z, 1) * torch.isfinite(lse)[:, None]
    dead = _dead_tiles(p, tile, bb, eps)
    # Row coefficients as token weights / z-loss / label smoothing make them (the softmax and the
    # onehot parts apart).
    cs, ct = torch.rand(n, dtype=torch.float64) + 0.5, torch.rand(n, dtype=torch.float64)
    got = accuracy.filter_errors(e, c, bias, t, lse, softcap, tile, dead, cs, ct, chunk_v=64).tolist()
    want = [_brute_force(e, c, bias, t, lse, softcap, tile, bb, x, cs, ct) for x in eps]
    assert want[0] > 1e-3 and want[0] > want[1] > want[2]  # the data drops something at each filter
    assert got == pytest.approx(want, rel=1e-5, abs=1e-12)


def test_estimate_is_the_kernels_error(device, no_accuracy_guard, monkeypatch):
    # Every row sampled, fp32 inputs: the estimate from the forward's map is the error the mapped
    # backward's skipping puts into dE, measured against the float64 oracle (the chunked strategy
    # skips by the map alone; the tile strategies' own filter may skip a little more where the
    # forward's tiles are wider than the backward's, as here: there the estimate is a lower bound).
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked"))
    _, ref = grads_of(lambda e_, c_: torch_loss(e_, c_, t), e.double(), c.double())
    seen = {}
    real = planner.decide
    monkeypatch.setattr(planner, "decide", lambda *a, **k: (seen.update(tmap=a[3], lse=a[4]), real(*a, **k))[1])
    ee, cc = e.clone().requires_grad_(), c.clone()
    prime_order(cc, ee, "sorted")
    linear_cross_entropy(ee, cc, t, impl="triton", variants=kv).backward()
    actual = rel_err(ee.grad, ref[0])
    rows = torch.arange(64, device=device)
    tile = accuracy.column_tiles(512, kv.backward.block_v, seen["tmap"].perm, device)
    dead = accuracy.map_dead(seen["tmap"], seen["lse"], rows, [2.0**-6], 512, kv.backward.block_b, kv.backward.block_v)
    est = accuracy.filter_errors(e, c, None, t, seen["lse"], None, tile, dead).item()
    assert actual > 1e-3  # the filter drops something
    assert est == pytest.approx(actual, rel=0.05)


def _evidence(e, c, t, lse, tmap, rows):
    return planner.Evidence(e=e, c=c, bias=None, rows=rows, targets=t, lse=lse, softcap=None, tile_map=tmap,
                            coef_s=None, coef_t=None)


def _choose(e, c, t, lse, tmap, rows, eps, scales, admissible=None, check_every=32):
    """The planner's choice of a filter on the rungs of the ladder that ``scales`` name."""
    rungs = [filters.LADDER.index(s) for s in scales]
    return planner.check_filter(_evidence(e, c, t, lse, tmap, rows), eps, 16, 16,
                                costs.builtin().replace(check_every=check_every), rungs=rungs, admissible=admissible)


def test_choice_is_remembered_and_measured_again(device, monkeypatch):
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    lse, tmap = _forward_map(e, c, t, MAPPED.lse_forward)
    rows = torch.arange(64, device=device)
    calls = []
    real = accuracy.filter_fit
    monkeypatch.setattr(accuracy, "filter_fit", lambda *a, **k: (calls.append(a[7].shape[0]), real(*a, **k))[1])
    monkeypatch.setattr(filters, "MAX_ERROR", 1e-4)

    def choose(eps):
        return _choose(e, c, t, lse, tmap, rows, eps, (1.0, 2.0**-4, 2.0**-8), check_every=3)[:2]

    eps, measured = choose(2.0**-6)
    assert eps in (2.0**-10, 2.0**-14) and calls == [1, 2]  # own filter fails, the rest measured
    assert [m[0] for m in measured] == [2.0**-6, 2.0**-10, 2.0**-14]
    assert measured[0][1] > 1e-4 and {m[0]: m[1] for m in measured}[eps] <= 1e-4  # what failed and what passed
    for _ in range(3):  # remembered for CHECK_EVERY calls, then measured again
        assert choose(2.0**-6) == (eps, ())
    assert choose(2.0**-6)[0] == eps and len(calls) == 4
    eps, measured = choose(2.0**-20)
    assert eps == 2.0**-20 and len(measured) == 1  # another filter asked: measured (and it passes)
    monkeypatch.setattr(filters, "MAX_ERROR", -1.0)  # nothing passes
    memory.clear()
    assert choose(2.0**-6)[0] is None and len(choose(2.0**-6)[1]) == 3  # exact is never remembered
    monkeypatch.setattr(filters, "MAX_ERROR", math.inf)
    n = len(calls)
    assert choose(2.0**-6) == (2.0**-6, ()) and len(calls) == n  # the check off: nothing measured


def test_candidates_are_measured_in_groups_until_one_passes(device, monkeypatch):
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    lse, tmap = _forward_map(e, c, t, MAPPED.lse_forward)
    rows = torch.arange(64, device=device)
    monkeypatch.setattr(filters, "GROUP", 2)
    monkeypatch.setattr(filters, "LADDER", tuple(2.0**-k for k in range(7)))
    scales = filters.LADDER
    full = {m[0]: m[1] for m in _choose(e, c, t, lse, tmap, rows, 2.0**-4, (1.0,))[1]}
    for k in range(7):  # every candidate's error, one at a time
        memory.clear()
        full.update({m[0]: m[1] for m in _choose(e, c, t, lse, tmap, rows, 2.0**-4 * scales[k], (1.0,))[1]})
    errs = [full[2.0**-4 * s] for s in scales]
    assert errs[0] > 0 and errs == sorted(errs, reverse=True)  # smaller filters drop less
    wants = [k for k in range(7) if k == 0 or errs[k] < errs[k - 1]]
    assert len(wants) >= 4, errs
    for want in wants:  # a limit that the want-th candidate is the first to meet
        monkeypatch.setattr(filters, "MAX_ERROR", (errs[want] + (errs[want - 1] if want else 1.0)) / 2)
        memory.clear()
        eps, measured, _ = _choose(e, c, t, lse, tmap, rows, 2.0**-4, scales)
        assert eps == 2.0**-4 * scales[want]
        groups = 1 if want == 0 else 1 + -(-want // 2)  # own filter, then pairs up to the one that passed
        assert len(measured) == min(7, 1 + 2 * (groups - 1))
        for m_eps, m_err, _ in measured:
            assert m_err == pytest.approx(full[m_eps], rel=1e-5)


def test_candidates_the_guard_rejects_are_not_measured(device, monkeypatch):
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    lse, tmap = _forward_map(e, c, t, MAPPED.lse_forward)
    rows = torch.arange(64, device=device)
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)  # every measured candidate passes
    scales = (1.0, 0.5, 0.25, 0.125)
    asked = []
    eps, measured, _ = _choose(e, c, t, lse, tmap, rows, 2.0**-4, scales,
                               admissible=lambda x: (asked.append(x), x < 2.0**-5)[1])
    assert eps == 2.0**-6 and [m[0] for m in measured] == [2.0**-6, 2.0**-7]  # 2^-4, 2^-5 not measured
    assert asked == [2.0**-4, 2.0**-5, 2.0**-6, 2.0**-7]
    memory.clear()
    eps, measured, _ = _choose(e, c, t, lse, tmap, rows, 2.0**-4, scales, admissible=lambda x: False)
    assert eps is None and measured == ()  # none may run: exact


def test_guard_lowering_the_checked_filter_drops_the_correction(device, monkeypatch, set_costs, planned):
    e, c, t = _clustered()
    e, c, t = e.to(device), c.to(device), t.to(device)
    eps = 2.0**-6
    u = torch.ones(e.shape[1], device=device)
    monkeypatch.setattr(planner, "check_filter", lambda *a, **k: (eps, (), u))  # a remembered corrected choice
    # the guard's bound: too much at the checked filter, nothing 16x below it
    def bound(x):
        return torch.tensor(1.0 if x > 2.0**-8 else 0.0, device=device)

    real = planner.measure
    monkeypatch.setattr(planner, "measure", lambda tm, lse, x, *a: (real(tm, lse, x, *a)[0], bound(x)))
    monkeypatch.setattr(planner, "dropped_share", lambda tm, lse, x: bound(x))
    set_costs(pause_share=math.inf)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=eps, strategy="auto"))
    ee, cc = e.clone().requires_grad_(), c.clone()
    prime_order(cc, ee, "sorted")
    linear_cross_entropy(ee, cc, t, impl="triton", variants=kv).backward()
    plan, d = planned[-1].call.backward, planned[-1].call.correction
    assert plan.use_map and plan.filter_eps == eps / 16  # filtered, at the lowered filter
    assert d is None and "no dead-tile correction at the lowered filter" in plan.reason


def test_exact_verdict_runs_exact_and_pauses_the_classifier(device, monkeypatch, planned):
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6))
    monkeypatch.setattr(filters, "MAX_ERROR", -1.0)  # nothing passes
    ee, cc = e.clone().requires_grad_(), c.clone()
    prime_order(cc, ee, "sorted")
    linear_cross_entropy(ee, cc, t, impl="triton", variants=kv).backward()
    eps, plan = planned[-1].call.run_eps, planned[-1].call.backward
    assert eps is None and not plan.use_map and "measured" in plan.reason
    assert memory.take_pause(cc)  # the next forwards neither walk nor map until the next check


def test_explain_all_prints_the_measured_errors(monkeypatch, capsys):
    p = CallProblem(n=8, n_all=8, V=100, D=4, elem=2, grad_bytes=0)
    monkeypatch.setenv(explain.ENV_EXPLAIN, "1")
    explain.report_check(p, ((2.0**-16, 8e-3, False),), 7e-3)
    assert capsys.readouterr().err == ""  # only with =all
    monkeypatch.setenv(explain.ENV_EXPLAIN, "all")
    explain.report_check(p, (), 7e-3)
    explain.report_check(p, ((2.0**-16, 8e-3, False), (2.0**-20, 4.5e-3, True)), 7e-3)
    assert capsys.readouterr().err == ("cce_autotune check (n=8, V=100, D=4): dE error 8.00e-03 at 1.5e-05, "
                                       "4.50e-03 at 9.5e-07 corrected (limit 0.007)\n")


def test_check_chunks_stay_within_their_memory_and_do_not_change_the_estimate():
    cap = costs.builtin().check_bytes
    for rows, m, V in ((256, 1, 262144), (256, 2, 128256), (8192, 1, 50257), (16, 1, 300)):
        w = accuracy.chunk_columns(rows, m, V, cap)
        assert w & (w - 1) == 0 and 256 <= w <= 16384
        assert w == 256 or rows * w * (18 + 11 * m) <= cap
        assert w == 16384 or w >= V or 2 * rows * w * (18 + 11 * m) > cap  # the largest that fits
    assert accuracy.chunk_columns(256, 1, 262144, cap) == 8192
    torch.manual_seed(1)
    n, V, D = 32, 700, 16
    e, c = torch.randn(n, D, dtype=torch.float64), 2 * torch.randn(V, D, dtype=torch.float64)
    t = torch.randint(0, V, (n,))
    lse = torch.logsumexp(e @ c.T, 1)
    tile = accuracy.column_tiles(V, 16, None, "cpu")
    dead = torch.rand(2, n, int(tile.max()) + 1) < 0.5
    got = [accuracy.filter_errors(e, c, None, t, lse, None, tile, dead, chunk_v=w)
           for w in (64, 256, accuracy.chunk_columns(n, 2, V, cap))]
    assert torch.allclose(got[0], got[1]) and torch.allclose(got[0], got[2])


# -- the dead-tile correction -----------------------------------------------------------------
def _clustered(n=64, V=512, D=32, seed=0, dtype=torch.float32):
    """Inputs whose last V - 128 classifier rows sit close together, away from the rows' direction:
    a trained classifier's rarely used rows. A filter drops their tiles, and what it drops points
    one way."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, D, generator=g)
    c = torch.randn(V, D, generator=g) * 0.6
    mu = torch.randn(D, generator=g) * 0.3 - 0.4 * e.mean(0) / e.mean(0).norm()
    c[128:] = mu + 0.05 * torch.randn(V - 128, D, generator=g)
    t = torch.randint(0, 128, (n,), generator=g)
    return e.to(dtype), c.to(dtype), t


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_corrected_error_against_brute_force(softcap):
    e, c, t = _clustered(dtype=torch.float64)
    n, V, bb, bv = e.shape[0], c.shape[0], 4, 8
    z = e @ c.T
    th = torch.tanh(z / softcap) if softcap else None
    zz = softcap * th if softcap else z
    lse = torch.logsumexp(zz, 1)
    lse[5] = math.inf  # an ignored row
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    tile = accuracy.column_tiles(V, bv, perm, "cpu")
    valid = torch.isfinite(lse).double()
    p = torch.softmax(zz, 1) * valid[:, None]
    eps = [2.0**-6, 2.0**-9]
    dead = _dead_tiles(p, tile, bb, eps)
    cs, ct = torch.rand(n, dtype=torch.float64) + 0.5, torch.rand(n, dtype=torch.float64)
    raw, corr, direction = accuracy.filter_fit(e, c, None, t, lse, softcap, tile, dead, cs, ct, chunk_v=64)
    sd = 1 - th * th if softcap else torch.ones_like(p)
    g = p * cs[:, None] * sd
    g[torch.arange(n), t] -= valid * ct * sd[torch.arange(n), t]
    whole = (g @ c).norm()
    for k in range(len(eps)):
        mask = dead[k][:, tile].double()  # (rows, V)
        drop = (p * cs[:, None] * sd * mask) @ c  # what the filter drops, per row
        a = (p * cs[:, None] * mask).sum(1)  # the mass the correction scales (no softcap derivative)

        def fit(r):
            return (a[r, None] * drop[r]).sum(0) / (a[r] * a[r]).sum()

        ev, od = torch.arange(0, n, 2), torch.arange(1, n, 2)
        left = ((drop[ev] - a[ev, None] * fit(od)) ** 2).sum() + ((drop[od] - a[od, None] * fit(ev)) ** 2).sum()
        assert raw[k].item() == pytest.approx(float(drop.norm() / whole), rel=1e-5)
        assert corr[k].item() == pytest.approx(float(left.sqrt() / whole), rel=1e-4)
        assert direction[k].double() == pytest.approx(fit(torch.arange(n)), rel=1e-4, abs=1e-9)
    assert raw[1] > 1e-2 and corr[1] < raw[1] / 4  # the clustered rows' dropped terms point one way


@pytest.mark.parametrize("shifted", [False, True])
def test_chunked_backward_adds_the_dead_mass_along_the_direction(device, no_accuracy_guard, monkeypatch, shifted):
    e, c, t = _clustered()
    e, c, t = e.to(device), c.to(device), t.to(device)
    kw = {}
    if shifted:  # a (2, 32) batch, each position predicting the next token, two targets ignored: gathered rows
        # (batch dimensions that do not flatten keep the shift: see test_a_shift_runs_as_ignored_targets...)
        e, t = e.view(32, 2, -1).transpose(0, 1), t.view(2, 32).clone()
        t[0, 5] = t[1, 20] = -100
        kw = dict(shift=1)
    eps = 2.0**-6
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=eps, strategy="chunked"))
    u = torch.randn(e.shape[1], generator=torch.Generator().manual_seed(3)).to(device)
    seen, grads = {}, []
    real = planner.decide
    monkeypatch.setattr(planner, "decide", lambda *a, **k: (seen.update(tmap=a[3], lse=a[4]), real(*a, **k))[1])
    for direction in (None, u):
        monkeypatch.setattr(planner, "check_filter", lambda *a, d=direction, **k: (eps, (), d))
        ee, cc = e.clone().requires_grad_(), c.clone()
        prime_order(cc, ee, "sorted")
        linear_cross_entropy(ee, cc, t, impl="triton", variants=kv, **kw).backward()
        grads.append(ee.grad.double().reshape(-1, e.shape[-1]))
    bb, bv = kv.backward.block_b, kv.backward.block_v
    V, D = c.shape[0], e.shape[-1]
    # the problem's positions: the rows of E that predict a target, and those targets
    rows = torch.arange(e.numel() // D, device=device)
    tgt = t.reshape(-1)
    if shifted:
        rows, tgt = rows.view(2, 32)[:, :-1].reshape(-1), t[:, 1:].reshape(-1)
    lse = seen["lse"]
    assert lse.shape[0] == rows.shape[0] and int(torch.isinf(lse).sum()) == (2 if shifted else 0)
    n_valid = int((tgt != -100).sum())
    dead = accuracy.map_dead(seen["tmap"], lse, torch.arange(rows.shape[0], device=device), [eps], V, bb, bv)[0]
    mask = dead[:, accuracy.column_tiles(V, bv, seen["tmap"].perm, device)].double()
    p = torch.softmax(e.reshape(-1, D)[rows].double() @ c.double().T, 1) * (tgt != -100).double()[:, None]
    mass = (p * mask).sum(1)
    assert (mass > 1e-3).float().mean() > 0.5  # most rows have skipped tiles
    want = torch.zeros_like(grads[0])
    want[rows] = (mass / n_valid)[:, None] * u.double()[None, :]  # coef_s = 1/n_valid (mean)
    assert (grads[1] - grads[0] - want).norm() <= 1e-4 * want.norm()
    if shifted:  # the last position of each sequence and those predicting an ignored target get nothing
        for r in (31, 63, 4, 51):
            assert (grads[1][r] - grads[0][r]).abs().max() == 0


def test_check_takes_the_correction_where_the_plain_filter_is_not_accurate(device, monkeypatch, set_costs, planned):
    e, c, t = _clustered()
    e, c, t = e.to(device), c.to(device), t.to(device)
    eps = 2.0**-6
    monkeypatch.setattr(filters, "CHECK_RUNGS", (0,))  # the call's own filter, or exact
    set_costs(max_dropped=math.inf,  # the check alone
              pause_share=math.inf)  # filtering pays whatever the cost model says
    _, ref = grads_of(lambda e_, c_: torch_loss(e_, c_, t), e.double(), c.double())

    def run(limit, **kw):
        monkeypatch.setattr(filters, "MAX_ERROR", limit)
        memory.clear()
        kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=eps, strategy="auto"))
        ee, cc = e.clone().requires_grad_(), c.clone()
        prime_order(cc, ee, "sorted")
        linear_cross_entropy(ee, cc, t, impl="triton", variants=kv, **kw).backward()
        return rel_err(ee.grad, ref[0]), (planned[-1].call.backward, planned[-1].call.correction)

    plain, (plan, d) = run(math.inf)  # the check off: the plain filter
    assert plan.use_map and d is None and plain > 1e-2
    fixed, (plan, d) = run(plain / 3)
    assert plan.use_map and plan.strategy == "chunked" and d is not None and "dead-tile correction" in plan.reason
    assert fixed < plain / 5
    _, (plan, d) = run(plain / 3, deterministic=True)  # no correction there: the call runs exact
    assert not plan.use_map and d is None


@pytest.mark.parametrize("cheaper", ["plain", "corrected"])
def test_the_planner_weighs_the_corrected_filter_against_a_smaller_plain_one(cheaper, device, monkeypatch,
                                                                              set_costs, planned):
    # Where the check's first passing filter needs the correction (only the chunked strategy takes it),
    # it goes on to the first filter that passes plain, and the planner runs whichever of the two its
    # cost model prices lower: the sparse strategy at the smaller filter, or the chunked one corrected.
    e, c, t = _clustered()
    e, c, t = e.to(device), c.to(device), t.to(device)
    eps = 2.0**-6
    _, ref = grads_of(lambda e_, c_: torch_loss(e_, c_, t), e.double(), c.double())
    slow = dict(chunk_ms=100.0, tile_chunk_ms=100.0) if cheaper == "plain" else \
        dict(sparse_per_live=1e3, **NO_CHUNK_HOST)  # (no host time: tiny)
    set_costs(max_dropped=math.inf, pause_share=math.inf, **slow)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=eps, strategy="auto"))

    def run(limit):
        monkeypatch.setattr(filters, "MAX_ERROR", limit)
        memory.clear()
        ee, cc = e.clone().requires_grad_(), c.clone()
        prime_order(cc, ee, "sorted")
        linear_cross_entropy(ee, cc, t, impl="triton", variants=kv).backward()
        return rel_err(ee.grad, ref[0]), planned[-1].call

    plain, call = run(math.inf)  # the check off: the plain filter at eps
    assert call.run_eps == eps and call.correction is None
    limit = plain / 3
    from cce_autotune.planning import planner

    decided = []
    decide = planner.decide
    monkeypatch.setattr(planner, "decide", lambda *a, **k: decided.append(1) or decide(*a, **k))
    err, call = run(limit)
    assert len(decided) == 2  # the two weighed plans; the winner is not decided (nor copied) again
    measured = {m[0]: (m[1], m[2]) for m in call.checked}
    assert measured[eps][1], measured  # eps passes only corrected ...
    smaller = [x for x, (_, fixed) in measured.items() if x < eps and not fixed and measured[x][0] <= limit]
    assert smaller, measured  # ... and a smaller filter passes plain
    if cheaper == "plain":
        assert call.run_eps == max(smaller) and call.correction is None and call.backward.strategy == "sparse"
    else:
        assert call.run_eps == eps and call.correction is not None and call.backward.strategy == "chunked"
    assert err < limit, (err, limit)


def test_without_a_weighing_the_check_stops_at_the_corrected_filter(device, monkeypatch):
    # (The shards of a vocabulary-parallel call take the corrected filter, all alike: nothing there
    # asks for the plain alternative, and the check measures no further than the first that passes.)
    e, c, t = _clustered()
    e, c, t = e.to(device), c.to(device), t.to(device)
    lse, tmap = _forward_map(e, c, t, MAPPED.lse_forward)
    ev = planner.Evidence(e=e, c=c, bias=None, rows=torch.arange(e.shape[0], device=device), targets=t, lse=lse,
                          softcap=None, tile_map=tmap, coef_s=None, coef_t=None)
    model = costs.builtin()
    plain_err = accuracy.check(e, c, None, ev.rows, t, lse, None, tmap, 16, 16, [2.0**-6], sample=64,
                               max_bytes=model.check_bytes, max_error=math.inf)[1][0][1]
    monkeypatch.setattr(filters, "MAX_ERROR", plain_err / 3)
    monkeypatch.setattr(filters, "GROUP", 1)
    runs = {}
    for name, cheaper in (("none", None), ("plain cheaper", lambda corrected, plain: False)):
        memory.clear()
        runs[name] = planner.check_filter(ev, 2.0**-6, 16, 16, model, correctable=True, cheaper=cheaper)
    eps, measured, direction = runs["none"]
    assert eps == 2.0**-6 and direction is not None and len(measured) == 1
    eps, measured, direction = runs["plain cheaper"]
    assert eps < 2.0**-6 and direction is None and len(measured) > 1 and not measured[-1][2]


# -- what is remembered is a hint: only calls like the one measured reuse a verdict ---------------
def _mapped_call(e, c, t, kv, storage=None, **kw):
    """dE of a mapped call on rows ``e``. ``storage``: None, the rows cloned (wherever the allocator puts
    them); a dict, copied into its one leaf of their shape (the same storage at every call, as a
    training loop's activations get from a GPU's caching allocator); a list, cloned and kept in it (new
    storage at every call, as the CPU's allocator mostly gives)."""
    if isinstance(storage, dict):
        ee = storage.get((e.shape, e.dtype))
        if ee is None:  # (made once: an allocation a call would move the allocator's state between calls)
            ee = storage[(e.shape, e.dtype)] = torch.empty_like(e).requires_grad_()
        ee.grad = None
        with torch.no_grad():
            ee.copy_(e)
    else:
        ee = e.clone().requires_grad_()
        if storage is not None:
            storage.append(ee)
    linear_cross_entropy(ee, c, t, impl="triton", variants=kv, **kw).backward()
    return ee.grad


@pytest.mark.parametrize("rows", ["new storage", "same storage"])
def test_another_classifier_at_the_same_storage_is_measured_afresh(device, monkeypatch, set_costs, planned, rows):
    # load_state_dict copies in place, and the caching allocator reuses addresses: the storage is the
    # same, the classifier is not. Its verdict (and correction) must not carry over. Rows at new
    # storage: the call reads back, sees the fingerprint differ and is checked. Rows at the same
    # storage (a GPU's training loop): the call is planned on the previous call's measurements with
    # nothing read back, its fingerprint fails on the device and every tile is live (exact gradients);
    # the next call is checked.
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=1.0, seed=5, device=device)
    _, other, _, _ = make_inputs((64,), 512, 32, torch.float32, seed=9, device=device)
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)  # every filter passes: the verdict is the call's own
    set_costs(max_dropped=math.inf, pause_share=math.inf)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6))
    cc = c.clone()
    prime_order(cc, e, "sorted")
    storage = {} if rows == "same storage" else []
    for _ in range(2):
        _mapped_call(e, cc, t, kv, storage)
    assert planned[-2].call.checked and not planned[-1].call.checked  # measured, then reused
    cc.copy_(other)  # another classifier, in place
    _mapped_call(e, cc, t, kv, storage)
    call = planned[-1].call
    if rows == "same storage":
        assert "nothing read back" in call.backward.reason and not call.checked
        assert call.live is not None and bool(call.live.all()), "a verdict measured on another classifier was reused"
        _mapped_call(e, cc, t, kv, storage)
    assert planned[-1].call.checked, "a verdict measured on another classifier was reused"
    _mapped_call(e, cc, t, kv, storage)
    assert not planned[-1].call.checked  # ... and its own verdict is reused in turn


def _two_losses(device, monkeypatch, set_costs):
    """``(c, variants, (e, t), (e2, t2))``: a classifier with a remembered order and the rows of two
    losses on it (peaked, flat); every filter passes the check and nothing pauses."""
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=2.0, seed=5, device=device)
    e2, _, t2, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.0, seed=6, device=device)
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)
    set_costs(max_dropped=math.inf, pause_share=math.inf)
    prime_order(c, e, "sorted")
    return c, MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6)), (e, t), (e2, t2)


def test_two_losses_on_one_classifier_keep_their_own_verdicts(device, monkeypatch, set_costs, planned):
    # An auxiliary loss on the same lm_head: its rows' softmax falls otherwise in the dead tiles, so
    # the verdict measured on one loss's rows is never applied to the other's, and each keeps its own.
    c, kv, (e, t), (e2, t2) = _two_losses(device, monkeypatch, set_costs)
    measured = []
    for rows, targets in ((e, t), (e2, t2), (e, t), (e2, t2), (e, t)):
        _mapped_call(rows, c, targets, kv)
        measured.append(bool(planned[-1].call.checked))
    assert measured == [True, True, False, False, False], measured


@pytest.mark.parametrize("rows", ["new storage", "same storage"])
def test_a_call_that_reuses_a_verdict_reads_back_once(device, monkeypatch, set_costs, planned, rows):
    # The verdict's fingerprint rides on the planner's one copy (the live grid's counts): planning a
    # call that reuses the classifier's latest verdict reads the device once. Where the latest does not
    # match (another loss's rows on the same classifier) the call is checked, or decided again at an
    # older verdict that matches: a second copy, no check. Rows at the same storage (a GPU's training
    # loop): from the third call on, a call like the previous one is planned on its measurements and
    # reads nothing; the other loss's call fails its fingerprint on the device and runs every tile (it
    # is not checked), and the call after it reads back once, at the verdict that matches.
    from cce_autotune.planning import planner

    c, kv, (e, t), (e2, t2) = _two_losses(device, monkeypatch, set_costs)
    real_plan = planner.plan_gradients
    reads = []

    def counting(*a, **k):
        reads.append(0)
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "__float__", "__bool__", "__int__"):
                def read(self, *x, _real=getattr(torch.Tensor, name), **y):
                    reads[-1] += 1
                    return _real(self, *x, **y)
                m.setattr(torch.Tensor, name, read)
            return real_plan(*a, **k)

    monkeypatch.setattr(planner, "plan_gradients", counting)
    checked, every_tile = [], []
    storage = {} if rows == "same storage" else []
    for x, targets in ((e, t), (e, t), (e, t), (e2, t2), (e, t)):
        _mapped_call(x, c, targets, kv, storage)
        checked.append(bool(planned[-1].call.checked))
        every_tile.append(bool(planned[-1].call.live.all()))
    if rows == "same storage":
        assert checked == [True, False, False, False, False]
        # (the one copy; nothing; nothing but the host's copy of the previous call's measurements, made
        # without a wait; that copy and the one copy)
        assert reads[1:] == [1, 0, 1, 2], reads
        assert every_tile[3] and not every_tile[2]  # (the other loss's rows: every tile, exact gradients)
        return
    assert checked == [True, False, False, True, False]
    assert reads[1] == reads[2] == 1, reads  # reused: the one copy
    assert reads[4] == 2, reads  # the other loss's verdict is the latest: decided again at its own
    assert reads[3] > 2  # checked: the check's own reads


def test_first_and_paused_calls_filter_nothing(device, planned):
    # Without a tile map nothing measures what a filter costs (nor skips by it): the call runs exact.
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="auto"))
    exact = _mapped_call(e, c, t, kv, filter_eps=None)
    first = _mapped_call(e, c, t, kv)
    assert planned[-1].call.run_eps is None and "no tile map" in planned[-1].call.backward.reason
    assert rel_err(first, exact) < 1e-5  # exact both (float atomics may order sums differently on a GPU)
    memory.pause(c, 1)
    paused = _mapped_call(e, c, t, kv)
    assert planned[-1].call.run_eps is None and rel_err(paused, exact) < 1e-5


def test_the_check_bounds_the_whole_calls_error_not_the_samples():
    # The check's error is the sampled rows' ratio raised by CONFIDENCE standard errors. Rows whose
    # dropped share is the same everywhere leave it as it is; where a few rows hold most of what a
    # filter drops (LM-like data near a filter's edge), a sample of 256 rows under-estimates the whole
    # call about half the time, the bound far less often.
    from cce_autotune.planning.filters import CONFIDENCE

    g = torch.Generator().manual_seed(0)
    w = torch.rand(4096, generator=g) + 0.5
    even = (3e-3**2 * w)[None]
    assert accuracy._bound(even, w, CONFIDENCE).item() == pytest.approx(3e-3, rel=1e-5)
    n = 100_000
    w_all = torch.rand(n, generator=g) + 0.5
    heavy = torch.rand(n, generator=g) < 0.01  # 1 % of the rows hold most of the dropped norm
    a_all = torch.where(heavy, 4e-3, 1e-6) * w_all * torch.rand(n, generator=g)
    truth = (a_all.sum() / w_all.sum()).sqrt().item()
    misses = {0.0: 0, CONFIDENCE: 0}
    for _ in range(300):
        idx = torch.randperm(n, generator=g)[:256]
        for z in misses:
            misses[z] += accuracy._bound(a_all[None, idx], w_all[idx], z).item() < truth
    assert misses[0.0] > 90 and misses[CONFIDENCE] < misses[0.0] / 2, misses


def test_a_call_like_the_previous_one_reads_nothing_back(device, monkeypatch, set_costs, planned):
    # A training loop's steady state: the call reuses the classifier's verdict, and its backward is
    # planned on the previous call's measurements (copied to the host without a wait), so it reads
    # nothing back; its gradients are those of the same call planned on its own. Rows whose fingerprint
    # does not match the verdict's (other rows in the same storage) are caught on the device: every
    # tile live, exact gradients, and the next call measures and checks afresh.
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=2.0, seed=5, device=device)
    flat, _, _, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.0, seed=6, device=device)
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)  # every filter passes: the verdict is the call's own
    set_costs(max_dropped=math.inf, pause_share=math.inf, tile_products=0.0)
    prime_order(c, e, "sorted")
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked"))
    real_plan, real_values = planner.plan_gradients, planner.Measurement.values
    reads, landing = [], []

    def counting(*a, **k):
        reads.append(0)
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "nonzero", "__float__", "__bool__", "__int__"):
                def read(self, *x, _real=getattr(torch.Tensor, name), **y):
                    reads[-1] += not landing  # (the previous call's copy, landed: read on the host)
                    return _real(self, *x, **y)
                m.setattr(torch.Tensor, name, read)
            return real_plan(*a, **k)

    def values(self):
        landing.append(1)
        try:
            return real_values(self)
        finally:
            landing.pop()

    monkeypatch.setattr(planner, "plan_gradients", counting)
    monkeypatch.setattr(planner.Measurement, "values", values)
    ee = e.clone().requires_grad_()  # (one storage for the rows, as a training loop's allocator gives)
    grads, unread = [], []
    for i in range(6):
        if i == 3:
            memory.remember_measured(c, None)  # this call reads its measurements back
        if i == 4:
            ee.data.copy_(flat)  # other rows at the same storage
        ee.grad = None
        linear_cross_entropy(ee, c, t, impl="triton", variants=kv).backward()
        plan = planned[-1].call
        assert plan.backward.use_map and plan.backward.tile_products and plan.run_eps == 2.0**-6
        unread.append("nothing read back" in plan.backward.reason)
        grads.append(ee.grad.clone())
        if i == 5:
            assert plan.checked  # the fingerprint failed on the device: checked afresh
    # The check's call, then the first call with a verdict's measurements, then the steady state.
    assert unread == [False, False, True, False, True, False], unread
    assert reads[2] == reads[4] == 0 and reads[1] >= 1 and reads[3] >= 1, reads
    torch.testing.assert_close(grads[2], grads[3], rtol=1e-6, atol=1e-9)
    ee.grad = None
    linear_cross_entropy(ee, c, t, impl="triton", variants=kv, filter_eps=None).backward()
    assert rel_err(grads[4], ee.grad) < 1e-5  # every tile live: exact
    assert rel_err(grads[5], ee.grad) > 1e-5  # the new verdict's filter skips tiles again


@pytest.mark.parametrize("launch_ms, readback_ms, unread", [(0.0, 0.6, True), (1.0, 0.0, False), (1.0, 1e3, True)],
                         ids=["launches free", "read-back free", "read-back dear"])
def test_a_steady_call_reads_back_where_launching_every_chunk_costs_more(launch_ms, readback_ms, unread, device,
                                                                         monkeypatch, set_costs, planned):
    # Planned on the previous call's measurements, the chunked loop launches every chunk (the host has
    # no list of the live ones); read back, it launches the live ones but the device waits for the
    # host. The planner prices both on the same shares and takes the cheaper.
    e, c, t, _ = make_inputs((64,), 1024, 32, torch.float32, peaked=4.0, seed=5, device=device)
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)
    set_costs(max_dropped=math.inf, pause_share=math.inf, tile_products=0.0, tile_chunk_ms=launch_ms,
              chunk_ms=2 * launch_ms, gather_chunk_ms=0.0, readback_ms=readback_ms)
    prime_order(c, e, "sorted")
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-3, strategy="chunked", chunk_v=64))
    ee = e.clone().requires_grad_()
    for _ in range(4):
        ee.grad = None
        linear_cross_entropy(ee, c, t, impl="triton", variants=kv).backward()
    plan = planned[-1].call.backward
    assert plan.use_map and plan.tile_products and 0 < plan.live_chunks < 1, plan.describe()
    assert ("nothing read back" in plan.reason) == unread, plan.reason


@pytest.mark.gpu
def test_a_steady_default_call_makes_no_host_sync(monkeypatch, set_costs, planned):
    # On the GPU: once a classifier's verdict and measurements are in place, a whole fw+bw call of the
    # default path waits for the device nowhere (torch's sync debug mode raises at any sync).
    e, c, t, _ = make_inputs((512,), 4096, 64, torch.bfloat16, peaked=2.0, seed=5, device="cuda")
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)
    set_costs(max_dropped=math.inf, pause_share=math.inf, tile_products=0.0)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked"))
    ee = e.clone().requires_grad_()
    for _ in range(4):
        ee.grad = None
        linear_cross_entropy(ee, c, t, variants=kv).backward()
    torch.cuda.synchronize()
    assert "nothing read back" in planned[-1].call.backward.reason
    ee.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_cross_entropy(ee, c, t, variants=kv).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert "nothing read back" in planned[-1].call.backward.reason
    assert torch.isfinite(ee.grad.float()).all()


@pytest.mark.parametrize("V, dtype", [(500, torch.bfloat16), (10, torch.float32)])
def test_the_fingerprint_on_the_device_is_its_definition(V, dtype, device):
    from cce_autotune.planning.planner import (Evidence, Fingerprint, _alike, _fingerprint_values, _probes,
                                               fingerprint_held, fingerprint_tensor)
    from cce_autotune.tile_map import TileMap

    gen = torch.Generator().manual_seed(V)
    n, D, sample = 300, 72, 64
    e = torch.randn(n + 5, D, generator=gen).to(device=device, dtype=dtype)
    c = torch.randn(V, D, generator=gen).to(device=device, dtype=dtype)
    rows = (torch.arange(n) + 3).flip(0).to(device)  # (E's rows of the problem's rows)
    zt = torch.randn(n, generator=gen).to(device)
    lse = zt + 1.0 + torch.rand(n, generator=gen).to(device)
    lse[7], lse[100] = float("inf"), float("nan")  # (an ignored row, a broken one: not counted)
    tmap = TileMap(q=torch.zeros((1, n), dtype=torch.int8, device=device), block_v=16,
                   perm=torch.arange(V, dtype=torch.int32, device=device), zt=zt)
    ev = Evidence(e=e, c=c, bias=None, rows=rows, targets=None, lse=lse, softcap=None, tile_map=tmap,
                  coef_s=None, coef_t=None)
    values = fingerprint_tensor(ev, sample)
    directions, probe_rows = _probes(D, V, device)
    idx = accuracy.sample_rows(n, sample).to(device)
    valid = torch.isfinite(lse[idx]).double()
    ref = torch.cat([c[probe_rows].double() @ directions[:, 0].double(),
                     (valid @ e[rows[idx]].double()) / valid.sum() @ directions.double(),
                     (torch.where(valid > 0, lse[idx].double() - zt[idx].double(), 0.0).sum() / valid.sum()).view(1)])
    assert values.shape == ref.shape and rel_err(values, ref) < 1e-5
    now = _fingerprint_values(values.tolist(), values)
    k = min(V, 16)
    for part, scale, alike in [(slice(0, k), 1.05, True), (slice(0, k), 1.2, False), (slice(k, k + 16), 1.2, True),
                               (slice(k, k + 16), 1.4, False), (slice(-1, None), 1.1, True), (slice(-1, None), 3.0, False),
                               (slice(0, 0), 1.0, True)]:
        moved = values.clone()
        moved[part] *= scale
        then = _fingerprint_values(moved.tolist(), moved)
        again, held = fingerprint_held(ev, sample, then)
        assert torch.equal(again, values)
        assert held.dtype == torch.bool and held.dim() == 0
        assert bool(held) == _alike(then, now) == alike, (part, scale)
    assert not bool(fingerprint_held(ev, sample, Fingerprint((), (), 0.0, None))[1])  # no device values: not alike
    empty = Evidence(e=e, c=c, bias=None, rows=rows[:0], targets=None, lse=lse[:0], softcap=None,
                     tile_map=TileMap(q=tmap.q[:, :0], block_v=16, perm=tmap.perm, zt=zt[:0]), coef_s=None, coef_t=None)
    none = fingerprint_tensor(empty, sample)  # (no rows: the probes alone, nothing read past the rows)
    assert torch.equal(none[:k], values[:k]) and not bool(none[k:].any())

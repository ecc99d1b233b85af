"""The forward's tile map, the backward's live-tile list and the remembered vocabulary orders."""

import dataclasses
import math

import pytest
import torch

from cce_autotune import BackwardVariant, LSEForwardVariant, linear_cross_entropy
from cce_autotune import memory
from cce_autotune.planning import costs, filters, planner
from cce_autotune.plans import CallProblem
from cce_autotune.strategies import forward
from cce_autotune.strategies.common import RowLayout
from cce_autotune.tile_map import TileMap, live_tiles
from helpers import NO_CHUNK_HOST, grads_of, make_inputs, rel_err, torch_loss, unwritten_is_nan
from test_loss import SMALL, assert_within, prime_order, run_case
from test_variants import assert_within_bound, filtered_bound

MAPPED = SMALL.replace(
    lse_forward=LSEForwardVariant(block_b=16, block_v=32, block_d=16, num_splits=3, group_b=2),
    backward=BackwardVariant(block_b=16, block_v=16, block_d=16, group_b=2, tile_map=True, strategy="chunked"),
)


def _sorted_perm(e, c):
    return torch.argsort(c.float() @ e.float().sum(0), descending=True).to(torch.int32)


def _forward_map(e, c, t, variant, softcap=None, bias=None, perm=None):
    rows = RowLayout.dense(e.shape[0], e.shape[1], e.device)
    zt = forward.indexed_dot(e, c, bias, rows, t, softcap, SMALL.indexed_dot)
    perm = _sorted_perm(e, c) if perm is None else perm
    lse, tmap = forward.lse_forward(e, c, bias, rows, softcap, variant, perm=perm, zt=zt)
    return lse, tmap


def _true_tile_max(e, c, bias, softcap, perm, block_v):
    """(tiles, rows) float64: each row's largest logit in each tile of the walked order."""
    z = e.double() @ c.double().T + (bias.double() if bias is not None else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z[:, perm.long()]
    T = -(-z.shape[1] // block_v)
    z = torch.nn.functional.pad(z, (0, T * block_v - z.shape[1]), value=-math.inf)
    return z.view(z.shape[0], T, block_v).amax(2).T


@pytest.mark.parametrize("softcap, with_bias", [(None, False), (6.0, True)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_forward_map_bounds_each_rows_tile_maximum_tightly(softcap, with_bias, num_splits, device):
    e, c, t, b = make_inputs((45,), 301, 40, torch.float32, bias=with_bias, peaked=1.5, seed=3, device=device)
    v = LSEForwardVariant(block_b=16, block_v=32, block_d=16, num_splits=num_splits)
    perm = _sorted_perm(e, c)
    lse, tmap = _forward_map(e, c, t, v, softcap=softcap, bias=b, perm=perm)
    assert tmap.q.dtype == torch.int8 and tmap.q.shape == (-(-301 // 32), 45) and tmap.block_v == 32
    assert tmap.perm is perm
    zmax = _true_tile_max(e, c, b, softcap, perm, 32)
    scaled = 8 * (zmax - tmap.zt.double()[None, :]) + 0.5
    q = tmap.q.double()
    unsaturated = (scaled > -127) & (scaled < 126)
    assert unsaturated.float().mean() > 0.5  # the test data exercises the bound, not only the clamps
    assert bool((q[unsaturated] >= scaled[unsaturated] - 1e-3).all()), "a bound below the tile's maximum"
    assert bool((q[unsaturated] <= scaled[unsaturated] + 1.001).all()), "a bound looser than one step"
    assert bool((q[scaled >= 127] == 127).all()) and bool((q[scaled <= -128] <= -127).all())
    # The walk does not change the LSE.
    z = e.double() @ c.double().T + (b.double() if b is not None else 0)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    assert rel_err(lse, torch.logsumexp(z, 1)) < 1e-5


@pytest.mark.parametrize("fwd_bv, bwd_bb, bwd_bv, group_b", [(32, 16, 16, 1), (32, 16, 64, 4), (16, 32, 32, 2), (64, 64, 16, 8)])
def test_live_tiles_never_drop_a_live_tile_and_drop_dead_ones(fwd_bv, bwd_bb, bwd_bv, group_b, device):
    B, V, eps = 77, 301, 2.0**-6
    e, c, t, _ = make_inputs((B,), V, 40, torch.float32, peaked=4.0, seed=4, device=device)
    lse, tmap = _forward_map(e, c, t, LSEForwardVariant(block_b=16, block_v=fwd_bv, block_d=16, num_splits=2))
    ids, grid = live_tiles(tmap, lse, eps, V, bwd_bb, bwd_bv, group_b)
    assert ids.dtype == torch.int32 and ids.unique().numel() == ids.numel()
    T, R = -(-V // bwd_bv), -(-B // bwd_bb)
    # Softmax in the walked order, padded to whole backward tiles.
    s = torch.softmax(e.double() @ c.double().T, 1)[:, tmap.perm.long()]
    s = torch.nn.functional.pad(s, (0, T * bwd_bv - V, 0, R * bwd_bb - B))
    tile_max = s.view(R, bwd_bb, T, bwd_bv).amax((1, 3))
    listed = torch.zeros(R * T, dtype=torch.bool, device=device)
    listed[ids.long()] = True
    listed = listed.view(R, T)
    assert torch.equal(listed, grid)
    rm_ids, rm_grid = live_tiles(tmap, lse, eps, V, bwd_bb, bwd_bv, group_b, swizzle=False)
    assert torch.equal(rm_grid, grid) and torch.equal(rm_ids.long(), ids.long().sort().values)
    assert not bool((tile_max >= eps)[~listed].any()), "a tile with softmax >= eps is missing from the list"
    assert listed.sum() < R * T, "nothing was dropped on peaked data"
    # Swizzled order: within a group of row blocks, tiles are walked tile-major.
    r, n = ids.long() // T, ids.long() % T
    key = (r // max(1, min(group_b, R))) * (T * R) + n * R + r
    assert bool((key[1:] > key[:-1]).all())


def test_live_tiles_keep_rows_with_nan_or_saturated_bounds(device):
    q = torch.full((3, 5), -128, dtype=torch.int8, device=device)
    q[1, 2] = 127  # saturated: no bound
    zt = torch.zeros(5, device=device)
    lse = torch.zeros(5, device=device)
    lse[4] = float("nan")
    tmap = TileMap(q=q, block_v=16, perm=torch.arange(40, dtype=torch.int32, device=device), zt=zt)
    ids, grid = live_tiles(tmap, lse, 2.0**-10, 40, 1, 16, 1)
    assert grid.shape == (5, 3) and grid.sum() == ids.numel()
    assert sorted(ids.tolist()) == sorted([2 * 3 + 1] + [4 * 3 + k for k in range(3)])


def test_vocab_order_remembers_per_classifier_and_evicts_the_oldest(device):
    cs = [torch.zeros(10 + i, 4, device=device) for i in range(memory.MAX_ENTRIES + 1)]
    for c in cs:
        memory.remember_order(c, torch.arange(c.shape[0], dtype=torch.int32, device=device))
    assert memory.order(cs[0]) is None  # evicted
    assert memory.order(cs[-1]) is not None and memory.order(cs[-1]).shape == (cs[-1].shape[0],)
    assert memory.order(cs[1][:5]) is None  # a view of other shape is another classifier
    with pytest.raises(ValueError, match="perm"):
        memory.remember_order(cs[1], torch.arange(3, dtype=torch.int32, device=device))
    memory.clear()
    assert memory.order(cs[-1]) is None


def _step(e, c, t, b, kv, **kw):
    (loss, (ge, gc, gb)) = grads_of(lambda e_, c_, b_: linear_cross_entropy(e_, c_, t, b_, impl="triton", variants=kv, **kw), e, c, b)
    return loss.detach(), ge, gc, gb


def test_second_call_walks_the_remembered_order_and_matches_the_first(device, monkeypatch, planned):
    # First call: no order yet (sorts in the backward, remembers it). Second call with the same
    # classifier tensor: the forward walks that order, the backward launches only mapped tiles.
    e, c, t, b = make_inputs((77,), 301, 40, torch.float32, bias=True, peaked=2.5, seed=6, device=device)
    c = c.requires_grad_()
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6))
    out = []
    for _ in range(2):
        ee, bb = e.clone().requires_grad_(), b.clone().requires_grad_()
        c.grad = None
        loss = linear_cross_entropy(ee, c, t, bb, impl="triton", variants=kv, softcap=9.0)
        loss.backward()
        out.append((loss.detach(), ee.grad, c.grad.clone(), bb.grad))
    launched = [r.call.backward is not None and r.call.backward.use_map for r in planned]
    assert launched == [False, True]
    assert memory.order(c) is not None
    (l0, e0, c0, b0), (l1, e1, c1, b1) = out
    assert rel_err(l1, l0) < 1e-6
    # Same filter, same decisions up to targets that now leave their tile: within the filter bound.
    bde, bdc = filtered_bound(e, c.detach(), t, b, 2.0**-6)
    assert rel_err(e1, e0) <= 2 * bde + 1e-5 and rel_err(c1, c0) <= 2 * bdc + 1e-5


def test_the_order_is_enqueued_before_the_backward_is_planned(device, monkeypatch):
    # The vocabulary order needs nothing the planner reads back: its host time goes before the read-back.
    e, c, t, _ = make_inputs((40,), 150, 24, torch.float32, peaked=2.5, seed=3, device=device)
    e, c = e.requires_grad_(), c.requires_grad_()
    seen = []
    plan_gradients = planner.plan_gradients
    monkeypatch.setattr(planner, "plan_gradients", lambda *a, **k: seen.append(memory.order(c)) or plan_gradients(*a, **k))
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6))
    linear_cross_entropy(e, c, t, impl="triton", variants=kv).backward()
    assert len(seen) == 1 and seen[0] is not None and seen[0] is memory.order(c)


@pytest.mark.parametrize("strategy, walk", [("sparse", "sorted"), ("sparse", "random"), ("sparse", None),
                                            ("chunked", "sorted"), ("chunked", "random")])
# bf16 at every filter; fp32 at the middle one (its map and bounds are the same code at another
# element size: the whole grid in both dtypes took four minutes of the CPU suite's fifteen)
@pytest.mark.parametrize("eps, dtype", [(2.0**-12, torch.bfloat16), (2.0**-5, torch.bfloat16), (0.9, torch.bfloat16),
                                        (2.0**-5, torch.float32)], ids=str)
def test_mapped_backward_matches_the_oracle(strategy, walk, eps, dtype, device, no_accuracy_guard):
    # Odd shapes, ignored rows, shift, bias, softcap; a stale (random) order is slow, never wrong;
    # without an order (walk=None: a first call) there is no map (the planner runs "sparse" as the
    # fastest strategy that needs none; the chunked strategy without a map is the exact path that
    # test_variants covers); eps=0.9 leaves no tile live (only the target terms).
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=eps, strategy=strategy))
    res, (e, c, t, b) = run_case((3, 29), 301, 45, dtype, variants=kv, bias=True, softcap=9.0, shift=1,
                                 ignore=0.1, peaked=2.0, filter_eps="auto", walk=walk, device=device)
    assert_within_bound(res, e[:, :-1], c, t[:, 1:], b, eps)


@pytest.mark.parametrize("V", [301, 2100])
def test_mapped_strategies_drop_exactly_what_the_map_skips(V, device, no_accuracy_guard, set_costs, planned):
    # What the accuracy check measures is what the map skips (accuracy.map_dead), so every mapped
    # strategy must drop exactly that, whatever its own tiles: the backward's tiles here are narrower
    # than the forward's, and a kernel skipping by its own filter would also skip the half-tiles of a
    # live forward tile whose softmax is below the filter.
    # The chunked strategy runs with both products: cuBLAS's over whole chunks, and those by live tile.
    set_costs(map_ms=0.0, **NO_CHUNK_HOST, pause_share=float("inf"))
    e, c, t, _ = make_inputs((3, 29), V, 45, torch.float32, peaked=2.0, device=device)
    grads = {}
    for name, strategy, tile_products in (("chunked", "chunked", False), ("tile products", "chunked", True),
                                          ("sparse", "sparse", False)):
        set_costs(tile_products=0.0 if tile_products else 1e9)
        kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy=strategy, chunk_v=64))
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        prime_order(cc, ee, "sorted")
        linear_cross_entropy(ee, cc, t, impl="triton", variants=kv, max_extra_memory=None).backward()
        plan = planned[-1].call.backward
        assert plan.use_map and plan.strategy == strategy and plan.tile_products == tile_products
        grads[name] = ee.grad, cc.grad
    for name in ("chunked", "tile products"):
        torch.testing.assert_close(grads["sparse"][0], grads[name][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grads["sparse"][1], grads[name][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("converted, every_row", [(False, False), (True, False), (False, True)],
                         ids=["16-bit classifier", "fp32 classifier, converted chunks", "every row, g unfilled"])
def test_products_by_live_tile_match_cublas_products(converted, every_row, device, no_accuracy_guard, set_costs,
                                                      planned, monkeypatch):
    # The chunked strategy's two ways of forming dE and dC from the same g blocks agree: cuBLAS over
    # whole chunks, and the Triton kernels over the live tiles, which read C's rows and write dC's
    # through the walked order (or the chunk converted from an fp32 classifier, in that order), with
    # several chunks (the last one short), ignored rows, shift and a bias. With every row taking part,
    # g's buffer is not filled either: the tile products leave its dead tiles unwritten and never read them.
    from cce_autotune.planning import planner

    if converted:
        monkeypatch.setattr(planner, "converts_whole", lambda *a: False)  # (a chunk at a time, not the whole copy)
    set_costs(map_ms=0.0, **NO_CHUNK_HOST, pause_share=float("inf"))
    e, c, t, b = make_inputs((3, 29), 1000, 45, torch.bfloat16, bias=True, peaked=2.0, device=device)
    if converted:
        c, b = c.float() + 1e-3 * torch.randn(c.shape, device=device), b.float()
    if not every_row:
        t[0, 3] = -100
    grads = {}
    for tile_products in (False, True):
        set_costs(tile_products=0.0 if tile_products else 1e9)
        kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked", chunk_v=128))
        ee, cc, bb = (x.clone().requires_grad_() for x in (e, c, b))
        prime_order(cc, ee, "sorted")
        with unwritten_is_nan():  # (dC and, with every row, g are not filled)
            linear_cross_entropy(ee, cc, t, bb, impl="triton", variants=kv, shift=0 if every_row else 1).backward()
        plan = planned[-1].call.backward
        assert plan.use_map and plan.strategy == "chunked" and plan.tile_products == tile_products, plan.describe()
        assert plan.live < 1.0
        grads[tile_products] = ee.grad, cc.grad, bb.grad
    for ours, ref in zip(grads[True], grads[False]):
        assert ours.dtype == ref.dtype
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=1e-4)


def _both_products_skipping_chunks(device, set_costs, planned, log: list) -> dict:
    """The chunked strategy in the order the forward walked (sorted), in one row group, with whole
    chunks dead (chunks of 64, filter 2^-6): run with cuBLAS's products, then with the products by live
    tile, on the same inputs under a NaN-poisoned ``torch.empty``. Before each run ``log`` gets a fresh
    list (``log[-1]``: what a test's patched function records during that run). Returns
    ``{tile_products: (dE, dC)}`` and the live chunks' count (whole chunks are skipped: asserted)."""
    set_costs(map_ms=0.0, **NO_CHUNK_HOST, pause_share=float("inf"))
    e, c, t, _ = make_inputs((3, 29), 2100, 45, torch.float32, peaked=2.0, device=device)
    grads = {}
    for tile_products in (False, True):
        set_costs(tile_products=0.0 if tile_products else 1e9)
        kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked", chunk_v=64))
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        prime_order(cc, ee, "sorted")
        log.append([])
        with unwritten_is_nan():
            linear_cross_entropy(ee, cc, t, impl="triton", variants=kv, max_extra_memory=None).backward()
        plan = planned[-1].call.backward
        assert plan.use_map and plan.tile_products == tile_products and plan.row_group == 0, plan.describe()
        grads[tile_products] = ee.grad, cc.grad
    n_chunks = -(-2100 // plan.chunk_v)
    live = round(plan.live_chunks * n_chunks)
    assert 0 < live < n_chunks
    return grads, live


def test_the_skipped_chunks_zeros_take_one_launch(device, no_accuracy_guard, set_costs, planned, monkeypatch):
    # Products by live tile in one row group: the chunks the host skips (no live tile) get their dC
    # zeros from one launch after the loop, not a launch each (at Qwen 2.5 0.5B's head on real data,
    # 57 of 75 chunks: the launches cost the host more than the device's work). So the products
    # kernel runs once per live chunk and once more, and its gradients are cuBLAS's products' (dC's
    # skipped rows exactly zero, every element written).
    from cce_autotune.strategies import chunked

    real = chunked._TileProducts._launch
    log = []  # per run, each launch's zeros_only
    monkeypatch.setattr(chunked._TileProducts, "_launch", lambda self, *a: log[-1].append(a[-1]) or real(self, *a))
    grads, live = _both_products_skipping_chunks(device, set_costs, planned, log)
    assert log[0] == [] and log[1].count(False) == live and log[1].count(True) == 1
    assert (grads[False][1] == 0).all(dim=1).sum() > 0  # (rows of skipped chunks)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[True][1] == 0, grads[False][1] == 0)


def test_the_walked_order_gathers_and_scatters_a_chunk_in_one_op_each(device, no_accuracy_guard, set_costs, planned,
                                                                        monkeypatch):
    # With cuBLAS's products in the order the forward walked, each live chunk gathers its rows of C
    # and scatters its rows of dC with one op each, through buffers made once a call (where a chunk's
    # device work is short, its host ops set the loop's pace: stop 58); the gradients are those of the
    # products by live tile, which read C's rows and write dC's through the order (nothing gathered:
    # no gather or scatter at all in one row group), and every element of dC is written.
    log = []  # per run, the gathers and scatters
    select, copy = torch.index_select, torch.Tensor.index_copy_
    monkeypatch.setattr(torch, "index_select", lambda *a, **k: log[-1].append("gather") or select(*a, **k))
    monkeypatch.setattr(torch.Tensor, "index_copy_", lambda self, *a: log[-1].append("scatter") or copy(self, *a))
    grads, live = _both_products_skipping_chunks(device, set_costs, planned, log)
    assert log[0].count("gather") == live and log[0].count("scatter") == live, log[0]
    assert log[1] == []
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["sparse", "chunked"], ids=["sparse", "chunked, tile products"])
def test_mapped_strategies_read_nothing_back(strategy, device, no_accuracy_guard, set_costs, planned, monkeypatch):
    # The strategies that launch from the live grid size their launches by the counts the planner's
    # one copy brought (plan.columns; the chunked strategy's products by live tile build their lists
    # on the device): their run reads no tensor back to the host (on a GPU each read would wait for
    # the device), and computes what it did when it counted for itself.
    from cce_autotune import strategies

    set_costs(map_ms=0.0, **NO_CHUNK_HOST, pause_share=float("inf"), tile_products=0.0)
    e, c, t, _ = make_inputs((3, 29), 2100, 45, torch.float32, peaked=2.0, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy=strategy))
    chosen = strategies.get(strategy)
    real_run = type(chosen).run
    reads = []

    def reading(name):
        real = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            reads.append(name)
            return real(self, *a, **k)
        return read

    def run_without_reads(self, args, plan):
        assert args.columns is not None and sum(args.columns) == int(args.live.sum())
        with monkeypatch.context() as m:
            for name in ("tolist", "item", "nonzero", "__int__", "__float__", "__bool__"):
                m.setattr(torch.Tensor, name, reading(name))
            return real_run(self, args, plan)

    grads = []
    for patched in (False, True):
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        prime_order(cc, ee, "sorted")
        with monkeypatch.context() as m:
            if patched:
                m.setattr(type(chosen), "run", run_without_reads)
            else:  # the counts made by the strategy itself, as a caller without them gets
                m.setattr(planner, "decide", lambda *a, **k: planner_decide(*a, **k)._replace(columns=None))
            linear_cross_entropy(ee, cc, t, impl="triton", variants=kv, max_extra_memory=None).backward()
        plan = planned[-1].call.backward
        assert plan.use_map and plan.strategy == strategy
        assert plan.tile_products == (strategy == "chunked")
        grads.append((ee.grad, cc.grad))
    assert reads == []
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7)


planner_decide = planner.decide


def test_mapped_backward_with_reduction_none_and_lse_gradient(device):
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-14))
    res, _ = run_case((37,), 301, 45, torch.float32, variants=kv, reduction="none", return_lse=True, bias=True,
                      filter_eps="auto", walk="sorted", device=device)
    assert_within(res)


def test_map_is_not_made_without_filtering_or_for_forward_only_calls(device, monkeypatch):
    e, c, t, _ = make_inputs((40,), 100, 32, torch.float32, peaked=2.0, device=device)
    prime_order(c, e, "sorted")
    seen = []
    real = forward.lse_forward

    def spy(*a, **k):
        out = real(*a, **k)
        seen.append(out[1])
        return out

    monkeypatch.setattr(forward, "lse_forward", spy)
    with torch.no_grad():
        linear_cross_entropy(e, c, t, impl="triton", variants=MAPPED)
    linear_cross_entropy(e, c.requires_grad_(), t, impl="triton", variants=MAPPED, filter_eps=None).backward()
    linear_cross_entropy(e, c, t, impl="triton", variants=MAPPED).backward()
    assert seen[0] is None and seen[1] is None and seen[2] is not None


@pytest.mark.parametrize("flat", [True, False])
def test_auto_strategy_runs_the_planners_choice(flat, device, monkeypatch, no_accuracy_guard, set_costs, planned):
    # Strategy "auto": whatever the planner picks from the live share the map measures is what runs,
    # and results are right either way (flat softmax: most tiles live; peaked: few).
    # (No fixed costs in the model: at this tiny size they would pause filtering on every device; and
    # the bytes moved priced as at a real head, where a matmul's flops dwarf them; and the 16 x 16
    # tiles priced as the calibration's 128 x 128.)
    set_costs(map_ms=0.0, **NO_CHUNK_HOST, flops_per_byte=5.0, tile_edge=0.0)
    plans, launched = [], []
    real_decide = planner.decide
    monkeypatch.setattr(planner, "decide", lambda *a, **k: (lambda out: (plans.append(out[0]), out)[1])(real_decide(*a, **k)))
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-12 if flat else 2.0**-5, strategy="auto"))
    res, (e, c, t, b) = run_case((61,), 1024, 45, torch.float32, variants=kv, bias=True, peaked=0.0 if flat else 2.0,
                                 filter_eps="auto", walk="sorted", device=device)
    launched = [r.call.backward for r in planned if r.call is not None and r.call.backward is not None]
    # (what ran is the decided plan; an exact chunked one runs with the forward's tiles)
    assert plans and dataclasses.replace(launched[-1], tiles=plans[-1].tiles) == plans[-1]
    if flat:  # every tile live: filtering cannot pay, and this call already filters nothing
        assert not plans[-1].use_map and "filtering cannot pay" in plans[-1].reason
    else:
        assert plans[-1].use_map and plans[-1].live < 0.5
    assert_within_bound(res, e, c, t, b, kv.backward.filter_eps)


@pytest.mark.parametrize("strategy, dtype", [("chunked", torch.bfloat16)])
def test_map_path_is_as_accurate_as_the_first_call(strategy, dtype, device):
    # With nothing filtered (tiny eps) the map path must be as accurate as the first call: the onehot
    # is folded into g before g is rounded (a well-predicted target's softmax - 1 is small and must
    # not come from a rounded softmax).  (bf16, where that rounding shows.  The sparse strategy is
    # left to the oracle tests: the interpreter rounds in-kernel bf16 casts toward zero, and it casts
    # its outputs in the kernel; in fp32 the comparison is dominated by the LSE's last bits.)
    e, c, t, _ = make_inputs((64,), 256, 32, dtype, peaked=4.0, seed=8, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=1e-30, strategy=strategy))
    _, ref = grads_of(lambda e_, c_: torch_loss(e_, c_, t), e.double(), c.double())
    c = c.requires_grad_()
    errs = []
    for _ in range(2):
        ee = e.clone().requires_grad_()
        c.grad = None
        linear_cross_entropy(ee, c, t, impl="triton", variants=kv).backward()
        errs.append([rel_err(ee.grad, ref[0]), rel_err(c.grad, ref[1])])
    assert memory.order(c) is not None
    for first, mapped in zip(*errs):
        assert mapped <= 1.1 * first + 1e-6, errs


# -- the planner's accuracy guard ---------------------------------------------------------------
def _threshold(tmap, lse, eps):
    """Per row: the smallest q that can be live (the reference: NaN -> everything live)."""
    thr = torch.ceil(8.0 * (math.log(eps) + lse.float() - tmap.zt.float()))
    return torch.nan_to_num(thr, nan=-128.0, posinf=127.0, neginf=-128.0).clamp_(-128, 127).to(torch.int8)


def _reference_measure(tmap, lse, eps, V, block_b, block_v):
    """:func:`cce_autotune.tile_map.measure` in PyTorch, from its definition: ``(live, dropped)``."""
    q, thr = tmap.q, _threshold(tmap, lse, eps)
    T_f, n = q.shape
    live_rows = (q >= thr[None, :]) & (lse != float("inf"))[None, :]  # (forward tiles, rows)
    R, T = -(-n // block_b), -(-V // block_v)
    padded = torch.zeros((T_f, R * block_b), dtype=torch.bool, device=q.device)
    padded[:, :n] = live_rows
    live = padded.view(T_f, R, block_b).any(2)  # (forward tiles, row blocks)
    if block_v <= tmap.block_v:
        live = live.repeat_interleave(tmap.block_v // block_v, dim=0)[:T]
    else:
        r = block_v // tmap.block_v
        wide = torch.zeros((T * r, R), dtype=torch.bool, device=q.device)
        wide[:T_f] = live[: T * r]
        live = wide.view(T, r, R).any(1)
    lse, zt = lse.double(), tmap.zt.double()
    ok = torch.isfinite(lse) & torch.isfinite(zt)
    pt = torch.where(ok, torch.exp(zt - lse), 0.0)
    below = torch.where(q < thr[None, :], torch.exp(q.double() / 8), 0.0).sum(0)
    dropped = (below * pt).sum() * tmap.block_v / torch.where(ok, 2 * (1 - pt), 0.0).clamp_min(0).sum().clamp_min(1e-30)
    return live.T.contiguous(), dropped


@pytest.mark.parametrize("fwd_bv, bwd_bb, bwd_bv", [(32, 16, 16), (32, 16, 64), (16, 32, 32), (64, 64, 16), (16, 8, 128)])
def test_the_map_is_measured_as_its_definition_says(fwd_bv, bwd_bb, bwd_bv, device):
    from cce_autotune.tile_map import measure

    gen = torch.Generator().manual_seed(fwd_bv + bwd_bb + bwd_bv)
    n, V = 77, 301
    T_f = -(-V // fwd_bv)
    q = torch.randint(-128, -20, (T_f, n), dtype=torch.int8, generator=gen)
    hot = torch.rand((T_f, n), generator=gen) < 0.02  # (a few live bounds, and saturated ones)
    q[hot] = torch.randint(-20, 128, (int(hot.sum()),), dtype=torch.int8, generator=gen)
    q = q.to(device)
    zt = torch.randn(n, generator=gen).to(device)
    lse = zt + 3.0 * torch.rand(n, generator=gen).to(device)
    lse[5], lse[9], zt[12], lse[20] = float("inf"), float("nan"), float("nan"), -float("inf")  # (ignored, broken rows)
    tmap = TileMap(q=q, block_v=fwd_bv, perm=torch.arange(V, dtype=torch.int32, device=device), zt=zt)
    seen = []
    for eps in (2.0**-4, 2.0**-10):
        live, dropped = measure(tmap, lse, eps, V, bwd_bb, bwd_bv)
        ref_live, ref_dropped = _reference_measure(tmap, lse, eps, V, bwd_bb, bwd_bv)
        assert live.dtype == torch.bool and live.shape == ref_live.shape
        assert torch.equal(live, ref_live)
        assert abs(float(dropped) - float(ref_dropped)) <= 1e-5 * float(ref_dropped) + 1e-30
        seen += [float(live.float().mean()), float(dropped)]
    assert any(0 < x < 1 for x in seen[0::2]) and min(seen[1::2]) > 0, seen  # (both sides exercised)


def test_an_empty_map_measures_nothing(device):
    from cce_autotune.tile_map import measure

    tmap = TileMap(q=torch.zeros((4, 0), dtype=torch.int8, device=device), block_v=16,
                   perm=torch.arange(64, dtype=torch.int32, device=device), zt=torch.zeros(0, device=device))
    live, dropped = measure(tmap, torch.zeros(0, device=device), 2.0**-8, 64, 16, 16)
    assert live.shape == (0, 4) and float(dropped) == 0.0


def test_dropped_share_bounds_the_mass_the_filter_drops(device):
    from cce_autotune.tile_map import dropped_share

    e, c, t, _ = make_inputs((50,), 300, 32, torch.float32, peaked=1.0, seed=4, device=device)
    lse, tmap = _forward_map(e, c, t, MAPPED.lse_forward)
    p = torch.softmax(e.double() @ c.double().T, dim=1)[:, tmap.perm.long()]  # walked order
    bv = tmap.block_v
    for eps in (2.0**-4, 2.0**-8, 2.0**-12):
        dead = (tmap.q < _threshold(tmap, lse, eps)[None, :]).T  # (rows, forward tiles)
        cols = dead.repeat_interleave(bv, dim=1)[:, : p.shape[1]]
        true = (p * cols).sum() / (2 * (1 - p.gather(1, tmap.perm.long().argsort()[t][:, None]))).sum()
        bound = float(dropped_share(tmap, lse, eps))
        assert true.item() <= bound * (1 + 1e-5), (eps, true.item(), bound)
        assert bound <= 1e3 * max(true.item(), 1e-9)  # a bound, not a blanket


def _guard_case(device, q_tail, V, model, n=16):
    T = V // 32
    v = BackwardVariant(block_b=16, block_v=32, block_d=16)
    p = CallProblem(n=n, n_all=n, V=V, D=32, elem=4, grad_bytes=4 * (n + V) * 32, sorted_vocab=True, map_bytes=n * T)
    q = torch.full((T, n), -128, dtype=torch.int8, device=device)
    q[0] = 127
    for k, val in q_tail.items():
        q[k] = val
    zt, lse = torch.zeros(n, device=device), torch.ones(n, device=device)  # targets at softmax 1/e
    tmap = TileMap(q=q, block_v=32, perm=torch.arange(V, dtype=torch.int32, device=device), zt=zt)
    return planner.decide(p, v, 2.0**-12, tmap, lse, budget=None, costs=model)[:4]


def test_accuracy_guard_lowers_the_filter_or_runs_exact(device):
    # (max_dropped: the mechanism, at a threshold these small maps reach)
    model = costs.CostModel(map_ms=0.0, **NO_CHUNK_HOST, max_dropped=5e-3)
    # Two tiles just under 2^-12 drop ~1e-2 of the gradient's mass: the filter goes to 2^-16, where
    # they are live and the rest (at the map's floor) drop ~1e-5.
    plan, live, chunks, pause = _guard_case(device, {1: -60, 2: -60}, 512, model)
    assert plan.filter_eps == 2.0**-16 and "lowered" in plan.reason and plan.use_map and not pause
    assert live is not None and live[:, 1:3].all() and not live[:, 3:].any()
    # 255 tiles just under even 2^-20: every filter drops too much; the call runs exact and pauses.
    plan, live, chunks, pause = _guard_case(device, {k: -103 for k in range(1, 256)}, 8192, model)
    assert pause and not plan.use_map and live is None and "would drop" in plan.reason
    # A peaked map passes at the call's own filter.
    plan, live, chunks, pause = _guard_case(device, {}, 512, model)
    assert plan.filter_eps is None and plan.use_map and not pause


@pytest.mark.parametrize("guard", ["dropped", "measured"])
def test_lowered_filter_reaches_the_kernels_and_keeps_the_gradient_accurate(guard, device, monkeypatch, set_costs,
                                                                            planned):
    # A flat softmax and a coarse filter (2^-6): unguarded it drops much of the gradient; each guard
    # alone (the map's dropped-mass bound; the measured check of cce_autotune.planning.accuracy) lowers
    # the filter, the kernels run with the lowered one, and dE is far closer to the oracle.
    e, c, t, _ = make_inputs((64,), 512, 32, torch.float32, peaked=0.3, seed=5, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6))
    _, ref = grads_of(lambda e_, c_: torch_loss(e_, c_, t), e.double(), c.double())
    monkeypatch.setattr(filters, "MAX_ERROR", float("inf") if guard == "dropped" else 2e-3)
    if guard == "measured":
        set_costs(max_dropped=float("inf"))
    errs = {}
    for on in (True, False):
        if not on:
            set_costs(max_dropped=float("inf"))
            monkeypatch.setattr(filters, "MAX_ERROR", float("inf"))
        ee, cc = e.clone().requires_grad_(), c.clone()
        prime_order(cc, ee, "sorted")
        linear_cross_entropy(ee, cc, t, impl="triton", variants=kv).backward()
        errs[on] = rel_err(ee.grad, ref[0])
        eps, plan = planned[-1].call.run_eps, planned[-1].call.backward
        if not on:
            assert plan.use_map and eps == 2.0**-6
        elif guard == "dropped":
            assert plan.use_map and plan.filter_eps is not None and eps == plan.filter_eps < 2.0**-6
        else:
            assert eps is None or eps < 2.0**-6, eps
            assert "measured" in plan.reason
            # All 64 rows are sampled: the check's estimate is the filter's whole error (fp32 inputs,
            # so rounding adds nothing), and the chosen filter keeps within it.
            assert errs[on] <= 1.05 * filters.MAX_ERROR + 1e-6, errs
    assert errs[True] < 0.25 * errs[False], errs

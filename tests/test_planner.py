"""The planner: memory budgets, the choice among strategies, pausing, the fused forward, and every
plan shape it can produce run against the float64 oracle."""

import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from cce_autotune import BackwardVariant, LSEForwardVariant, linear_cross_entropy, memory, strategies
from cce_autotune.planning import budget as budgets
from cce_autotune.planning import costs, explain, planner
from cce_autotune.planning.budget import memory_budget, parse_bytes
from cce_autotune.planning.filters import SUMMED_DC_BLOCKS
from cce_autotune.plans import BackwardPlan, MiB
from cce_autotune.plans import CallProblem as Problem
from cce_autotune.strategies import chunked, forward, fused
from cce_autotune.strategies.base import FORWARD_TILE_V
from conftest import DEVICE
from helpers import NO_CHUNK_HOST, grads_of, make_inputs, rel_err, torch_loss, unwritten_is_nan
from test_loss import SMALL, assert_within, run_case
from test_variants import assert_within_bound

HEADS = {  # (n, V, D) of the benchmark's heads
    "gemma2": (8192, 256128, 2304), "llama3": (8192, 128256, 4096), "mistral": (8192, 32768, 4096),
    "gpt768": (8192, 50000, 768), "gpt4096": (8192, 50000, 4096),
}


def problem(name, sorted_vocab=True, elem=2):
    n, V, D = HEADS[name]
    return Problem(n=n, n_all=n, V=V, D=D, elem=elem, grad_bytes=elem * (n + V) * D, sorted_vocab=sorted_vocab,
                   map_bytes=n * -(-V // 256) if sorted_vocab else 0)


def default_budget(p):
    return memory_budget("auto", p.grad_bytes, 4 * p.n_all * p.D)


COSTS = costs.builtin()  # the built-in (H200) cost model


def plan_backward(p, variant, **kw):
    return planner.plan_backward(p, variant, costs=COSTS, **kw)


def plan_fused(p, variant, max_extra_memory="auto", **kw):
    return planner.plan_fused(p, variant, costs=COSTS, budget=planner.call_budget(p, max_extra_memory, False), **kw)


def chunked_shape(p, block_v, chunk_v, budget, exact):
    return chunked.shape(p, block_v, chunk_v, budget, exact, COSTS)


# -- sizes and budgets ------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("512MiB", 512 * MiB), ("2 GB", 2 * 10**9), ("1.5GiB", int(1.5 * 2**30)),
                                            ("1024", 1024), (4096, 4096), ("auto", "auto"), ("none", None), (None, None)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", -1, float("nan"), True, [1]])
def test_parse_bytes_names_the_argument(bad):
    with pytest.raises(ValueError, match="max_extra_memory"):
        parse_bytes(bad)


def test_memory_budget_default_environment_and_explicit(monkeypatch):
    monkeypatch.delenv(budgets.ENV_MAX_EXTRA, raising=False)
    assert memory_budget("auto", 1000 * MiB, 10 * MiB) == int(0.05 * 1000 * MiB) + 32 * MiB + 10 * MiB
    monkeypatch.setenv(budgets.ENV_MAX_EXTRA, "3GiB")
    assert memory_budget("auto", 1000 * MiB) == 3 * 2**30
    assert memory_budget(123, 1000 * MiB) == 123  # an explicit argument wins over the environment
    assert memory_budget(None, 1000 * MiB) is None
    monkeypatch.setenv(budgets.ENV_MAX_EXTRA, "plenty")
    with pytest.raises(ValueError, match=budgets.ENV_MAX_EXTRA):
        memory_budget("auto", 1000 * MiB)


def test_an_fp32_classifier_is_converted_whole_within_the_budget():
    # 16-bit e with an fp32 classifier: the default budget allows the classifier's copy in e's dtype
    # (autocast holds the same copy for PyTorch's path), so it is converted once, whole, however
    # large; the strategies' budget is what remains. A budget that cannot hold the copy converts it a
    # chunk at a time inside the kernels.
    from cce_autotune.options import Options
    from cce_autotune.variant import KernelVariants

    V, D, n = 32000, 4096, 8192
    copy = V * D * 2
    p = Problem(n=n, n_all=n, V=V, D=D, elem=2, grad_bytes=2 * n * D + 4 * V * D, c_elem=4, cast_bytes=copy)
    assert copy > COSTS.convert_bytes
    for budget, whole in (("auto", True), (None, True), (copy - 1, False)):
        plan = planner.plan_call(Options.check(max_extra_memory=budget), "triton", KernelVariants(), False, p, COSTS)
        assert plan.forward.convert_classifier == whole, budget
    assert planner.call_budget(p, "auto", converted=True) == default_budget(p)
    assert planner.call_budget(p, "auto", converted=False) == default_budget(p) + copy


def test_a_call_that_cannot_read_back_is_planned_exact(device):
    # While a CUDA graph is captured (measurable=False) nothing can be read back to the host: the
    # call filters nothing, so its forward walks no order and records no map (no remembered state is
    # read or changed), and it is planned as an exact call is (here, unlimited: in the forward).
    from cce_autotune.options import Options
    from cce_autotune.variant import KernelVariants

    kv = KernelVariants.defaults(2)
    assert kv.backward.filter_eps is not None and kv.backward.tile_map
    V, D, n = 50000, 2048, 8192
    p = Problem(n=n, n_all=n, V=V, D=D, elem=2, grad_bytes=2 * (n + V) * D)
    c = torch.zeros(4, 4, device=device)
    memory.remember_order(c, torch.arange(4, dtype=torch.int32, device=device))
    o = Options.check()
    plans = {}
    for measurable in (True, False):
        plan = planner.plan_call(o, "triton", kv, True, p, COSTS, measurable=measurable)
        plans[measurable] = planner.plan_forward(plan, p, c, COSTS, needs_grad=True, fused_allowed=True,
                                                 max_extra_memory=None)
    exact = planner.plan_forward(planner.plan_call(Options.check(filter_eps=None), "triton", kv, True, p, COSTS),
                                 p, c, COSTS, needs_grad=True, fused_allowed=True, max_extra_memory=None)
    assert plans[True].filter_eps is not None and plans[True].forward.walk is not None
    assert plans[False].filter_eps is None and plans[False].forward.walk is None and not plans[False].forward.sort
    assert plans[False].forward == exact.forward and exact.forward.fused is not None


def test_the_walked_forward_copies_c_in_chunks_where_the_copy_costs_less_than_gathering(device):
    # The forward walking a remembered order either gathers C's rows in its kernel (pointer loads:
    # walk_gather matmuls) or copies C a chunk at a time in that order (C read and written once, a
    # fixed host cost a chunk). Many rows share each copied tile; few rows do not.
    from cce_autotune.options import Options
    from cce_autotune.variant import KernelVariants

    kv = KernelVariants.defaults(2)
    c = torch.zeros(4, 4, device=device)
    chosen = {}
    for n in (2048, 8192):
        V, D = 128256, 4096
        p = Problem(n=n, n_all=n, V=V, D=D, elem=2, grad_bytes=2 * (n + V) * D)
        memory.remember_order(c, torch.arange(4, dtype=torch.int32, device=device))
        for budget in ("auto", 96 * MiB, kv.lse_forward.block_v * D * 2 - 1):
            plan = planner.plan_call(Options.check(max_extra_memory=budget), "triton", kv, True, p, COSTS)
            assert plan.forward.convert_chunk == 0  # (a 16-bit classifier: nothing to convert)
            fw = planner.plan_forward(plan, p, c, COSTS, needs_grad=True, fused_allowed=True,
                                      max_extra_memory=budget).forward
            assert fw.walk is not None
            chosen[n, budget] = fw.convert_chunk
            limit = min(COSTS.convert_bytes, planner.call_budget(p, budget, False))
            assert fw.convert_chunk in (0, forward.convert_width(V, D, kv.lse_forward.block_v, 2, limit))
    assert chosen[8192, "auto"] > chosen[8192, 96 * MiB] > 0  # (the budget narrows the chunks)
    assert chosen[2048, "auto"] == chosen[2048, 96 * MiB] == 0  # (the copy would cost more than gathering)
    assert chosen[8192, kv.lse_forward.block_v * 4096 * 2 - 1] == 0  # (not one tile fits the budget)
    # ... and the decision follows the coefficients, not the shape.
    p = Problem(n=8192, n_all=8192, V=128256, D=4096, elem=2, grad_bytes=0)
    assert planner.walk_copy(p, kv.lse_forward, None, COSTS.replace(walk_gather=0.01)) == 0


def test_loss_rejects_a_bad_budget_naming_the_argument(device):
    e, c, t, _ = make_inputs((8,), 32, 16, torch.float32, device=device)
    with pytest.raises(ValueError, match="max_extra_memory"):
        linear_cross_entropy(e, c, t, max_extra_memory="a lot")


# -- choices ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(HEADS))
@pytest.mark.parametrize("live", [0.05, 0.25, 0.5, 1.0])
def test_every_plan_fits_the_default_budget(name, live):
    p = problem(name)
    budget = default_budget(p)
    plan = plan_backward(p, BackwardVariant(), has_map=True, live=live, live_blocks=min(1.0, 3 * live), budget=budget)
    assert plan.extra_bytes <= budget, plan.describe()
    exact = plan_backward(problem(name, sorted_vocab=False), BackwardVariant(), has_map=False, budget=budget, exact=True)
    assert exact.strategy == "chunked" and exact.de_fp32 and exact.extra_bytes <= budget


def test_few_live_tiles_take_the_products_by_tile_many_cublas():
    # Unlimited memory at Llama 3's head: a twentieth or a fifth of the tiles live take the chunked
    # strategy with its products over the live tiles (the sparse strategy, which writes the live tiles'
    # gradients to a compact buffer, priced next to it); most of them the chunked strategy with
    # cuBLAS's products over whole chunks.
    p = problem("llama3")
    few = plan_backward(p, BackwardVariant(), has_map=True, live=0.05, live_blocks=0.5, budget=None)
    some = plan_backward(p, BackwardVariant(), has_map=True, live=0.2, live_blocks=1.0, budget=None)
    many = plan_backward(p, BackwardVariant(), has_map=True, live=0.9, live_blocks=1.0, budget=None)
    assert few.strategy == "chunked" and few.tile_products
    assert some.strategy == "chunked" and some.tile_products and "products by live tile" in some.describe()
    assert many.strategy == "chunked" and not many.tile_products
    assert few.cost < some.cost < many.cost
    assert "sparse" in {a[0] for a in few.alternatives} and "sparse" in {a[0] for a in some.alternatives}
    # Rows that are not dense (a table of offsets) keep cuBLAS's products.
    table = plan_backward(replace(p, dense_rows=False), BackwardVariant(), has_map=True, live=0.2, live_blocks=1.0,
                          budget=None)
    assert table.strategy != "chunked" or not table.tile_products
    assert table.cost > some.cost


def test_an_explicit_strategy_runs_when_it_fits_and_is_replaced_when_it_does_not():
    p = problem("gemma2")
    v = BackwardVariant(strategy="sparse")
    fits = plan_backward(p, v, has_map=True, live=0.02, live_blocks=0.5, budget=None)
    assert fits.strategy == "sparse" and "asks for it" in fits.reason
    tight = plan_backward(p, v, has_map=True, live=0.5, live_blocks=1.0, budget=default_budget(p))
    assert tight.strategy != "sparse" and "sparse exceeds the budget" in tight.reason
    nomap = plan_backward(p, v, has_map=False, budget=None)
    assert nomap.strategy != "sparse" and "cannot run" in nomap.reason


def test_plans_are_kept_per_call_and_a_strategy_registered_later_is_weighed():
    # plan_backward keeps its plans (a steady loop asks for the same one at every call): the same
    # arguments give the same plan object; a strategy registered after that is weighed by the next
    # plan, and forgotten once it is unregistered.
    from cce_autotune import strategies

    p = problem("llama3")
    kw = dict(has_map=True, live=0.9, live_blocks={"chunked": 1.0, "sparse": 0.9}, budget=None)
    first = plan_backward(p, BackwardVariant(), **kw)
    assert plan_backward(p, BackwardVariant(), **kw) is first
    cost = planner.exact_cost(p, BackwardVariant(), None, COSTS)

    class Cheap(type(chunked.STRATEGY)):
        name = "cheap"

        def option(self, ctx):
            opt = chunked.STRATEGY.option(ctx)
            return type(opt)(opt.cost / 10, opt.extra_bytes, opt.use_map, opt.sizes)

    strategies.register(Cheap())
    try:
        assert plan_backward(p, BackwardVariant(), **kw).strategy == "cheap"
        assert planner.exact_cost(p, BackwardVariant(), None, COSTS) < cost
    finally:
        strategies.unregister("cheap")
    assert plan_backward(p, BackwardVariant(), **kw).strategy == first.strategy != "cheap"
    assert planner.exact_cost(p, BackwardVariant(), None, COSTS) == cost


def test_nothing_fits_takes_the_smallest_and_says_so():
    p = problem("mistral")
    plan = plan_backward(p, BackwardVariant(), has_map=True, live=0.3, live_blocks=1.0, budget=1)
    assert "nothing fits" in plan.reason
    assert plan.extra_bytes == min([plan.extra_bytes] + [a[2] for a in plan.alternatives])


def test_rows_go_in_groups_before_de_leaves_fp32_as_the_budget_shrinks():
    p = problem("llama3", sorted_vocab=False)
    assert chunked_shape(p, 128, 4096, None, exact=False) == (4096, True, 0)
    # The fp32 dE fits, the g block of every row at 1024 columns does not: narrower chunks or row
    # groups, whichever the cost model prefers, but dE stays fp32.
    tight = chunked.extra_bytes(p, 1024, True, True) - 1
    w, fp32, rg = chunked_shape(p, 128, 4096, tight, exact=False)
    assert fp32 and (w < 1024 or 0 < rg < p.n) and chunked.extra_bytes(p, w, True, True, rg) <= tight
    # Small D, many tokens: the g block outweighs a (chunk x D) fp32 dC buffer, so rows go in groups.
    q = Problem(n=32768, n_all=32768, V=151936, D=896, elem=2, grad_bytes=2 * (32768 + 151936) * 896)
    w, fp32, rg = chunked_shape(q, 128, 4096, default_budget(q), exact=True)
    assert fp32 and 0 < rg < q.n and w >= 1024, (w, fp32, rg)
    # Not even the fp32 dE fits: dE in its own dtype, the widest chunk that fits.
    small = chunked_shape(p, 128, 4096, chunked.extra_bytes(p, 2048, False, True), exact=False)
    assert small == (2048, False, 0)
    assert chunked_shape(p, 128, 4096, 64 * MiB, exact=True)[1]  # exact keeps its fp32 dE
    # Chunks are whole tiles whatever V (the live grid is read a tile at a time): 896 -> 384, not 448.
    for V in (896, 3500, 7000):
        q = Problem(n=32768, n_all=32768, V=V, D=896, elem=2, grad_bytes=2 * (32768 + V) * 896)
        for budget in (None, 10 * MiB, 60 * MiB, 200 * MiB, chunked.extra_bytes(q, 448, False, True)):
            assert chunked_shape(q, 128, 4096, budget, exact=False)[0] % 128 == 0, (V, budget)


@pytest.mark.parametrize("V, D", [(32000, 4096), (128256, 2048), (262208, 2560), (151936, 896)])
def test_an_exact_chunk_is_the_widest_multiple_of_256_that_fits(V, D):
    # Every chunk of an exact backward is live and reads and writes dE's fp32 accumulator: the budget
    # between two powers of two is used (at 32000 x 4096 the default budget holds 2816 columns, where
    # the widest power of two is 2048: 12 chunks, not 16).
    p = Problem(n=8192, n_all=8192, V=V, D=D, elem=2, grad_bytes=2 * (8192 + V) * D)
    budget = default_budget(p)
    w, fp32, rg = chunked_shape(p, 256, 4096, budget, exact=True)
    assert fp32 and rg == 0 and w % 256 == 0, (w, rg)
    assert chunked.extra_bytes(p, w, True, False) <= budget < chunked.extra_bytes(p, w + 256, True, False)
    assert w & (w - 1), w  # (at these heads, not a power of two)
    # A tiling of 128 columns gets the same width (whole tiles of any tiling up to 256).
    assert chunked_shape(p, 128, 4096, budget, exact=True)[0] == w
    # The whole vocabulary in one chunk where it fits.
    assert chunked_shape(p, 256, 4096, None, exact=True)[0] >= V


@pytest.mark.parametrize("n, V, D", [(32768, 151936, 896), (32768, 128256, 4096), (32768, 50257, 768),
                                     (65536, 262144, 2304)])
def test_default_budget_keeps_de_in_fp32_at_many_tokens(n, V, D):
    # At 32k tokens the g block of every row no longer fits beside the fp32 dE; before row groups
    # these plans accumulated dE in bf16 over every chunk (3.9e-2 dE error measured on the H200).
    p = Problem(n=n, n_all=n, V=V, D=D, elem=2, grad_bytes=2 * (n + V) * D, sorted_vocab=True,
                map_bytes=n * -(-V // 256))
    budget = default_budget(p)
    for live in (0.3, 0.6, 1.0):
        plan = plan_backward(p, BackwardVariant(strategy="chunked"), has_map=True, live=live, live_blocks=1.0,
                             budget=budget)
        assert plan.strategy == "chunked" and plan.de_fp32 and plan.extra_bytes <= budget, plan.describe()
        assert plan.row_group == 0 or plan.row_group % 256 == 0


def test_chunk_grid_marks_live_blocks_per_row_group():
    live = torch.zeros((6, 8), dtype=torch.bool)  # 6 row blocks, 8 tiles
    live[0, 1] = live[5, 7] = True
    assert chunked.chunk_grid(live, 4, 1).tolist() == [[True], [True]]  # 2 chunks, one group
    grid = chunked.chunk_grid(live, 4, 1, 4)  # groups of 4 row blocks: 2 groups, the second short
    assert grid.tolist() == [[True, False], [False, True]]


def test_live_lists_hold_each_blocks_live_entries_first():
    # The tile products' lists: per row block and chunk, the chunk's live tiles first (in order) and
    # their count; per row group and tile, the group's live row blocks first and their count. Entries
    # beyond the grid (the last chunk's and group's padding) are dead.
    g = torch.Generator().manual_seed(0)
    live = torch.rand((7, 11), generator=g) < 0.3  # 7 row blocks, 11 tiles
    lists = chunked.live_lists(live.to(DEVICE), 4, 3)  # chunks of 4 tiles, groups of 3
    row_idx, row_cnt, col_idx, col_cnt = (x.cpu() for x in lists)
    assert row_idx.shape == (9, 12) and row_cnt.shape == (9, 3) and col_idx.shape == (3, 12, 3)
    assert col_cnt.shape == (3, 12) and row_idx.dtype == col_idx.dtype == row_cnt.dtype == torch.int32
    padded = torch.zeros((9, 12), dtype=torch.bool)
    padded[:7, :11] = live
    for b in range(9):
        for k in range(3):
            want = [t for t in range(4) if padded[b, 4 * k + t]]
            assert row_cnt[b, k] == len(want)
            # (live first, then dead, each in order: a stable partition)
            assert row_idx[b, 4 * k: 4 * k + 4].tolist() == want + [t for t in range(4) if t not in want]
    for j in range(3):
        for t in range(12):
            want = [r for r in range(3) if padded[3 * j + r, t]]
            assert col_cnt[j, t] == len(want)
            assert col_idx[j, t].tolist() == want + [r for r in range(3) if r not in want]
    # Chunks and groups wider than a launch's power-of-two block of the other list.
    big = torch.rand((37, 300), generator=g) < 0.2
    row_idx, row_cnt, col_idx, col_cnt = (x.cpu() for x in chunked.live_lists(big.to(DEVICE), 64, 5))
    padded = torch.zeros((40, 320), dtype=torch.bool)
    padded[:37, :300] = big
    blocks = padded.view(40, 5, 64)
    assert row_cnt.tolist() == blocks.sum(-1).tolist()
    key = (~blocks).int() * 64 + torch.arange(64)  # (live first, each part in order)
    assert row_idx.view(40, 5, 64).tolist() == key.argsort(-1).tolist()
    groups = padded.view(8, 5, 320).transpose(1, 2)
    assert col_cnt.tolist() == groups.sum(-1).tolist()
    assert col_idx.tolist() == ((~groups).int() * 5 + torch.arange(5)).argsort(-1).tolist()
    # One group of every row block, one chunk of every tile.
    _, row_cnt, col_idx, col_cnt = (x.cpu() for x in chunked.live_lists(live.to(DEVICE), 11))
    assert row_cnt.view(-1).tolist() == live.sum(1).tolist() and col_cnt.view(-1).tolist() == live.sum(0).tolist()
    assert col_idx.shape == (1, 11, 7)


@pytest.mark.parametrize("n", [100, 3000, 8192])
@pytest.mark.parametrize("dense", [True, False])
def test_fused_blocks_are_all_rows_or_the_largest_power_of_two_that_fits(n, dense):
    # A block's row: g in e's dtype (2 bytes a logit, not fp32 logits' 4) and two fp32 statistics for
    # each of its 125 tiles of 256 columns (rows not dense: its rows of E and dE too); the fp32 dbias.
    p = Problem(n=n, n_all=n, V=32000, D=4096, elem=2, grad_bytes=0, dense_rows=dense)
    row = 32000 * 2 + 8 * 125
    assert fused.extra_bytes(p, 16, 256) == 16 * row + 4 * 32000 + (0 if dense else 16 * 2 * 4096 * 2)
    assert fused.extra_bytes(p, 16, 128) - fused.extra_bytes(p, 16, 256) == 16 * 8 * 125  # (250 tiles)
    assert fused.block_rows(p, None, 256) == n
    assert fused.block_rows(p, fused.extra_bytes(p, n, 256), 256) == n
    for budget in (176 * MiB, 50 * MiB, 10 * MiB):
        R = fused.block_rows(p, budget, 256)
        assert fused.extra_bytes(p, R, 256) <= budget
        if R < n:
            assert R >= 16 and R & (R - 1) == 0 and fused.extra_bytes(p, 2 * R, 256) > budget
    assert fused.block_rows(p, fused.extra_bytes(p, 15, 256), 256) is None  # not even 16 rows


def test_fused_is_planned_only_when_allowed_paused_and_cheaper():
    p = problem("gpt4096")
    v = BackwardVariant()
    plan = plan_fused(p, v, paused=True, allowed=True)
    assert plan is not None and plan.strategy == "fused" and plan.row_block >= COSTS.fused_min_rows
    assert plan.extra_bytes <= default_budget(p)
    assert plan_fused(p, v, paused=False, allowed=True) is None  # nothing says most tiles are live
    # A call that filters nothing plans it too, but keeps exact accuracy: a 16-bit dC summed over
    # several blocks needs an fp32 accumulator (none fits this budget: the four-matmul plan runs); one
    # block of all rows, or an fp32 dC (an fp32 classifier), rounds nothing per block.
    assert plan.row_block < p.n and not plan.dc_fp32
    assert plan_fused(p, v, paused=False, exact=True, allowed=True) is None
    whole = plan_fused(p, v, paused=False, exact=True, allowed=True, max_extra_memory=None)
    assert whole.row_block == p.n and not whole.dc_fp32 and whole.reason.startswith("exact")
    p32 = replace(p, c_elem=4, grad_bytes=p.grad_bytes + 2 * p.V * p.D)
    exact32 = plan_fused(p32, v, paused=False, exact=True, allowed=True, max_extra_memory=fused.extra_bytes(p32, 2048, FORWARD_TILE_V))
    assert exact32.row_block == 2048 and not exact32.dc_fp32
    # Where the budget holds the accumulator beside a block, a 16-bit dC sums in it, exact or not (at
    # D = 1024: at D = 4096 the accumulator is as large as a g of all 8192 rows).
    pd = replace(p, D=1024)
    room = 4 * pd.V * pd.D + fused.extra_bytes(pd, 1024, FORWARD_TILE_V)
    for exact in (False, True):
        acc = plan_fused(pd, v, paused=True, exact=exact, allowed=True, max_extra_memory=room)
        assert acc.dc_fp32 and acc.row_block == 1024 and acc.extra_bytes <= room
    # A default call sums a 16-bit dC in dC itself over at most SUMMED_DC_BLOCKS blocks (its rounding
    # error grows with their number): with more, even a variant that asks for the fused strategy runs
    # the four-matmul plan.
    k = SUMMED_DC_BLOCKS
    for blocks, fits in ((k, True), (2 * k, False)):
        R = 1 << (-(-p.n // blocks) - 1).bit_length()  # (a power of two: the fewest rows for that many blocks)
        budget = fused.extra_bytes(p, R, FORWARD_TILE_V)
        assert -(-p.n // fused.block_rows(p, budget, FORWARD_TILE_V)) <= blocks
        for variant, paused in ((v, True), (v.replace(strategy="fused"), False)):
            got = plan_fused(p, variant, paused=paused, allowed=True, max_extra_memory=budget)
            assert (got is not None and not got.dc_fp32 and -(-p.n // got.row_block) <= k) if fits else got is None
    assert plan_fused(p, v, paused=True, allowed=False) is None  # e.g. reduction "none"
    assert plan_fused(p, v, paused=True, allowed=True, max_extra_memory=MiB) is None  # no room for a block
    assert plan_fused(p, v.replace(strategy="fused"), paused=False, allowed=True) is not None


def test_a_backward_that_filters_nothing_is_planned_in_the_natural_order(device):
    # Paused, it walks the vocabulary's natural order: it must be planned (and its memory counted) as
    # that exact backward is, not with the sorted order's gathered chunks of C, which at a budget that
    # just holds the exact plan pushed it to row groups at 2.5x its cost (the real-data GPT heads).
    from cce_autotune.tile_map import TileMap

    model = costs.CostModel(map_ms=0.0, **NO_CHUNK_HOST)
    n, V, D = 4096, 8192, 256
    v = BackwardVariant(block_b=64, block_v=128, block_d=64)
    p = Problem(n=n, n_all=n, V=V, D=D, elem=2, grad_bytes=2 * (n + V) * D, sorted_vocab=True, map_bytes=n * V // 256)
    natural = replace(p, sorted_vocab=False, map_bytes=0)
    want = planner.plan_backward(natural, v, has_map=False, budget=None, costs=model, exact=True)
    budget = want.extra_bytes  # the exact plan just fits in the natural order
    assert planner.plan_backward(p, v, has_map=False, budget=budget, costs=model, exact=True).cost > want.cost
    perm = torch.arange(V, dtype=torch.int32, device=device)
    flat = TileMap(q=torch.full((V // 256, n), 127, dtype=torch.int8, device=device), block_v=256, perm=perm,
                   zt=torch.zeros(n, device=device))
    for eps in (2.0**-12, None):  # paused (every tile live), and exact
        plan = planner.decide(p, v, eps, flat, torch.ones(n, device=device), budget=budget, costs=model)[0]
        assert not plan.use_map and (plan.strategy, plan.chunk_v, plan.row_group, plan.cost) == \
            (want.strategy, want.chunk_v, want.row_group, want.cost), plan.describe()


def test_pause_when_filtering_cannot_pay(device):
    # A map that leaves every tile live: the mapped plans cost as much as computing everything, so
    # the classifier's next calls neither walk nor sort; a peaked map does not pause. (Without the
    # mapped path's fixed cost, which at this tiny size would pause everything, and with the bytes
    # moved priced as at a real head: at D = 32 a matmul's flops are so few that the traffic of any
    # dense plan would cost more than a mapped plan of every tile.)
    from cce_autotune.tile_map import TileMap

    model = costs.CostModel(map_ms=0.0, **NO_CHUNK_HOST, flops_per_byte=5.0)
    n, V, D = 64, 512, 32
    v = BackwardVariant(block_b=16, block_v=32, block_d=16)
    p = Problem(n=n, n_all=n, V=V, D=D, elem=4, grad_bytes=4 * (n + V) * D, sorted_vocab=True, map_bytes=n * V // 32)
    perm = torch.arange(V, dtype=torch.int32, device=device)
    zt, lse = torch.zeros(n, device=device), torch.ones(n, device=device)  # every target at softmax 1/e
    flat = TileMap(q=torch.full((V // 32, n), 127, dtype=torch.int8, device=device), block_v=32, perm=perm, zt=zt)
    plan, live, chunks, pause = planner.decide(p, v, 2.0**-12, flat, lse, budget=None, costs=model)[:4]
    assert pause and not plan.use_map and live is None  # this call filters nothing either
    assert "filtering cannot pay (live tiles 100.0%)" in plan.reason
    peaked = TileMap(q=torch.full((V // 32, n), -128, dtype=torch.int8, device=device), block_v=32, perm=perm, zt=zt)
    peaked.q[0] = 127
    plan, live, chunks, pause = planner.decide(p, v, 2.0**-12, peaked, lse, budget=None, costs=model)[:4]
    assert plan.live < 0.1 and not pause and live is not None


def test_paused_classifier_skips_the_walk_then_probes_again(device, monkeypatch):
    e, c, t, _ = make_inputs((40,), 100, 32, torch.float32, peaked=2.0, device=device)
    c.requires_grad_()
    walked = []
    real = forward.lse_forward
    monkeypatch.setattr(forward, "lse_forward", lambda *a, **k: (walked.append(k.get("perm") is not None), real(*a, **k))[1])
    monkeypatch.setattr(planner, "plan_fused", lambda *a, **k: None)  # keep the paused calls on the LSE path
    kv = SMALL.replace(backward=SMALL.backward.replace(tile_map=True, filter_eps=2.0**-8))
    linear_cross_entropy(e, c, t, impl="triton", variants=kv).backward()  # sorts, remembers
    memory.pause(c, 2)
    for _ in range(3):
        linear_cross_entropy(e, c, t, impl="triton", variants=kv).backward()
    assert walked == [False, False, False, True]


def test_explain_prints_each_new_plan_once(device, monkeypatch, capsys):
    monkeypatch.setenv(explain.ENV_EXPLAIN, "1")
    explain.forget()
    e, c, t, _ = make_inputs((40,), 100, 32, torch.float32, device=device)
    for _ in range(2):
        ee = e.clone().requires_grad_()
        linear_cross_entropy(ee, c, t, impl="triton", variants=SMALL, filter_eps=None).backward()
    err = capsys.readouterr().err
    assert err.count("cce_autotune plan (n=40, V=100, D=32): backward ") == 1, err
    assert "est " in err and "MiB extra (budget" in err


def test_explain_prints_a_plan_again_when_the_check_chose_otherwise(monkeypatch, capsys):
    monkeypatch.setenv(explain.ENV_EXPLAIN, "1")
    explain.forget()
    p = Problem(n=8, n_all=8, V=100, D=4, elem=2, grad_bytes=0)
    plan = BackwardPlan(strategy="chunked", use_map=True, chunk_v=64, reason="fastest estimate")
    for checked in ("", "", "the dead-tile correction (measured)", "the dead-tile correction (measured)",
                    "filter_eps lowered to 3.8e-06 by the measured dE error (at most 0.007)"):
        explain.report(plan, p, checked)
    assert capsys.readouterr().err.count("cce_autotune plan (n=8, V=100, D=4)") == 3


# -- every plan shape against the oracle ------------------------------------------------------
_PATCHED = itertools.count(1 << 30)  # strategies' generations that no unpatched process reaches


def _patched_strategies(monkeypatch):
    """For a test that patches a strategy's function: the plans the planner keeps under the
    strategies' generation are made afresh under a generation of the test's own, which no other test
    meets (the plans of another patch were kept, then reused, with a layout of live blocks that did
    not match its chunks), and the unpatched ones are back after it."""
    monkeypatch.setattr(strategies, "_generation", [next(_PATCHED)])


def _force(monkeypatch, **shapes):
    """Make the planner produce the given shapes whatever the budget (tiny tests fit everything)."""
    if "chunk" in shapes:
        monkeypatch.setattr(chunked, "shape", lambda *a, **k: shapes["chunk"])
        _patched_strategies(monkeypatch)


MAPPED = SMALL.replace(
    lse_forward=LSEForwardVariant(block_b=16, block_v=32, block_d=16, num_splits=3),
    backward=BackwardVariant(block_b=16, block_v=32, block_d=16, tile_map=True),
)


def lm_inputs(batch, V, D, dtype, *, bias=False, seed=0, peaked=0.0, device="cpu"):
    """LM-like inputs (Zipfian targets, frequent tokens ahead for every row) in make_inputs' form:
    the data where whole vocabulary chunks are dead."""
    from cce_autotune.data import lm_like

    n = 1
    for k in batch:
        n *= k
    e, c, t = lm_like(n, V, D, dtype=torch.float32, seed=seed, entropy=1.5)
    b = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 0.1 if bias else None
    cast = lambda x: x.to(device=device, dtype=dtype) if x is not None else None  # noqa: E731
    return cast(e.view(*batch, D)), cast(c), t.view(batch).to(device), cast(b)


@pytest.mark.parametrize("strategy, shapes, dtype", [
    ("chunked", dict(chunk=(64, True, 0)), torch.bfloat16),   # several chunks, fp32 dE
    ("chunked", dict(chunk=(64, True, 32)), torch.bfloat16),  # and rows in groups (shift: holes in g)
    ("chunked", dict(chunk=(64, False, 0)), torch.bfloat16),  # dE accumulated in its own dtype
    ("chunked", dict(chunk=(64, False, 0)), torch.float32),
    ("chunked, tile products", dict(chunk=(64, True, 0)), torch.bfloat16),   # the products by live tile
    ("chunked, tile products", dict(chunk=(64, True, 32)), torch.bfloat16),  # dC summed over the groups
    ("chunked, tile products", dict(chunk=(64, False, 0)), torch.float32),   # into dE's own dtype
], ids=str)
@pytest.mark.parametrize("eps", [2.0**-12, 2.0**-6])
def test_plan_shapes_match_the_oracle(strategy, shapes, dtype, eps, device, monkeypatch, no_accuracy_guard, set_costs,
                                      planned):
    # Odd shapes, ignored rows, shift, bias, softcap, a primed order (so the map path runs); with
    # eps = 2^-6 whole chunks are dead and skipped (their target terms come from outside).
    import test_loss

    _force(monkeypatch, **shapes)
    monkeypatch.setattr(test_loss, "make_inputs", lm_inputs)
    tile_products = strategy.endswith("tile products")
    strategy = strategy.split(",")[0]
    # (the products the planner takes, by their cost; no host time, which would hide the difference)
    set_costs(tile_products=0.0 if tile_products else 1e9, **NO_CHUNK_HOST)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=eps, strategy=strategy))
    res, (e, c, t, b) = run_case((3, 41), 601, 45, dtype, variants=kv, bias=True, softcap=30.0, shift=1,
                                 ignore=0.1, peaked=3.0, filter_eps="auto", walk="sorted", device=device)
    plan = planned[-1].call.backward
    assert plan.strategy == strategy and plan.use_map and plan.tile_products == tile_products
    if strategy == "chunked" and eps == 2.0**-6:
        assert plan.live_chunks < 1.0, "the test should skip whole chunks"
    assert_within_bound(res, e[:, :-1], c, t[:, 1:], b, eps)


@pytest.mark.parametrize("layout", ["dense", "shift", "strided"])
def test_row_groups_without_a_map_match_the_oracle(layout, device, monkeypatch, planned):
    # The exact (first-call) path in row groups of 32 rows, the last one short: dense rows (E viewed
    # from each group's first row), shift (a row table with holes), a strided batch (a table, no
    # holes); deterministic with a bias (dbias summed from each group's g).
    _force(monkeypatch, chunk=(64, True, 32))
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="chunked"))
    if layout == "strided":
        e, c, t, b = make_inputs((3, 41), 301, 45, torch.bfloat16, bias=True, seed=3, device=device)
        e = e.transpose(0, 1).contiguous().transpose(0, 1)  # rows of a batch no longer one stride apart
        _, (ge, gc, gb) = grads_of(lambda e_, c_, b_: linear_cross_entropy(e_, c_, t, b_, impl="triton", variants=kv,
                                                                           deterministic=True), e, c, b)
        _, (re, rc, rb) = grads_of(lambda e_, c_, b_: torch_loss(e_, c_, t, b_), e.double(), c.double(), b.double())
        _, (pe, pc, pb) = grads_of(lambda e_, c_, b_: torch_loss(e_, c_, t, b_, compute_dtype=torch.bfloat16), e, c, b)
        for ours, ref, pt in ((ge, re, pe), (gc, rc, pc), (gb, rb, pb)):
            assert rel_err(ours, ref) <= 2 * rel_err(pt, ref) + 1e-2
    else:
        res, _ = run_case((3, 41), 301, 45, torch.bfloat16, variants=kv, bias=True, softcap=20.0,
                          shift=1 if layout == "shift" else 0, ignore=0.1, device=device)
        assert_within(res)
    plans = [r.call.backward for r in planned]
    assert plans and plans[-1].row_group == 32 and not plans[-1].use_map


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("features", ["plain", "bias+softcap+shift"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_matches_the_oracle(reduction, features, dtype, device, set_costs, planned):
    full = features != "plain"
    set_costs(fused_min_rows=1)
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="fused"))
    res, _ = run_case((3, 37), 301, 45, dtype, variants=kv, bias=full, softcap=12.0 if full else None,
                      shift=1 if full else 0, reduction=reduction, ignore=0.1, filter_eps="auto", device=device)
    seen = [r.call.forward.fused.row_block for r in planned if r.call.forward.fused is not None]
    assert seen, "the fused strategy did not run"
    assert_within(res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_scales_by_the_incoming_gradient_and_blocks_rows(dtype, device, monkeypatch, set_costs):
    # Blocks of 16 rows (dC written by the first block, summed into by the others); a loss multiplied
    # by 3 gets 3x the gradients. Buffers come unfilled (NaN here): the blocks write every element.
    set_costs(fused_min_rows=1)
    monkeypatch.setattr(fused, "extra_bytes", lambda p, R, tile_v, dc_fp32=False: R * 1000)
    _patched_strategies(monkeypatch)
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="fused"))
    e, c, t, _ = make_inputs((70,), 130, 40, dtype, device=device)
    with unwritten_is_nan():
        _, (ge, gc) = grads_of(lambda e_, c_: 3 * linear_cross_entropy(e_, c_, t, impl="triton", variants=kv,
                                                                       max_extra_memory=16 * 1000), e, c)
    _, (re, rc) = grads_of(lambda e_, c_: 3 * torch_loss(e_, c_, t), e.double(), c.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(ge, re) < tol and rel_err(gc, rc) < tol


def test_fused_de_products_sum_over_a_multiple_of_8_columns(device, monkeypatch):
    # At an odd vocabulary (GPT-2's 50257) cuBLAS takes a slow path for a product summed over V: each
    # block's dE is the last V % 8 columns' product, then the rest's (a multiple of 8) added to it;
    # g's rows are 16-byte aligned. The gradients are the float64 ones.
    from cce_autotune.strategies.common import RowLayout

    V, D, n = 301, 24, 40
    variant = BackwardVariant(block_b=16, block_v=64, block_d=16, group_b=2)
    e, c, _, _ = make_inputs((n,), V, D, torch.bfloat16, peaked=1.0, device=device)
    t = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(2)).to(device)
    coef = torch.ones(n, device=device)
    sums, strides = [], []
    mm, addmm_ = torch.mm, torch.Tensor.addmm_

    def of_c(b):  # (dE's products: g's columns against C's rows)
        return b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()

    def spy_mm(a, b, *args, **kw):
        if of_c(b):
            sums.append(a.shape[1])
            strides.append(a.stride(0))
        return mm(a, b, *args, **kw)

    def spy_addmm_(self, a, b, *args, **kw):
        if of_c(b):
            sums.append(a.shape[1])
        return addmm_(self, a, b, *args, **kw)

    monkeypatch.setattr(torch, "mm", spy_mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", spy_addmm_)
    plan = BackwardPlan(strategy="fused", use_map=False, row_block=16)
    _, _, de, dc, _ = fused.STRATEGY.run_forward(e, c, None, RowLayout.dense(n, D, device), t, coef, None, variant, plan)
    monkeypatch.undo()
    assert sums == [V % 8, V - V % 8] * 3  # three blocks of rows
    assert all(s % 8 == 0 for s in strides)
    z = e.double() @ c.double().T
    gz = torch.softmax(z, 1) - F.one_hot(t, V).double()
    assert rel_err(de, gz @ c.double()) < 1e-2 and rel_err(dc, gz.T @ e.double()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_gradient_rows_padding_holds_zeros(dtype, device):
    # g's rows are 16-byte aligned: at V = 301 they lie 304 elements apart, and the 3 columns between
    # two rows are not the gradient's. A product may read them (the CPU's bf16 GEMM multiplies them by
    # zero: left unwritten, NaN there, it gave a NaN dE), so they hold zeros. Blocks of 64 rows, the
    # buffers NaN where unwritten; dE and dC against float64.
    from cce_autotune.strategies.common import RowLayout

    V, D, n = 301, 45, 130
    variant = BackwardVariant(block_b=16, block_v=64, block_d=16, group_b=2)
    e, c, _, _ = make_inputs((n,), V, D, dtype, device=device)
    t = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(2)).to(device)
    plan = BackwardPlan(strategy="fused", use_map=False, row_block=64)
    with unwritten_is_nan():
        _, _, de, dc, _ = fused.STRATEGY.run_forward(e, c, None, RowLayout.dense(n, D, device), t,
                                                     torch.ones(n, device=device), None, variant, plan)
    z = e.double() @ c.double().T
    gz = torch.softmax(z, 1) - F.one_hot(t, V).double()
    assert torch.isfinite(de).all() and torch.isfinite(dc).all()
    assert rel_err(de, gz @ c.double()) < 1e-2 and rel_err(dc, gz.T @ e.double()) < 1e-2


@pytest.mark.parametrize("dtype, features", [(torch.float32, "plain"), (torch.bfloat16, "plain"),
                                             (torch.bfloat16, "bias+softcap"), (torch.float16, "bias+softcap")], ids=str)
def test_fused_blocks_tiles_and_pieces_against_float64(dtype, features, device):
    # The fused forward alone: 24 gathered rows in blocks of 16 (the second of 8), 700 columns in
    # logit tiles of 64 (the last of 60, each with its own maximum; D = 24 in steps of 16, the last
    # half masked) and rescaled in pieces of 128 columns (two tiles each); LSE, target logits, dE, dC,
    # dbias against float64. Unfilled buffers are NaN.
    from cce_autotune.strategies.common import RowLayout

    full = features != "plain"
    V, D, n_all = 700, 24, 30
    variant = BackwardVariant(block_b=16, block_v=64, block_d=16, group_b=2)  # (the plan's tiles: the forward's)
    e, c, _, b = make_inputs((n_all,), V, D, dtype, bias=full, peaked=1.0, device=device)
    g = torch.Generator().manual_seed(1)
    rows = torch.randperm(n_all, generator=g)[:24].sort().values.to(device)
    t = torch.randint(0, V, (24,), generator=g).to(device)
    t[12:20] = t[0]  # (a target shared by several rows, in both blocks)
    coef = (torch.rand(24, generator=g) + 0.5).to(device)
    cap = 8.0 if full else None
    layout = RowLayout(offsets=rows * D, de_offsets=rows * D)
    plan = BackwardPlan(strategy="fused", use_map=False, row_block=16)
    with unwritten_is_nan():
        lse, zt, de, dc, db = fused.STRATEGY.run_forward(e, c, b, layout, t, coef, cap, variant, plan, block_v=128)
    e64, c64 = e.double()[rows], c.double()
    z = e64 @ c64.T + (b.double() if full else 0)
    if full:
        z = cap * torch.tanh(z / cap)
    ref_lse = torch.logsumexp(z, 1)
    gz = (torch.softmax(z, 1) - F.one_hot(t, V).double()) * coef.double()[:, None]
    if full:
        gz = gz * (1 - (z / cap) ** 2)
    ref_de = torch.zeros(n_all, D, dtype=torch.float64, device=device)
    ref_de[rows] = gz @ c64
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(lse, ref_lse) < 1e-5 and rel_err(zt, z.gather(1, t[:, None])[:, 0]) < 1e-5
    assert rel_err(de, ref_de) < tol and rel_err(dc, gz.T @ e64) < tol
    assert de.dtype == e.dtype and dc.dtype == c.dtype
    if full:
        assert db.dtype == b.dtype and rel_err(db, gz.sum(0)) < tol
    else:
        assert db is None


def test_fused_is_not_used_where_it_cannot_be(device, monkeypatch, set_costs):
    # reduction "none" (per-row incoming gradients) and a returned LSE (its gradient) need a backward.
    set_costs(fused_min_rows=1)
    kv = SMALL.replace(backward=SMALL.backward.replace(strategy="fused"))
    called = []
    monkeypatch.setattr(fused.Fused, "run_forward", lambda self, *a, **k: called.append(1))
    for kw in (dict(reduction="none"), dict(return_lse=True)):
        res, _ = run_case((20,), 64, 32, torch.float32, variants=kv, filter_eps="auto", device=device, **kw)
        assert_within(res)
    assert not called


QWEN05 = Problem(n=8192, n_all=8192, V=151936, D=896, elem=2, grad_bytes=2 * (8192 + 151936) * 896, sorted_vocab=True,
                 map_bytes=8192 * -(-151936 // 256))  # Qwen 2.5 0.5B's head (its map as cce-tune explain counts it)


@pytest.mark.parametrize("strategy", ["chunked", "sparse"])
def test_a_live_tile_of_fewer_rows_costs_more(strategy):
    # A live tile loads its block_b rows of E and block_v rows of C for 2 block_b block_v D flops: a
    # 32 x 128 tile costs 1.6-1.9x a 128 x 128 tile's per unit of live share (measured on the H200 at
    # Qwen 2.5 0.5B's and Llama 3.2 1B's heads), which the per-live coefficients are fitted at.
    def plan(bb, model):
        v = BackwardVariant(block_b=bb, block_v=128, strategy=strategy)
        out = planner.plan_backward(QWEN05, v, has_map=True, live=0.34, live_blocks=1.0, budget=None, costs=model)
        assert out.strategy == strategy and out.use_map
        return out
    flat = COSTS.replace(tile_edge=0.0)  # (priced as before: the same per live tile at any shape)
    shape = strategies.base.tile_shape(COSTS, 32, 128)
    assert 1.5 < shape < 2.0 and strategies.base.tile_shape(COSTS, 128, 128) == pytest.approx(1.0)
    assert plan(128, COSTS).cost == pytest.approx(plan(128, flat).cost)
    assert plan(32, flat).cost == pytest.approx(plan(128, flat).cost)
    # Only the terms paid per live tile grow (the fixed part and the per-chunk traffic do not); the
    # chunked strategy may then take cuBLAS's products over whole chunks instead, for less.
    per_live = plan(128, COSTS).cost - plan(128, COSTS.replace(recompute=1e-9, tile_products=1e-9,
                                                               sparse_per_live=1e-9)).cost
    more = plan(32, COSTS).cost - plan(128, COSTS).cost
    if strategy == "sparse":
        assert more == pytest.approx((shape - 1) * per_live, rel=1e-6)
    else:
        assert 0 < more <= (shape - 1) * per_live * (1 + 1e-9)


def test_a_mapped_plan_of_32_row_tiles_at_a_third_live_pauses():
    # Qwen 2.5 0.5B's head with the H200's file (its entry has 32 x 128 tiles, tuned on real data) on
    # LM-like data, 34 % of the tiles live: priced as 128-row tiles the mapped plan looked cheaper than
    # the exact one and ran 1.25x slower (19.9 against 15.9 ms a call on the H100 with the H200's
    # entries); priced by its shape, the classifier pauses. Where few tiles are live it still filters.
    from cce_autotune.configdb import dispatch
    model = dispatch.costs_for("h200")
    budget = default_budget(QWEN05)
    def pauses(bb, live, m):
        v = BackwardVariant(block_b=bb, block_v=128, strategy="auto")
        plan = planner.plan_backward(QWEN05, v, has_map=True, live=live, live_blocks=1.0, budget=budget, costs=m)
        assert plan.use_map, plan.describe()
        return m.forward + plan.cost >= m.pause_share * planner.unfiltered_cost(QWEN05, v, budget, m, False)
    assert pauses(32, 0.34, model)
    assert not pauses(32, 0.34, model.replace(tile_edge=0.0))
    assert not pauses(32, 0.05, model) and not pauses(128, 0.05, model)

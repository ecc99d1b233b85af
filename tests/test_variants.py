"""Every kernel variant the tuner may pick must pass the same checks as the defaults.

The sweeps cover each knob value of the search spaces at least once (block shapes, warps, stages,
group size, splits, both LSE merges, lock counts, sorting on/off, filtering on/off), on shapes that
divide no block.
"""

import itertools

import pytest
import torch

from cce_autotune import BackwardVariant, IndexedDotVariant, KernelVariants, LSEForwardVariant, linear_cross_entropy
from helpers import grads_of, make_inputs, rel_err, torch_loss
from test_loss import SMALL, assert_within, run_case

SHAPES = [(16, 16, 16), (32, 64, 32), (64, 32, 16), (16, 128, 64)]


@pytest.mark.parametrize("block_b, block_d", [(1, 16), (16, 32), (64, 128), (256, 256)])
def test_indexed_dot_variants(block_b, block_d, device):
    kv = SMALL.replace(indexed_dot=IndexedDotVariant(block_b=block_b, block_d=block_d, num_warps=2))
    res, _ = run_case((37,), 301, 45, torch.bfloat16, bias=True, softcap=7.0, variants=kv, device=device)
    assert_within(res)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("merge, num_locks, num_splits", [("buffer", 64, 1), ("buffer", 64, 7), ("lock", 1, 64), ("lock", 4, 3)])
def test_lse_forward_variants(shape, merge, num_locks, num_splits, device):
    bb, bv, bd = shape
    v = LSEForwardVariant(block_b=bb, block_v=bv, block_d=bd, merge=merge, num_locks=num_locks,
                          num_splits=num_splits, group_b=1 if num_splits == 7 else 4, num_warps=4, num_stages=2)
    res, _ = run_case((37,), 301, 45, torch.float32, variants=SMALL.replace(lse_forward=v), bias=True, device=device)
    assert_within(res)


@pytest.mark.parametrize("splits, n", [(2, 1), (3, 1025), (7, 1500)])
def test_the_splits_merge_as_torch_logsumexp(splits, n, device):
    # merge="buffer": the splits' partial LSEs merged by one kernel, as torch.logsumexp over the splits,
    # infinities and NaN included (a row of -inf partials gives -inf, a +inf +inf, a NaN NaN).
    from cce_autotune.strategies.forward import merge_splits

    g = torch.Generator().manual_seed(splits)
    parts = torch.randn(splits, n, generator=g) * 30
    parts[:, 0] = float("-inf")
    if n > 3:
        parts[0, 1], parts[splits - 1, 2], parts[1, 3] = float("inf"), float("nan"), float("-inf")
    parts = parts.to(device)
    got, want = merge_splits(parts), torch.logsumexp(parts, dim=0)
    assert got.shape == (n,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6, equal_nan=True)
    assert got[0] == float("-inf") and (n <= 3 or (got[1] == float("inf") and got[2].isnan()))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_exact_variants(shape, dtype, device):
    bb, bv, bd = shape
    v = BackwardVariant(block_b=bb, block_v=bv, block_d=bd, filter_eps=None, sort_vocab=False, group_b=2, num_warps=4,
                        num_stages=2)
    res, _ = run_case((37,), 301, 45, dtype, variants=SMALL.replace(backward=v), bias=True, softcap=9.0,
                      shift=1, device=device)
    assert_within(res)


def assert_within_bound(res, e, c, t, b, eps):
    """:func:`assert_within`, the dE and dC errors allowed what a filter of ``eps`` may drop
    (:func:`filtered_bound`; dbias, bounded like dC, checked through it); without a filter (``eps``
    None) as it is."""
    if eps is not None:
        bound_de, bound_dc = filtered_bound(e, c, t, b, eps)
        res["dE"] = (res["dE"][0], res["dE"][1] + bound_de)
        res["dC"] = (res["dC"][0], res["dC"][1] + bound_dc)
        res.pop("dbias", None)
    assert_within(res)


def filtered_bound(e, c, t, b, eps, reduction="mean"):
    """Upper bound on the relative dE/dC error that skipping tiles with all softmax < eps can cause.

    Only softmax entries < eps can be dropped, so the dropped gradient G_s
    satisfies ||dE error|| <= ||G_s||_F ||C||_2 and ||dC error|| <= ||G_s||_F ||E||_2.
    """
    e64, c64 = e.double().reshape(-1, e.shape[-1]), c.double()
    z = e64 @ c64.T + (b.double() if b is not None else 0)
    s = torch.softmax(z, dim=1)
    n = t.numel() if reduction == "mean" else 1
    # Every entry below eps may be dropped, the target's softmax part included (with a tile map the
    # onehot term is added separately and a target does not keep its tile live).
    small = torch.where(s < eps, s / n, 0.0)
    (_, (ge, gc)) = grads_of(lambda e_, c_: torch_loss(e_, c_, t, b.double() if b is not None else None), e.double(), c.double())
    g_norm = small.norm()
    return float(g_norm * torch.linalg.matrix_norm(c64, 2) / ge.norm()), float(g_norm * torch.linalg.matrix_norm(e64, 2) / gc.norm())


@pytest.mark.parametrize("sort_vocab", [True, False])
@pytest.mark.parametrize("eps", [2.0**-12, 2.0**-6])
def test_backward_filtered_variants_within_eps_bound(sort_vocab, eps, device, no_accuracy_guard):
    # Filtering skips tiles through the forward's tile map, made in a sorted order (a classifier whose
    # order a previous call left): unsorted, the call is exact.
    v = BackwardVariant(block_b=16, block_v=32, block_d=16, sort_vocab=sort_vocab, filter_eps=eps, group_b=4)
    dtype = torch.float32
    res, (e, c, t, b) = run_case((37,), 301, 45, dtype, variants=SMALL.replace(backward=v), bias=True,
                                 peaked=2.0, filter_eps="auto", walk="sorted" if sort_vocab else None, device=device)
    assert_within_bound(res, e, c, t, b, eps)


@pytest.mark.parametrize("num_warps, num_stages", [(1, 1), (2, 3), (4, 4), (8, 5), (16, 2)])
@pytest.mark.parametrize("group_b", [1, 8, 64])
def test_launch_knobs(num_warps, num_stages, group_b, device):
    # Warps and stages only change code generation on a GPU; in the interpreter they must still be
    # accepted and leave results intact. Group size changes the program order (swizzle).
    kv = KernelVariants(
        indexed_dot=IndexedDotVariant(block_b=16, block_d=16, num_warps=num_warps, num_stages=num_stages),
        lse_forward=LSEForwardVariant(block_b=16, block_v=16, block_d=16, group_b=group_b, num_splits=5,
                                      num_warps=num_warps, num_stages=num_stages),
        backward=BackwardVariant(block_b=16, block_v=16, block_d=16, group_b=group_b, filter_eps=None,
                                 num_warps=num_warps, num_stages=num_stages),
    )
    res, _ = run_case((45,), 100, 33, torch.float32, variants=kv, bias=True, device=device)
    assert_within(res)


def _covering_variants(kernel, seed=0, max_draws=20000):
    """Feasible variants of the packaged search space (at the gemma2 / llama3 shapes), each taking
    some knob value not yet taken, until every value of every knob is taken (yielded lazily; the
    caller sends back whether the variant could be built on this device)."""
    import random

    from cce_autotune.tuner.space import SpaceContext, load_space

    space = load_space(kernel)
    contexts = [SpaceContext(B=8192, V=V, D=D, elem_bytes=2, smem_limit=232448) for V, D in ((256128, 2304), (128256, 4096))]
    todo = {(k, repr(v)) for k, vs in space.knobs.items() for v in vs}
    rng = random.Random(seed)
    for _ in range(max_draws):
        if not todo:
            break
        k_fix, v_fix = rng.choice(sorted(todo))
        params = {k: rng.choice(vs) for k, vs in space.knobs.items()}
        params[k_fix] = next(v for v in space.knobs[k_fix] if repr(v) == v_fix)
        if space.violated(params, rng.choice(contexts)) is not None:
            continue
        covered = {(k, repr(v)) for k, v in params.items()} & todo
        if covered:
            built = yield space.variant(params)
            if built:
                todo -= covered
    yield todo  # what is left uncovered (empty when every value was exercised)


@pytest.mark.parametrize("kernel", ["indexed_dot", "lse_forward", "backward"])
def test_every_search_space_value_passes_the_oracle(kernel, device):
    # Every value any knob of the packaged search space can take, in feasible combinations, must give
    # correct results on a shape that divides no block (correctness never depends on the shape rules).
    # On a GPU a combination that the compiler cannot build (e.g. ptxas out of registers) is what the
    # tuner records as a failed trial; then another combination must cover those values.
    pytest.importorskip("optuna", reason="the search spaces are read through the tuner (Optuna)")
    from triton.compiler.errors import TritonError as CompileError
    from triton.runtime.errors import TritonError as RuntimeTritonError

    gen = _covering_variants(kernel)
    item, built = next(gen), None
    while not isinstance(item, set):
        v = item
        v.validate(elem_bytes=2)
        kv = SMALL.replace(**{kernel: v})
        eps = v.filter_eps if kernel == "backward" else None
        try:
            res, (e, c, t, b) = run_case((37,), 301, 45, torch.float32, variants=kv, bias=True, softcap=8.0,
                                         filter_eps="auto" if kernel == "backward" else None, peaked=1.0,
                                         device=device, walk="sorted" if getattr(v, "tile_map", False) else None)
            built = True
        except (CompileError, RuntimeTritonError):
            if device == "cpu":
                raise
            built = False
        if built:
            assert_within_bound(res, e, c, t, b, eps)
        item = gen.send(built)
    assert not item, f"no feasible variant exercised {sorted(item)}"


@pytest.mark.parametrize("chunk_v", [64, 128, 1024])
@pytest.mark.parametrize("sort_vocab, eps", [(False, None), (True, 2.0**-6), (False, 2.0**-12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_chunked_strategy(chunk_v, sort_vocab, eps, dtype, device):
    # The chunked strategy (g buffer + cuBLAS products) with several chunks (V=301), ignored rows,
    # shift, bias and softcap; filtered runs stay within the filter bound.
    v = BackwardVariant(block_b=16, block_v=32, block_d=16, strategy="chunked", chunk_v=chunk_v,
                        sort_vocab=sort_vocab, filter_eps=eps)
    res, (e, c, t, b) = run_case((37,), 301, 45, dtype, variants=SMALL.replace(backward=v), bias=True,
                                 softcap=9.0, peaked=1.5, ignore=0.1, filter_eps="auto", device=device)
    assert_within_bound(res, e, c, t, b, eps)

"""Determinism: the same gradient bits run to run (deterministic=True, or torch's setting), in the
default filtered mode too, as accurate as filtering allows."""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs, rel_err

from cce_autotune import linear_cross_entropy


# Determinism: the same gradient bits run to run, in the default filtered mode too.
def _deterministic_run(device, deterministic, bias=True, strategy="sparse"):
    """Two training-like calls (the second walks the first's order and launches from its map) from
    a clean slate; returns the second call's gradients and the strategies the planner ran."""
    from test_tile_map import MAPPED

    from cce_autotune import memory
    from cce_autotune.planning import explain

    memory.clear()
    e, c, t, b = make_inputs((61,), 300, 45, torch.float32, bias=bias, peaked=2.0, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(strategy=strategy, filter_eps=2.0**-10),
                        lse_forward=MAPPED.lse_forward.replace(merge="lock"))
    cc = c.clone().requires_grad_()  # (one classifier: the second call walks the order the first sorted)
    with explain.recording() as made:
        for _ in range(2):
            ee = e.clone().requires_grad_()
            cc.grad = None
            bb = b.clone().requires_grad_() if b is not None else None
            linear_cross_entropy(ee, cc, t, bb, variants=kv, filter_eps="auto", impl="triton",
                                 deterministic=deterministic).backward()
    return (ee.grad, cc.grad, bb.grad if bb is not None else None), [r.call.backward.strategy for r in made]

@pytest.mark.parametrize("bias", [False, True])
def test_deterministic_gradients_are_bitwise_identical_and_accurate(bias, device):
    (ge, gc, gb), plans = _deterministic_run(device, True, bias=bias)
    assert plans == ["chunked", "chunked"]  # the variant asked for sparse (not marked deterministic)
    (ge2, gc2, gb2), _ = _deterministic_run(device, True, bias=bias)
    assert torch.equal(ge, ge2) and torch.equal(gc, gc2) and (gb is None or torch.equal(gb, gb2))
    _, plans = _deterministic_run(device, False, bias=bias)
    assert plans[-1] == "sparse"  # (from the map the second call launches from; the first has none)
    # As accurate as filtering allows: against the float64 oracle, within the bound filter_eps implies.
    from helpers import grads_of, torch_loss
    from test_variants import filtered_bound

    e, c, t, b = make_inputs((61,), 300, 45, torch.float32, bias=bias, peaked=2.0, device=device)
    _, (re, rc, rb) = grads_of(lambda e_, c_, b_: torch_loss(e_, c_, t, b_), e.double(), c.double(),
                               b.double() if b is not None else None)
    bound_de, bound_dc = filtered_bound(e, c, t, b, 2.0**-10)
    assert rel_err(ge, re) < 1e-5 + bound_de and rel_err(gc, rc) < 1e-5 + bound_dc
    if gb is not None:
        assert rel_err(gb, rb) < 1e-5 + bound_dc

def test_deterministic_follows_torch_setting(device):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        _, plans = _deterministic_run(device, None)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert plans == ["chunked", "chunked"]


@pytest.mark.parametrize("classifier", [torch.bfloat16, torch.float32])
def test_exact_calls_do_not_depend_on_earlier_calls(classifier, device):
    """The README's promise for resumed runs: an exact call's gradient bits are those of the same call
    in a fresh process state, whatever the classifier's earlier calls measured (the filtered calls
    before it sort the vocabulary, launch from their maps and leave verdicts behind)."""
    from test_tile_map import MAPPED

    from cce_autotune import memory
    from cce_autotune.planning import explain

    memory.clear()
    e, c, t, _ = make_inputs((61,), 300, 45, torch.bfloat16, peaked=2.0, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-10))
    cc = c.to(classifier).clone().requires_grad_()  # (one classifier, changed in place as a step would)
    g = torch.Generator(device=device).manual_seed(0)

    def call(filt):
        ee = e.clone().requires_grad_()
        cc.grad = None
        linear_cross_entropy(ee, cc, t, variants=kv, filter_eps=filt, impl="triton", deterministic=True).backward()
        return ee.grad, cc.grad

    with explain.recording() as made:
        for _ in range(3):
            call("auto")
            with torch.no_grad():
                cc.add_(torch.randn(cc.shape, generator=g, device=device).to(classifier), alpha=0.01)
    assert any(r.call.backward.use_map for r in made)  # (the history launched from maps: there is state)
    after_history = call(None)
    memory.clear()
    fresh = call(None)
    assert all(torch.equal(a, b) for a, b in zip(after_history, fresh))

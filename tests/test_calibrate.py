"""The planner's cost coefficients: the fit recovers a known model from times it would predict."""

import math
from dataclasses import replace

import pytest

pytest.importorskip("optuna", reason="the tuner needs Optuna (not in the GPU image)")  # noqa: E402

from cce_autotune.configdb import dispatch
from cce_autotune.planning import costs
from cce_autotune.tuner import calibrate


def _measurement(true, B, V, D, live, live_chunks):
    m = calibrate.synthetic(true, B, V, D, live, live_chunks)
    assert [s.name for s in m.samples] == ["forward"] + [run[0] for run in calibrate.STRATEGIES]
    assert all(s.plan.strategy == run[1] for s, run in zip(m.samples[1:], calibrate.STRATEGIES))
    return m


def test_fit_recovers_the_coefficients_that_made_the_times():
    true = costs.CostModel(forward=1.6, sparse_per_live=12.0, recompute=0.9,
                   products=2.6, flops_per_byte=240.0)
    ms = [_measurement(true, 8192, 256128, 2304, 0.12, 0.5), _measurement(true, 8192, 50257, 768, 0.45, 0.9)]
    # (the shifted run's rows are not dense: cuBLAS's products per live chunk, which separate
    # `products` from `recompute`)
    assert all(not s.plan.tile_products and s.plan.use_map for m in ms for s in m.samples if s.name == "chunked_shifted")
    got, notes = calibrate.fit(ms, base=costs.CostModel())
    for name in calibrate.FITTED:
        assert math.isclose(getattr(got, name), getattr(true, name), rel_tol=0.03), (name, got, true)
    assert math.isclose(got.flops_per_byte, 240.0, rel_tol=0.01)
    assert math.isclose(got.matmul_tflops, true.matmul_tflops, rel_tol=0.01)
    assert len(notes) == 2 and "estimate vs measured" in notes[0]
    section = calibrate.to_section(got, "NVIDIA H200", ms)
    assert section["sparse_per_live"] == got.sparse_per_live and "NVIDIA H200" in section["note"]


def test_fit_keeps_what_no_sample_informs_and_refuses_nothing_to_fit():
    true = costs.CostModel(recompute=1.6)
    m = _measurement(true, 4096, 32768, 4096, 0.3, 0.7)
    m = replace(m, samples=tuple(s for s in m.samples if s.name in ("forward", "chunked_exact")))
    got, notes = calibrate.fit([m], base=costs.CostModel())
    assert got.sparse_per_live == costs.CostModel().sparse_per_live
    assert any("no sample informs" in n and "sparse_per_live" in n for n in notes)
    with pytest.raises(ValueError, match="measurements"):
        calibrate.fit([])


def test_set_cost_model_overrides_the_file_in_process():
    mine = costs.CostModel(sparse_per_live=3.25)
    costs.set_cost_model("h200", mine)
    try:
        assert dispatch.costs_for("h200") is mine
    finally:
        costs.set_cost_model("h200", None)
    assert dispatch.costs_for("h200").sparse_per_live != 3.25 or costs.CostModel().sparse_per_live == 3.25

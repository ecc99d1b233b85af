"""The planner's cost coefficients, measured on this GPU: the first step of a tuning plan.

The planner (:mod:`cce_autotune.planning.planner`) prices each backward strategy in matmuls of the
shape with a :class:`~cce_autotune.planning.costs.CostModel`. Its coefficients differ between GPUs (and between
versions of the kernels), so ``cce-tune`` measures them before it tunes any knob, and writes them
into the GPU's file (``cost_model:``), where the dispatcher finds them at run time.

:func:`measure` (GPU) times, on one head and its data, in the call sequence of training (the
classifier moves a little before every call):

- one cuBLAS matmul of the shape, its vocabulary padded to a multiple of 128 (-> ``matmul_tflops``)
  and a device copy (-> ``flops_per_byte``, the matmul rate over the memory bandwidth);
- the forward alone, and forward + backward with the strategy forced to each strategy's calibration
  runs (``Strategy.calibration``: filtered with the tile map, or exact; the chunked strategy's also
  with the targets shifted along sequences, its rows then not dense), without a memory budget (so
  that each forced strategy runs); each with the plan the planner made for it (recorded by
  :func:`cce_autotune.planning.explain.recording`: the live shares, windows, chunk width and memory
  budget it saw).

:func:`fit` then finds the coefficients marked ``fitted`` (``forward`` and each strategy's own)
whose estimates (the planner's own formulas, re-evaluated on each recorded plan) best match the
measured times, in the least-squares sense on the log scale, over all measured heads; the fixed host
costs (``map_ms``, ``chunk_ms``, ...) keep their values.
Both halves are separate so that the fit is tested on the CPU with times made up from a known model.
"""

from __future__ import annotations

import datetime
import math
import statistics
from dataclasses import dataclass, replace
from typing import Callable

from .. import strategies
from ..api import linear_cross_entropy
from ..data import TORCH_DTYPES, make_data
from ..planning import costs as cost_models
from ..planning import explain, planner
from ..planning.costs import CostModel
from ..plans import BackwardPlan, CallProblem
from ..variant import KernelVariants

__all__ = ["Sample", "Measurement", "measure", "fit", "synthetic", "FITTED", "STRATEGIES", "to_section"]

# The coefficients the fit moves, in the order it moves them.
FITTED = tuple(name for name, c in cost_models.coefficients().items() if c.fitted)
# (name, strategy forced, exact gradients, shifted targets): the runs of one head
STRATEGIES = tuple((run[0], s.name, run[1], len(run) > 2 and run[2])
                   for s in strategies.all_strategies() for run in s.calibration)
SEQ = 1024  # tokens a sequence in the shifted runs
_BOUNDS = (0.05, 200.0)


@dataclass(frozen=True)
class Sample:
    """One timed run: ``total_ms`` of forward + backward (or of the forward alone, ``name ==
    "forward"``) and what the planner decided for it."""

    name: str
    total_ms: float
    plan: object | None = None  # BackwardPlan (None for the forward alone)
    problem: object | None = None  # CallProblem
    variant: object | None = None  # the BackwardVariant it ran with
    exact: bool = False


@dataclass(frozen=True)
class Measurement:
    """What :func:`measure` found on one head."""

    B: int
    V: int
    D: int
    data: str
    mm_ms: float
    copy_gbs: float  # device copy, GB/s (read + write)
    samples: tuple

    @property
    def matmul_tflops(self) -> float:
        return 2.0 * self.B * self.V * self.D / (self.mm_ms * 1e9)

    @property
    def flops_per_byte(self) -> float:
        return self.matmul_tflops * 1e3 / self.copy_gbs


def _estimate(s: Sample, costs: CostModel) -> float:
    """The planner's estimate for sample ``s`` under ``costs``, in matmuls of the shape."""
    if s.name == "forward":
        return costs.forward
    strategy = strategies.get(s.plan.strategy)
    if strategy.in_forward:
        return strategy.forward_cost(s.problem, costs, s.plan)
    plan = planner.plan_backward(
        s.problem, s.variant.replace(strategy=s.plan.strategy), has_map=s.plan.use_map, live=s.plan.live,
        live_blocks=s.plan.live_chunks, budget=s.plan.budget, costs=costs, exact=s.exact)
    return costs.forward + plan.cost


def fit(measurements, base: CostModel | None = None, iterations: int = 40) -> tuple[CostModel, list[str]]:
    """Coefficients that best explain ``measurements`` (a list of :class:`Measurement`), starting from
    ``base``; returns them and notes (per-head errors of the fit, coefficients no sample informs)."""
    base = base or CostModel()
    if not measurements:
        raise ValueError("measurements: nothing to fit")
    tflops = statistics.median(m.matmul_tflops for m in measurements)
    fpb = statistics.median(m.flops_per_byte for m in measurements)
    costs = base.replace(matmul_tflops=round(tflops, 1), flops_per_byte=round(fpb, 1))
    points = []  # (sample, measured matmuls, mm_ms under the fitted rate)
    for m in measurements:
        for s in m.samples:
            if s.total_ms > 0 and math.isfinite(s.total_ms):
                points.append((s, s.total_ms / m.mm_ms))
    if not points:
        raise ValueError("measurements: no usable timing")

    def loss(c: CostModel) -> float:
        return sum((math.log(max(_estimate(s, c), 1e-9)) - math.log(y)) ** 2 for s, y in points)

    informed = {n for n in FITTED if any(_slope(s, costs, n) for s, _ in points)}
    for _ in range(iterations):
        before = loss(costs)
        for name in FITTED:
            if name in informed:
                costs = _line_search(costs, name, loss)
        if before - loss(costs) < 1e-10:
            break
    notes = []
    for m in measurements:
        errs = ", ".join(f"{s.name} {(_estimate(s, costs) * m.mm_ms / s.total_ms - 1) * 100:+.0f}%" for s in m.samples)
        notes.append(f"B={m.B} V={m.V} D={m.D} ({m.data}): matmul {m.mm_ms:.2f} ms; estimate vs measured: {errs}")
    missing = [n for n in FITTED if n not in informed]
    if missing:
        notes.append(f"no sample informs {', '.join(missing)}: kept {', '.join(f'{getattr(base, n):g}' for n in missing)}")
    return costs, notes


def _slope(s: Sample, costs: CostModel, name: str) -> bool:
    """Whether coefficient ``name`` changes sample ``s``'s estimate (it informs the fit)."""
    bumped = costs.replace(**{name: getattr(costs, name) * 1.5})
    return abs(_estimate(s, bumped) - _estimate(s, costs)) > 1e-9


def _line_search(costs: CostModel, name: str, loss: Callable) -> CostModel:
    """Golden-section search of log(coefficient) within a factor 4 of its value (and the bounds)."""
    x0 = math.log(getattr(costs, name))
    lo, hi = max(math.log(_BOUNDS[0]), x0 - math.log(4)), min(math.log(_BOUNDS[1]), x0 + math.log(4))
    f = lambda x: loss(costs.replace(**{name: math.exp(x)}))  # noqa: E731
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(40):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    x = (a + b) / 2
    return costs.replace(**{name: round(math.exp(x), 4)}) if f(x) <= f(x0) else costs


def to_section(costs: CostModel, device: str, measurements, notes=()) -> dict:
    """The ``cost_model:`` section of a tuned-config file for ``costs``, with its provenance."""
    heads = "; ".join(f"B={m.B} V={m.V} D={m.D} {m.data}" for m in measurements)
    section = costs.to_dict()
    section["measured_on"] = datetime.date.today().isoformat()
    section["note"] = f"fitted by cce-tune on {device} ({heads})"
    return section


def synthetic(true: CostModel, B: int, V: int, D: int, live: float = 0.2, live_chunks: float = 0.6,
              data: str = "lm") -> Measurement:
    """The measurement a GPU that follows ``true`` exactly would give on one head (every strategy's
    plan made by the planner at the given live shares): for tests and the CPU's fake backend."""
    mm_ms = 2.0 * B * V * D / (true.matmul_tflops * 1e9)
    variant = KernelVariants.defaults(2).backward
    p = CallProblem(n=B, n_all=B, V=V, D=D, elem=2, grad_bytes=2 * (B + V) * D, sorted_vocab=True,
                    map_bytes=B * V // 64)
    samples = [Sample("forward", true.forward * mm_ms)]
    for name, strategy, exact, shifted in STRATEGIES:
        q = replace(p, n=B - B // SEQ, dense_rows=False) if shifted else p
        if strategies.get(strategy).in_forward:
            plan = BackwardPlan(strategy=strategy, use_map=False, row_block=min(B, 1024))
        else:
            plan = planner.plan_backward(q, variant.replace(strategy=strategy), has_map=not exact,
                                         live=None if exact else live, live_blocks=None if exact else live_chunks,
                                         budget=None, costs=true, exact=exact)
        s = Sample(name, 1.0, plan, q, variant, exact)
        samples.append(replace(s, total_ms=_estimate(s, true) * mm_ms))
    copy_gbs = 2.0 * B * V * D / (mm_ms * 1e9) * 1e3 / true.flops_per_byte
    return Measurement(B, V, D, data, mm_ms, copy_gbs, tuple(samples))


# -- measuring (GPU) --------------------------------------------------------------------------
def measure(B: int, V: int, D: int, *, data: str = "lm", dtype: str = "bf16", seed: int = 0, rep_ms: int = 100,
            log: Callable[[str], None] | None = None) -> Measurement:
    """Time the runs the fit needs on one head (see the module docstring). Needs a CUDA GPU."""
    import torch
    import triton.testing


    e, c, t = make_data(data, B, V, D, dtype=TORCH_DTYPES[dtype], device="cuda", seed=seed)
    bench = lambda fn, **kw: float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, **kw))  # noqa: E731
    # The unit: a cuBLAS matmul of the shape with the vocabulary padded to a multiple of 128 (an odd V
    # such as GPT-2's 50,257 makes cuBLAS take a path 7x slower, which the kernels never take).
    Vp = -(-V // 128) * 128
    c_pad = torch.zeros(Vp, D, dtype=c.dtype, device=c.device)
    c_pad[:V] = c
    mm_ms = bench(lambda: e @ c_pad.T) * V / Vp
    del c_pad
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(buf)
    copy_gbs = 2 * buf.numel() / (bench(lambda: out.copy_(buf)) * 1e6)
    del buf, out
    defaults = KernelVariants.defaults(4 if dtype == "fp32" else 2)
    drift = torch.randn_like(c) * (0.01 * float(c.float().std()))
    cc = c.clone().requires_grad_()
    ee = e.detach().requires_grad_()
    sign = [1.0]

    def step():  # the classifier moves before every call, as in training
        with torch.no_grad():
            cc.add_(drift, alpha=sign[0])
        sign[0] = -sign[0]

    samples = []
    fw = lambda: (step(), linear_cross_entropy(ee, cc, t, variants=defaults))  # noqa: E731
    fw()  # a first call (records the classifier's order)
    samples.append(Sample("forward", bench(fw)))
    for name, strategy, exact, shifted in STRATEGIES:
        kv = defaults.replace(backward=defaults.backward.replace(strategy=strategy))
        eps = None if exact else "auto"
        # (shifted: the rows as sequences of SEQ tokens, each predicting the next: not E's rows in order)
        shift = int(shifted and B % SEQ == 0)
        args = (ee.view(-1, SEQ, D), cc, t.view(-1, SEQ)) if shift else (ee, cc, t)

        def fwbw():
            step()
            # (no memory budget: the forced strategy runs, as the sparse one would not within the
            # default one; the plan recorded says how it ran)
            linear_cross_entropy(*args, variants=kv, filter_eps=eps, max_extra_memory=None, shift=shift).backward()

        try:
            fwbw()
            with explain.recording() as made:
                fwbw()
            found = made[-1] if made else None
            ms = bench(fwbw, grad_to_none=[ee, cc])
        except Exception as exc:  # a strategy that cannot run here informs nothing
            if log:
                log(f"calibrate {B}x{V}x{D}: {name} failed ({type(exc).__name__}: {exc}); skipped")
            continue
        if found is None:
            continue
        plan, problem = found.plan, found.problem
        samples.append(Sample(name, ms, plan, problem, kv.backward, exact))
        if log:
            live = "" if plan.live is None else f", live tiles {plan.live:.1%}"
            log(f"calibrate {B}x{V}x{D} {data}: {name:14s} ran {plan.strategy}{live}: {ms:.2f} ms "
                f"({ms / mm_ms:.2f} mm)")
    return Measurement(B, V, D, data, mm_ms, copy_gbs, tuple(samples))

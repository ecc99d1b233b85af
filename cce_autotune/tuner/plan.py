"""Plans: every study to run for a GPU (kernel x dtype x V x D x B bucket x flags), described with an
estimated time, and run one after another (or by worker processes), keeping each study's winner."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from .. import heads as heads_table
from ..configdb import dispatch
from ..configdb.store import Entry
from ..planning import costs as cost_models
from .backends import Backend
from .problem import DATA_KINDS, KERNEL_NAMES, Gate, StudySpec, TuningProblem, _bucket
from .space import load_space
from .study import default_storage_url, finalize, make_storage, run_study, warm_starts
from .workers import _study_timeout, run_workers

# -- plans ------------------------------------------------------------------------------------
GENERIC_HIDDEN = [2048, 4096]  # for a vocabulary no known head has


def default_hidden(V: int) -> tuple[list[int], str]:
    """Hidden sizes to tune for vocabulary ``V`` when none are given (those of the known heads with
    that vocabulary, :mod:`cce_autotune.heads`), and a note saying why."""
    known = heads_table.by_vocab(V)
    if known:
        sizes = list(dict.fromkeys(h.D for h in known))
        return sizes, (f"--hidden not given: V={V} is {heads_table.describe(known)}; tuning D={', '.join(map(str, sizes))}"
                       " (--hidden chooses)")
    return list(GENERIC_HIDDEN), (f"--hidden not given: V={V} is not a known model's vocabulary, tuning the "
                                  f"common D={', '.join(map(str, GENERIC_HIDDEN))}")


def known_softcap(V: int, D: int) -> float | None:
    """The softcap of the known head(s) of shape (``V``, ``D``) when they all have the same one."""
    caps = {h.softcap for h in heads_table.find(V, D)}
    return caps.pop() if len(caps) == 1 else None


@dataclass
class TuningPlan:
    gpu: str
    studies: list  # of StudySpec
    notes: list = field(default_factory=list)
    budget_minutes: float | None = None


def make_plan(gpu: str, vocabs: Sequence[int], hiddens: Sequence[int] | None = None,
              tokens: Sequence[int] = (4096, 8192, 16384), dtypes: Sequence[str] = ("bf16",),
              kernels: Sequence[str] = KERNEL_NAMES, flag_sets: Sequence[tuple] = ((False, False),),
              trials: int = 50, gate: Gate = Gate(), budget_minutes: float | None = None,
              data: str = "lm", data_id: str = "", softcap: float = 30.0, workers: int = 1,
              heads: Sequence[tuple] = ()) -> TuningPlan:
    """Every (kernel, dtype, V, D, B bucket, flags) study to run, for each vocabulary with each hidden
    size and for each (V, D) of ``heads``, timed on ``data`` ("lm", "real", or
    an activation file's path with its digest ``data_id``); ``softcap``: the value the softcap flag
    tunes with. ``budget_minutes`` None: :data:`MINUTES_PER_HEAD` of one GPU for each head (V, D, dtype,
    flags), divided among ``workers`` GPUs."""
    notes = []
    buckets = []
    for B in tokens:
        b = _bucket(B)
        if b != B:
            notes.append(f"--tokens {B}: tuned as the power-of-two bucket B={b}")
        if b not in buckets:
            buckets.append(b)
    studies = []
    pairs = []  # (V, D) heads: each vocabulary with each hidden size (or its known models' sizes)
    for V in vocabs:
        Ds = list(hiddens) if hiddens else None
        if not Ds:
            Ds, note = default_hidden(V)
            notes.append(note)
        pairs += [(V, D) for D in Ds if (V, D) not in pairs]
    pairs += [tuple(h) for h in heads if tuple(h) not in pairs]
    for V, D in pairs:
        sets, cap = flag_sets, softcap
        own = known_softcap(V, D) if data in DATA_KINDS else None  # (an activation file has its own)
        if own is not None:
            cap = own
            if not any(f[1] for f in flag_sets):
                sets = [(b, True) for b, _ in flag_sets]
                names = ", ".join(h.name for h in heads_table.find(V, D))
                notes.append(f"V={V}, D={D} is {names}: tuned with its softcap {own:g}, as its loss is called")
        for dtype in dtypes:
            for B in buckets:
                for has_bias, has_softcap in sets:
                    problem = TuningProblem(B, V, D, dtype, has_bias, has_softcap, softcap=cap, data=data,
                                      data_id=data_id)
                    studies.extend(StudySpec(gpu, k, problem, trials, gate) for k in kernels)
    if budget_minutes is None and studies:
        heads = {replace(s.problem, B=1) for s in studies}
        budget_minutes = round(MINUTES_PER_HEAD * len(heads) / max(1, workers), 2)
        notes.append(f"--budget-minutes not given: {MINUTES_PER_HEAD:g} GPU-minutes for each of the {len(heads)} "
                     f"head(s) (V, D, dtype, flags; their token buckets and the cost calibration included) over "
                     f"{workers} worker(s): {budget_minutes:g} min")
    return TuningPlan(gpu, studies, notes, budget_minutes)


MINUTES_PER_HEAD = 8.0  # a plan's default budget per head, with its token buckets (one GPU)


# Rough wall time of one trial (compile + check + timing) and of the final re-timing, in seconds.
_TRIAL_S = {"indexed_dot": 3.0, "lse_forward": 5.0, "backward": 8.0}


def describe_plan(plan: TuningPlan, smem_limit: int | None, workers: int = 1) -> str:
    """The plan as text: each study's space size after the rules, trials, and an estimated time."""
    lines = [f"cce-tune plan for GPU {plan.gpu} "
             f"(shared memory per block {'unlimited' if smem_limit is None else f'{smem_limit} bytes'}):"]
    lines += [f"  note: {n}" for n in plan.notes]
    spaces = {k: load_space(k) for k in {s.kernel for s in plan.studies}}
    est = 0.0
    trials = 0
    for s in plan.studies:
        total, feasible = spaces[s.kernel].count(s.problem.space_context(smem_limit))
        n = min(s.n_trials, feasible)
        trials += n
        est += n * _TRIAL_S[s.kernel] + 12 * _TRIAL_S[s.kernel] / 2
        lines.append(f"  {s.kernel:<12} {s.problem.describe():<40} space {total} -> {feasible} after rules, "
                     f"{s.n_trials} trials")
    est /= max(1, workers)
    budget = ""
    if plan.budget_minutes:
        # (make_plan notes a budget it chose: then it is the default's, not a --budget-minutes given)
        if any(n.startswith("--budget-minutes not given") for n in plan.notes):
            budget = f", capped by the default budget of {plan.budget_minutes:g} minutes (--budget-minutes)"
        else:
            budget = f", capped by --budget-minutes {plan.budget_minutes:g}"
        est = min(est, plan.budget_minutes * 60)
    kernels = sorted({s.kernel for s in plan.studies}, key=KERNEL_NAMES.index)
    lines.append(f"{len(plan.studies)} studies ({', '.join(kernels)}), {trials} trials, "
                 f"{workers} worker(s): about {est / 60:.0f} min{budget}")
    return "\n".join(lines)


# -- running a plan ---------------------------------------------------------------------------
CALIBRATION_HEADS = 2  # heads the planner's coefficients are measured on, at most
CALIBRATION_B = 8192  # at the plan's token bucket nearest this


def calibration_problems(plan: TuningPlan) -> list:
    """The problems the cost coefficients are measured on: the plan's first heads (V, D, dtype, data),
    each at its token bucket nearest :data:`CALIBRATION_B`."""
    heads: dict = {}
    for s in plan.studies:
        p = s.problem
        head = (p.V, p.D, p.dtype, p.data, p.data_id)
        best = heads.get(head)
        if best is None or abs(math.log2(p.B / CALIBRATION_B)) < abs(math.log2(best.B / CALIBRATION_B)):
            heads[head] = replace(p, has_bias=False, has_softcap=False)
    return list(heads.values())[:CALIBRATION_HEADS]


def calibrate_costs(plan: TuningPlan, backend: Backend, log=None):
    """Measure the planner's cost coefficients on the plan's heads and fit them: (CostModel, section
    for the GPU's file), or None when that fails (``log`` says why)."""
    from . import calibrate  # (lazy: the planner brings PyTorch, which `cce-tune --dry-run` runs without)

    measurements = []
    for p in calibration_problems(plan):
        try:
            measurements.append(backend.calibrate(p, log=log))
        except NotImplementedError:
            if log:
                log("calibration: this backend cannot measure the planner's costs; keeping the current ones")
            return None
        except Exception as exc:  # a head that cannot be measured: the others may
            if log:
                log(f"calibration on {p.describe()} failed: {type(exc).__name__}: {exc}")
    if not measurements:
        if log:
            log("calibration: no head could be measured; keeping the current coefficients")
        return None
    try:
        costs, notes = calibrate.fit(measurements, base=dispatch.costs_for(plan.gpu))
    except Exception as exc:  # the tuning still runs, with the coefficients there were
        if log:
            log(f"calibration: the fit failed ({type(exc).__name__}: {exc}); keeping the current coefficients")
        return None
    if log:
        for n in notes:
            log(f"calibration: {n}")
        log("calibration: " + ", ".join(f"{k} {getattr(costs, k):g}" for k in
                                         calibrate.FITTED + ("matmul_tflops", "flops_per_byte")))
    return costs, calibrate.to_section(costs, backend.device_name(), measurements)


def run_plan(plan: TuningPlan, backend: Backend, storage_url: str | None = None, *, backend_name: str | None = None,
             backend_kwargs: dict | None = None, workers: int = 1, seed: int = 0,
             trial_time_limit: float | None = 120.0, top_k: int = 3, rounds: int = 3,
             on_result: Callable[[Entry], None] | None = None, progress=sys.stderr, calibrate: bool = False,
             on_costs: Callable[[dict], None] | None = None) -> list:
    """Run every study of ``plan`` and return the winning entries (``on_result`` is called with each
    as soon as its study is final, so an interruption loses nothing already won).

    ``calibrate``: first measure the planner's cost coefficients on the plan's heads (see
    :mod:`cce_autotune.tuner.calibrate`); the studies then run with them (every worker too), and
    ``on_costs`` gets the ``cost_model`` section to save. The plan's time budget covers it all."""

    storage_url = storage_url or default_storage_url()
    started = time.time()
    deadline = started + plan.budget_minutes * 60 if plan.budget_minutes else None
    log = (lambda line: (progress.write(line + "\n"), progress.flush())) if progress is not None else None
    costs = None
    if calibrate:
        found = calibrate_costs(plan, backend, log)
        if found is not None:
            costs, section = found
            cost_models.set_cost_model(plan.gpu, costs)
            if on_costs is not None:
                on_costs(section)
            if log:
                log(f"calibration took {time.time() - started:.0f} s")
    results = []

    def report(spec, entry) -> None:
        if progress is not None:
            if entry is None:
                progress.write(f"[{spec.label()}] no variant passed; nothing saved\n")
            else:
                speed = f"{entry.speedup:.2f}x the default" if entry.default_ms else "the default failed to run"
                progress.write(f"[{spec.label()}] winner {entry.median_ms:.4g} ms, {speed}\n")
            progress.flush()
        if entry is not None:
            results.append(entry)
            if on_result is not None:
                on_result(entry)

    final = dict(top_k=top_k, rounds=rounds, time_limit=trial_time_limit)
    if workers > 1:
        by_name = {s.name: s for s in plan.studies}
        run_workers(workers, backend_name or backend.name, backend_kwargs or {}, storage_url, plan.studies,
                    seed=seed, deadline=deadline, trial_time_limit=trial_time_limit,
                    costs=None if costs is None else costs.to_dict(),
                    finalize_kwargs=final,
                    on_entry=lambda name, d: report(by_name[name], None if d is None else Entry.from_dict(d)))
        return results
    storage = make_storage(storage_url)
    for i, spec in enumerate(plan.studies):
        run_study(spec, backend, storage, seed=seed, trial_time_limit=trial_time_limit,
                  timeout_s=_study_timeout(deadline, plan.studies[i:]), progress=progress,
                  warm_start=warm_starts(spec, plan.studies, storage))
        report(spec, finalize(spec, backend, storage, **final, log=log))
    return results

"""The tuner: one seeded Optuna TPE study per (GPU, kernel, dtype, D, V, B bucket, feature flags).

A trial samples the knobs of one kernel from its search space (:mod:`cce_autotune.tuner.space`); the other
two kernels stay at their built-in defaults. Then:

1. rules: a combination the space's constraints (or ``variant.validate``) rule out is recorded as
   PRUNED with ``status=infeasible`` and costs nothing (it does not count towards ``--trials``);
   a combination already measured is recorded as FAIL with ``status=duplicate`` (free, not counted);
2. render -> compile -> correctness gate: ``backend.check`` returns relative errors against the exact
   result; an error above the :class:`Gate` loses (PRUNED, ``status=gate``), whatever its speed;
3. timing: ``backend.time`` returns median / p20 / p80 milliseconds; the median is the objective.

A compile error, ``OutOfResources``, CUDA OOM, a ``RuntimeError`` or the per-trial time limit is a
PRUNED trial with ``status`` and ``reason`` in its user attributes, never a crash of the study. An
interrupted trial is marked FAIL (``status=interrupted``) and does not count, so running the same
command again resumes where it stopped: studies live in Optuna RDB storage (by default the SQLite
file ``cache_dir()/studies.db``), loaded by name. Several processes (``--workers``, or machines
sharing ``--storage``) can work on one study; each claims a trial by number before measuring it, so
the budget is shared (with at most one extra trial per racing worker, in rare races).

Finally the best few distinct configurations are re-timed interleaved, together with the built-in
default, and the fastest becomes a :class:`cce_autotune.configdb.store.Entry`.

The measuring is done by a *backend*: :class:`GPUBackend` (the real kernels, ``triton.testing.do_bench``)
or :class:`FakeBackend` (an analytic cost model with injected failures, for tests on CPU).

The modules, in the order of the flow (each imports only those before it):

- :mod:`.problem`: what is tuned: :class:`TuningProblem`, :class:`Gate`, :class:`StudySpec`, the B buckets
  and the built-in defaults (``variants_for``: a trial's variant for one kernel, defaults for the others);
- :mod:`.backends`: :class:`Backend`, :class:`GPUBackend`, :class:`FakeBackend`, :func:`make_backend`
  and :func:`classify_failure` (which failures become failed trials);
- :mod:`.study`: :func:`measure` (check -> gate -> time, under the per-trial time limit), the storage
  (:func:`make_storage`; :func:`display_url` shows its URL without the password, :func:`storage_failure`
  says why it failed, :func:`open_existing_storage` opens it for reading without creating tables),
  :func:`open_study`, the trial loop :func:`run_study` and :func:`finalize`, and the Ctrl-C guard of a
  run (:func:`stop_on_interrupt`: an interrupt swallowed inside a finalizer still stops the run);
- :mod:`.workers`: :func:`run_workers`, worker processes sharing each study through the storage (and
  ``_study_timeout``, a study's share of the time budget);
- :mod:`.plan`: :class:`TuningPlan`, :func:`make_plan`, :func:`describe_plan` and :func:`run_plan` (every
  study of a GPU);
- :mod:`.space`: the search spaces (``search_spaces/<kernel>.yaml``), :mod:`.calibrate`: the
  planner's cost coefficients measured and fitted before the studies run.

This package re-exports the names of all five. It knows Optuna but not the YAML layout of the
database (it hands :class:`Entry` objects to the caller, which saves them with
:mod:`cce_autotune.configdb.store`).
"""

from __future__ import annotations

import sqlalchemy  # noqa: F401 - (kept importable as tune.sqlalchemy; the CLI catches STORAGE_ERRORS)
import sqlalchemy.exc  # noqa: F401

from .. import codegen  # noqa: F401
from ..variant import KernelVariants  # noqa: F401
from .backends import (  # noqa: F401
    _BACKENDS,
    _FATAL_CUDA,
    Backend,
    DeviceLost,
    FakeBackend,
    GPUBackend,
    NoGPUError,
    TrialTimeout,
    _compilation_error,
    _matches,
    _rel_err,
    classify_failure,
    make_backend,
)
from .plan import (  # noqa: F401
    _TRIAL_S,
    CALIBRATION_B,
    CALIBRATION_HEADS,
    GENERIC_HIDDEN,
    MINUTES_PER_HEAD,
    TuningPlan,
    calibrate_costs,
    calibration_problems,
    default_hidden,
    describe_plan,
    make_plan,
    run_plan,
)
from .problem import (  # noqa: F401
    _BYTES,
    DATA_KINDS,
    GRADIENT_ERRORS,
    KERNEL_NAMES,
    Gate,
    StudySpec,
    TuningProblem,
    _bucket,
    _defaults,
    variants_for,
)
from .space import load_space  # noqa: F401
from .study import (  # noqa: F401
    STORAGE_ATTEMPTS,
    STORAGE_ERRORS,
    Outcome,
    StorageFailed,
    StudyStats,
    _alternative,
    _ask_fixed,
    _distributions,
    _measured,
    _open_storage,
    _params_key,
    _Progress,
    _retime,
    _storage,
    _summary,
    _time_limit,
    _worker_dead,
    check_existing_storage,
    check_interrupt,
    default_storage_url,
    display_url,
    finalize,
    hide_secrets,
    interrupt_requested,
    make_storage,
    measure,
    open_existing_storage,
    open_study,
    run_study,
    sibling_best,
    stop_on_interrupt,
    tuned_before,
    warm_starts,
    storage_failure,
)
from .workers import FINALIZE_S, WEIGHT, WorkersFailed, _study_timeout, _worker_main, run_workers  # noqa: F401

__all__ = [
    "KERNEL_NAMES",
    "TuningProblem",
    "Gate",
    "StudySpec",
    "TuningPlan",
    "Outcome",
    "StudyStats",
    "Backend",
    "GPUBackend",
    "FakeBackend",
    "NoGPUError",
    "TrialTimeout",
    "DeviceLost",
    "StorageFailed",
    "WorkersFailed",
    "STORAGE_ERRORS",
    "measure",
    "make_backend",
    "classify_failure",
    "default_hidden",
    "make_plan",
    "describe_plan",
    "default_storage_url",
    "display_url",
    "hide_secrets",
    "storage_failure",
    "check_existing_storage",
    "open_existing_storage",
    "stop_on_interrupt",
    "interrupt_requested",
    "check_interrupt",
    "make_storage",
    "open_study",
    "run_study",
    "finalize",
    "run_plan",
    "run_workers",
]

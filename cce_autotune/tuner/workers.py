"""Worker processes: several processes (worker i on GPU i) sharing each study through the storage,
then each finalising its share of the studies; and a study's share of what is left of a plan's
time budget (``_study_timeout``)."""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import sys
import time

from ..planning import costs as cost_models
from .backends import DeviceLost, make_backend
from .study import (
    STORAGE_ERRORS,
    StorageFailed,
    check_interrupt,
    finalize,
    make_storage,
    open_study,
    run_study,
    warm_starts,
    storage_failure,
)

# How a plan's time is shared: the backward's trials take longest and its speed matters most; the
# indexed dot is a small part of a call. And the time the final re-timing of a study takes (s).
WEIGHT = {"indexed_dot": 0.35, "lse_forward": 1.0, "backward": 1.8}
FINALIZE_S = {"indexed_dot": 3.0, "lse_forward": 6.0, "backward": 12.0}


def _study_timeout(deadline: float | None, remaining, workers: int = 1) -> float | None:
    """Seconds for the next study of ``remaining`` (the specs left, the next first): its weighted share
    of the time to ``deadline``, after the final re-timing of those studies (shared by ``workers``)."""
    if deadline is None:
        return None
    left = deadline - time.time()
    left -= sum(FINALIZE_S[s.kernel] for s in remaining) / max(1, workers)
    share = WEIGHT[remaining[0].kernel] / sum(WEIGHT[s.kernel] for s in remaining)
    return max(1.0, left * share)


# A worker's failure the parent re-raises (name slot of a results item; then (kind, one line)).
_FAILED = "\0failed"


class WorkersFailed(RuntimeError):
    """Worker process(es) exited with an error of their own (printed by them above)."""


def _worker_main(index: int, n_workers: int, backend_name: str, backend_kwargs: dict, storage_url: str,
                 specs: list, seed: int, deadline: float | None, trial_time_limit: float | None,
                 costs: dict | None, results, finalize_kwargs: dict) -> None:
    # The failures the parent reports in one line are sent to it, and the worker exits without a
    # traceback; Ctrl-C (which reaches every worker of the terminal's process group) exits quietly.
    try:
        _work(index, n_workers, backend_name, backend_kwargs, storage_url, specs, seed, deadline, trial_time_limit,
              costs, results, finalize_kwargs)
    except KeyboardInterrupt:
        sys.exit(130)
    except STORAGE_ERRORS as exc:
        results.put((_FAILED, ("storage", f"worker {index}: {storage_failure(exc, storage_url)}")))
        sys.exit(3)
    except DeviceLost as exc:
        results.put((_FAILED, ("device", f"worker {index}: {exc}")))
        sys.exit(3)


def _work(index: int, n_workers: int, backend_name: str, backend_kwargs: dict, storage_url: str,
          specs: list, seed: int, deadline: float | None, trial_time_limit: float | None,
          costs: dict | None, results, finalize_kwargs: dict) -> None:
    if costs is not None and specs:
        cost_models.set_cost_model(specs[0].gpu, cost_models.CostModel(**costs))
    backend = make_backend(backend_name, **backend_kwargs)
    backend.setup_worker(index)
    storage = make_storage(storage_url)
    for i, spec in enumerate(specs):
        run_study(spec, backend, storage, seed=seed, worker=index,
                  timeout_s=_study_timeout(deadline, specs[i:], n_workers),
                  trial_time_limit=trial_time_limit, warm_start=warm_starts(spec, specs, storage))
    # Each worker re-times its share of the studies (every n-th), on its own GPU.
    for spec in (specs[index::n_workers] if finalize_kwargs is not None else []):
        entry = finalize(spec, backend, storage, **finalize_kwargs,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
        results.put((spec.name, None if entry is None else entry.to_dict()))


def run_workers(n: int, backend_name: str, backend_kwargs: dict, storage_url: str, specs: list, *,
                seed: int = 0, deadline: float | None = None, trial_time_limit: float | None = 120.0,
                costs: dict | None = None, finalize_kwargs: dict | None = None, on_entry=None) -> dict:
    """Run ``n`` worker processes (worker i on GPU i) over ``specs``, sharing each study through the
    storage at ``storage_url``; with ``finalize_kwargs`` (for :func:`finalize`) each then finalises every
    n-th study. Returns {study name: entry dict or None} (``on_entry(name, entry dict)`` is called as
    each arrives). ``costs``: the planner's coefficients for the workers to use. A worker's failing
    studies database or lost GPU is raised here as :class:`StorageFailed` or :class:`DeviceLost`, any
    other failure of a worker as :class:`WorkersFailed`."""
    ctx = multiprocessing.get_context("spawn")
    # Create the studies once first, so workers never race to create them.
    storage = make_storage(storage_url)
    for spec in specs:
        open_study(spec, storage, seed)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker_main, name=f"cce-tune-worker-{i}",
                    args=(i, n, backend_name, backend_kwargs, storage_url, specs, seed, deadline, trial_time_limit,
                          costs, results, finalize_kwargs))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    found: dict = {}
    failures: list = []

    def drain(block: bool) -> None:
        while True:
            check_interrupt()  # (a safe point: a Ctrl-C swallowed while waiting stops the workers)
            try:
                name, entry = results.get(timeout=0.2 if block else 0.0)
            except queue_mod.Empty:
                return
            if name == _FAILED:
                failures.append(entry)
                continue
            found[name] = entry
            if on_entry is not None:
                on_entry(name, entry)

    try:
        while any(p.is_alive() for p in procs):
            drain(block=True)
        for p in procs:
            p.join()
        drain(block=False)
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        raise
    for kind, line in failures:
        raise (StorageFailed if kind == "storage" else DeviceLost)(line)
    bad = [f"{p.name} (exit {p.exitcode})" for p in procs if p.exitcode != 0]
    if bad:
        raise WorkersFailed(f"worker process(es) failed: {', '.join(bad)}; their errors are printed above")
    return found

"""The tuner on the fake backend: the tune -> save -> dispatch loop, failures recorded inside a study,
the correctness gate, the per-trial time limit, resume after an interruption, and two worker
processes sharing one study through SQLite."""

from __future__ import annotations

import json
import os
import math
import socket
import subprocess
import sys
import time
from collections import Counter

import pytest

optuna = pytest.importorskip("optuna", reason="the tuner needs Optuna (not in the GPU image)")
import sqlalchemy.exc
import torch
from conftest_tune import isolated, make_entry  # noqa: F401
from optuna.trial import TrialState

from cce_autotune import tuner as tune
from cce_autotune.configdb import dispatch
from cce_autotune.configdb import store as db
from cce_autotune.variant import BackwardVariant, KernelVariants

SMALL = tune.TuningProblem(B=512, V=32000, D=256)


def _url(isolated):
    return f"sqlite:///{isolated['tmp'] / 'studies.db'}"


def _trials(spec, url):
    return optuna.load_study(study_name=spec.name, storage=tune.make_storage(url)).get_trials()


def _measured(trials):
    return [t for t in trials if t.user_attrs.get("measured") and t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def test_tune_save_dispatch_loop(isolated):
    plan = tune.make_plan("h200", [32000], [256], tokens=[512], trials=10)
    backend = tune.FakeBackend()
    out = isolated["cache"] / "tuned_configs" / "h200.yaml"
    entries = tune.run_plan(plan, backend, _url(isolated), progress=None,
                            on_result=lambda e: db.save_entries(out, [e], gpu="h200"))
    assert {e.key.kernel for e in entries} == {"indexed_dot", "lse_forward", "backward"}
    stored = db.load_file(out, expect_gpu="h200").by_key()
    for e in entries:
        assert stored[e.key].variant == e.variant
        assert e.speedup >= 0.99  # the default competes in the final re-timing: never a slower winner
        assert e.template_hash and e.versions["torch"] == str(torch.__version__)
    dispatch.clear_cache()
    picked = dispatch.select("h200", "bf16", 600, 32000, 256, warn=False)
    assert picked == KernelVariants(**{e.key.kernel: e.variant for e in entries})
    assert picked.indexed_dot != KernelVariants().indexed_dot  # the model finds better than the default


def test_compile_and_resource_failures_are_recorded_not_raised(isolated):
    spec = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=14)
    backend = tune.FakeBackend(fail_compile={"block_b": 16}, fail_resources={"block_b": 64})
    stats = tune.run_study(spec, backend, _url(isolated), seed=3)
    trials = _trials(spec, _url(isolated))
    measured = _measured(trials)
    assert len(measured) == 14 == stats.total_measured
    by_status = Counter(t.user_attrs["status"] for t in measured)
    assert by_status["compile_error"] >= 1 and by_status["out_of_resources"] >= 1 and by_status["ok"] >= 1
    for t in measured:
        if t.params["block_b"] == 16:
            assert t.state == TrialState.PRUNED and "CompilationError" in t.user_attrs["reason"]
        elif t.params["block_b"] == 64:
            assert t.state == TrialState.PRUNED and "OutOfResources" in t.user_attrs["reason"]
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    entry = tune.finalize(spec, backend, _url(isolated))
    assert entry.variant.block_b not in (16, 64)
    assert stats.failed["compile_error"] == by_status["compile_error"]


def test_constraints_rule_out_before_measuring(isolated):
    spec = tune.StudySpec("lse_forward", "lse_forward", SMALL, n_trials=8) if False else \
        tune.StudySpec("h200", "lse_forward", SMALL, n_trials=8)
    backend = tune.FakeBackend(fail_compile=None, fail_resources=None)
    tune.run_study(spec, backend, _url(isolated))
    trials = _trials(spec, _url(isolated))
    ruled_out = [t for t in trials if t.user_attrs.get("status") == "infeasible"]
    assert ruled_out and all(t.state == TrialState.PRUNED and "constraint" in t.user_attrs["reason"] for t in ruled_out)
    measured_knobs = [c[2] for c in backend.calls if c[0] == "check"]
    space = tune.load_space("lse_forward")
    ctx = SMALL.space_context(backend.smem_limit())
    assert len(measured_knobs) == 8
    assert all(space.reject_reason({k: d[k] for k in space.knobs}, ctx) is None for d in measured_knobs)


def test_gate_rejects_a_fast_but_inaccurate_filter(isolated):
    spec = tune.StudySpec("h200", "backward", SMALL, n_trials=1)
    backend = tune.FakeBackend()
    fast = BackwardVariant(filter_eps=2.0**-8)
    exact = BackwardVariant(filter_eps=2.0**-12)
    assert backend.cost_ms("backward", fast, SMALL) < backend.cost_ms("backward", exact, SMALL)
    bad = tune.measure(backend, spec, fast)
    assert bad.status == "gate" and "dE error" in bad.reason and not bad.timing
    assert tune.measure(backend, spec, exact).ok
    strict = tune.StudySpec("h200", "backward", SMALL, gate=tune.Gate(max_grad_error=1e-3))
    assert tune.measure(backend, strict, exact).status == "gate"


def test_backward_study_winner_passes_the_gate(isolated):
    spec = tune.StudySpec("h200", "backward", SMALL, n_trials=16)
    backend = tune.FakeBackend()
    tune.run_study(spec, backend, _url(isolated), seed=1)
    entry = tune.finalize(spec, backend, _url(isolated))
    eps = entry.variant.filter_eps
    assert eps is None or 1e-3 + 30 * eps <= 1e-2
    complete = [t for t in _trials(spec, _url(isolated)) if t.state == TrialState.COMPLETE]
    assert all(t.user_attrs["errors"]["dE"] <= 1e-2 for t in complete)


def test_per_trial_time_limit(isolated):
    spec = tune.StudySpec("h200", "indexed_dot", SMALL)
    backend = tune.FakeBackend(slow={"block_b": 8}, slow_s=3.0)
    t0 = time.monotonic()
    out = tune.measure(backend, spec, KernelVariants().indexed_dot.replace(block_b=8), time_limit=0.2)
    assert out.status == "timeout" and "time limit" in out.reason
    assert time.monotonic() - t0 < 2.0


def test_classify_failure():
    from triton.runtime.errors import OutOfResources

    assert tune.classify_failure(OutOfResources(1, 0, "shared memory")) == "out_of_resources"
    assert tune.classify_failure(torch.cuda.OutOfMemoryError("oom")) == "out_of_resources"
    assert tune.classify_failure(tune._compilation_error("x")) == "compile_error"
    assert tune.classify_failure(RuntimeError("PTX")) == "runtime_error"
    # ptxas giving up on a variant (seen on an H200 with a wide forward tile) is a failed trial
    from triton.runtime.errors import PTXASError

    assert tune.classify_failure(PTXASError("ptxas fatal: (C7602) Insufficient registers (128)")) == "out_of_resources"
    assert tune.classify_failure(PTXASError("ptxas fatal: something else")) == "compile_error"
    assert tune.classify_failure(RuntimeError("CUDA error: an illegal memory access was encountered")) == "cuda_fatal"
    assert tune.classify_failure(tune.TrialTimeout("slow")) == "timeout"
    assert tune.classify_failure(ValueError("a bug")) is None  # bugs are not hidden as failed trials
    assert tune.classify_failure(KeyboardInterrupt()) is None


class _Interrupting(tune.FakeBackend):
    def __init__(self, after, **kw):
        super().__init__(**kw)
        self.after = after

    def time(self, kernel, variants, problem):
        if sum(1 for c in self.calls if c[0] == "time") >= self.after:
            raise KeyboardInterrupt
        return super().time(kernel, variants, problem)


def test_resume_after_interruption(isolated):
    url = _url(isolated)
    spec = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=12)
    first = _Interrupting(after=5, fail_compile=None, fail_resources=None)
    with pytest.raises(KeyboardInterrupt):
        tune.run_study(spec, first, url)
    trials = _trials(spec, url)
    assert len(_measured(trials)) == 5
    interrupted = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0].state == TrialState.FAIL
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    done_before = {tuple(sorted(t.params.items())) for t in _measured(trials)}

    second = tune.FakeBackend(fail_compile=None, fail_resources=None)
    stats = tune.run_study(spec, second, url)
    trials = _trials(spec, url)
    assert len(_measured(trials)) == 12 == stats.total_measured
    assert stats.measured == 7  # only the missing trials ran
    redone = [c for c in second.calls if tuple(sorted((k, v) for k, v in c[2].items() if k != "kernel")) in done_before]
    assert redone == []  # nothing measured twice
    again = tune.run_study(spec, second, url)  # a finished study: nothing more to do
    assert again.measured == 0 and again.stopped == "trial budget reached"


class _Crashing(tune.FakeBackend):
    def check(self, kernel, variants, problem):
        if len(self.calls) == 2:
            self.calls.append(("check", kernel, {}))
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().check(kernel, variants, problem)


def test_broken_cuda_context_stops_and_resume_skips_the_culprit(isolated):
    url = _url(isolated)
    spec = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=5)
    with pytest.raises(tune.DeviceLost, match="run the same command again"):
        tune.run_study(spec, _Crashing(fail_compile=None, fail_resources=None), url)
    trials = _trials(spec, url)
    [culprit] = [t for t in trials if t.user_attrs.get("status") == "cuda_fatal"]
    assert culprit.state == TrialState.PRUNED and culprit.user_attrs["measured"]  # counted: never retried
    stats = tune.run_study(spec, tune.FakeBackend(fail_compile=None, fail_resources=None), url)
    assert stats.total_measured == 5 and stats.measured == 3  # 1 done + the culprit before the crash


def check_workers_share_one_study(url, log, workers: int, n_trials: int) -> None:
    """``workers`` processes of the fake backend on one study of ``n_trials`` at ``url`` (each timing run
    logged to ``log``): the budget is shared, every worker's trial is closed, nothing is lost or repeated."""
    spec = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=n_trials)
    # (Each trial takes 0.4 s, so that the workers overlap even when one starts seconds late on a
    # loaded machine.)
    tune.run_workers(workers, "fake", {"log_path": str(log), "fail_compile": None, "fail_resources": None,
                                       "slow": [{}], "slow_s": 0.4}, url, [spec])
    trials = _trials(spec, url)
    measured = _measured(trials)
    assert n_trials <= len(measured) <= n_trials + workers - 1  # the budget is shared (extras only in a rare race)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert len({t.user_attrs["worker"] for t in measured}) >= 2  # workers contributed
    assert len({t.number for t in trials}) == len(trials)
    # every timing run is one stored trial and vice versa: nothing lost, nothing repeated
    timed = Counter(json.dumps({k: v for k, v in json.loads(line)["knobs"].items() if k != "kernel"}, sort_keys=True)
                    for line in log.read_text().splitlines())
    stored = Counter(json.dumps(t.params, sort_keys=True) for t in measured if t.state == TrialState.COMPLETE)
    assert timed == stored
    assert max(stored.values()) == 1


def test_two_workers_share_one_study(isolated):
    check_workers_share_one_study(_url(isolated), isolated["tmp"] / "timed.jsonl", 2, 16)


def test_plan_and_default_hidden():
    sizes, note = tune.default_hidden(262208)
    assert sizes == [2560, 3840] and "Gemma 3 4B" in note
    assert tune.default_hidden(128256)[0] == [2048, 3072, 4096]
    assert tune.default_hidden(12345)[0] == [2048, 4096]
    plan = tune.make_plan("h200", [128256], [4096], tokens=[5000, 4096], kernels=["backward"], trials=7)
    assert [(s.kernel, s.problem.B, s.problem.D, s.n_trials) for s in plan.studies] == [("backward", 4096, 4096, 7)]
    assert any("bucket B=4096" in n for n in plan.notes)
    text = tune.describe_plan(plan, 232448)
    assert "after rules" in text and "1 studies" in text


def test_study_name_changes_with_template_and_gate():
    a = tune.StudySpec("h200", "backward", SMALL)
    b = tune.StudySpec("h200", "backward", SMALL, gate=tune.Gate(max_grad_error=3e-3))
    c = tune.StudySpec("h200", "backward", tune.TuningProblem(512, 32000, 256, has_bias=True))
    assert len({a.name, b.name, c.name}) == 3
    assert tune.codegen.template_hash("backward")[:10] in a.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_backend_smoke(isolated):
    backend = tune.GPUBackend(warmup_ms=5, rep_ms=10)
    problem = tune.TuningProblem(B=256, V=4096, D=128)
    for kernel in tune.KERNEL_NAMES:
        errors = backend.check(kernel, KernelVariants(), problem)
        assert all(math.isfinite(v) and v < 5e-2 for v in errors.values()), errors
        t = backend.time(kernel, KernelVariants(), problem)
        assert 0 < t["p20_ms"] <= t["median_ms"] <= t["p80_ms"]


def test_seeds_are_measured_first(isolated):
    # The search space's seeds (merged over the default) are measured right after the baseline.
    from cce_autotune.tuner.space import load_space

    space = load_space("lse_forward")
    assert space.seeds, "the packaged lse_forward space lists seeds"
    spec = tune.StudySpec("h200", "lse_forward", tune.TuningProblem(B=8192, V=256128, D=2304), n_trials=len(space.seeds) + 3)
    tune.run_study(spec, tune.FakeBackend(), tune.make_storage(_url(isolated)), seed=0, worker=0, timeout_s=60)
    trials = sorted(_trials(spec, _url(isolated)), key=lambda t: t.number)
    proposed = [t.user_attrs.get("proposed") for t in trials]
    assert proposed[0] == "baseline"
    assert proposed[1 : 1 + len(space.seeds)] == [f"seed {i}" for i in range(len(space.seeds))]
    default = tune.KernelVariants().lse_forward
    for t, seed in zip(trials[1:], space.seeds):
        assert all(t.params[k] == v for k, v in seed.items())
        assert all(t.params[k] == getattr(default, k) for k in t.params if k not in seed)


def test_bad_seed_is_refused(tmp_path):
    from cce_autotune.tuner.space import SpaceError, load_space, space_path

    text = space_path("indexed_dot").read_text() + "\n  - {block_d: 48}\n"
    p = tmp_path / "indexed_dot.yaml"
    p.write_text(text)
    with pytest.raises(SpaceError, match=r"seeds\[1\]: block_d=48 is not one of"):
        load_space("indexed_dot", p)


def test_tuning_data_kind_reaches_the_problem_and_the_study_name():
    lm = tune.make_plan("h200", [50000], [768], [8192])
    real = tune.make_plan("h200", [50000], [768], [8192], data="real")
    assert all(s.problem.data == "lm" for s in lm.studies) and all(s.problem.data == "real" for s in real.studies)
    # Different data, different studies (a study resumed on other data would mix its trials).
    assert {s.name for s in lm.studies}.isdisjoint(s.name for s in real.studies)
    assert not any("data-" in s.name for s in lm.studies)  # LM-like keeps the names studies had before
    with pytest.raises(ValueError, match="data: 'text' is not one of"):
        tune.TuningProblem(8192, 50000, 768, data="text")


def test_gpu_backend_times_the_training_call_sequence_and_checks_fixed_inputs(monkeypatch):
    # The backend's runner on CPU tensors (through the interpreter): timing moves its own copy of the
    # classifier between calls; the check runs on the fixed inputs its reference was computed on.
    from cce_autotune.data import lm_like
    from cce_autotune.strategies.common import RowLayout

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = object.__new__(tune.GPUBackend)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    e, c, t = lm_like(48, 96, 32, dtype=torch.float32, device=dev)
    data = dict(e=e, c=c, t=t, bias=None, softcap=None, rows=RowLayout.dense(48, 32, dev))
    backend._inputs = lambda problem: data
    small = KernelVariants(backward=BackwardVariant(block_b=16, block_v=32, block_d=16, chunk_v=64))
    fixed = c.clone()
    fn, leaves = backend._runner("backward", small, tune.TuningProblem(48, 96, 32), training=True)
    assert leaves[1] is not c and leaves[1].data_ptr() != c.data_ptr()
    before = leaves[1].detach().clone()
    fn()
    moved = leaves[1].detach().clone()
    assert not torch.equal(moved, before)  # the classifier moved before the call
    fn()
    assert torch.allclose(leaves[1].detach(), before, atol=1e-6)  # and back (alternating)
    assert torch.equal(c, fixed)  # the inputs of the check are untouched
    fn, leaves = backend._runner("backward", small, tune.TuningProblem(48, 96, 32))
    assert leaves[1].data_ptr() == c.data_ptr()
    fn()
    assert torch.equal(c, fixed) and leaves[1].grad is not None


def test_plan_time_is_shared_by_weight_after_the_final_retiming():
    specs = [tune.StudySpec("h200", k, SMALL) for k in ("backward", "lse_forward", "indexed_dot")]
    deadline = time.time() + 100.0
    first = tune._study_timeout(deadline, specs)
    reserve = sum(tune.FINALIZE_S[s.kernel] for s in specs)
    share = tune.WEIGHT["backward"] / sum(tune.WEIGHT[s.kernel] for s in specs)
    assert first == pytest.approx((100.0 - reserve) * share, abs=0.5)
    assert tune._study_timeout(deadline, specs[1:] + specs[:1]) < first  # a lighter kernel gets less
    # two workers share the re-timing: more time for trials
    assert tune._study_timeout(deadline, specs, workers=2) > first


def test_a_study_starts_from_the_winner_of_the_neighbouring_bucket(isolated):
    url = _url(isolated)
    a = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=8)
    b = tune.StudySpec("h200", "indexed_dot", tune.TuningProblem(B=1024, V=32000, D=256), n_trials=3)
    backend = tune.FakeBackend(fail_compile=None, fail_resources=None)
    tune.run_study(a, backend, url)
    done = [t for t in _trials(a, url) if t.state == TrialState.COMPLETE]
    best = tune.load_space("indexed_dot").variant(min(done, key=lambda t: t.value).params)
    storage = tune.make_storage(url)
    assert tune.sibling_best(b, [a, b], storage) == [best]
    assert tune.sibling_best(a, [a], storage) == []  # no other bucket
    tune.run_study(b, backend, url, warm_start=tune.sibling_best(b, [a, b], storage))
    warm = [t for t in _trials(b, url) if t.user_attrs.get("proposed") == "warm start"]
    assert len(warm) == 1 and tune.load_space("indexed_dot").variant(warm[0].params) == best


def test_a_study_first_measures_the_entry_it_would_replace(isolated):
    # After a template change the stored winner is stale: a re-tune measures it right after the
    # default (before the neighbouring buckets' winners), so a short search keeps what a long one found.
    url = _url(isolated)
    spec = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=2)
    stored = make_entry(kernel="indexed_dot", B=SMALL.B, V=SMALL.V, D=SMALL.D, block_b=16, block_d=128, num_warps=2)
    db.save_entries(isolated["config"] / "h200.yaml", [stored,
                    make_entry(kernel="indexed_dot", B=SMALL.B, V=SMALL.V, D=512, block_b=16)])  # another head
    dispatch.clear_cache()
    assert tune.tuned_before(spec) == [stored.variant]
    other = tune.StudySpec("h200", "lse_forward", SMALL)
    assert tune.tuned_before(other) == []  # another kernel's key
    storage = tune.make_storage(url)
    assert tune.warm_starts(spec, [spec], storage) == [stored.variant]
    tune.run_study(spec, tune.FakeBackend(fail_compile=None, fail_resources=None), url,
                   warm_start=tune.warm_starts(spec, [spec], storage))
    measured = [t for t in _trials(spec, url) if t.state == TrialState.COMPLETE]
    assert [t.user_attrs.get("proposed") for t in measured] == ["baseline", "warm start"]
    assert tune.load_space("indexed_dot").variant(measured[1].params) == stored.variant


PROBLEM = tune.TuningProblem(B=512, V=32000, D=256)

# Several processes creating one fresh studies database: the loser of the race opens it again.
def test_storage_creation_retries_a_lost_race(isolated, monkeypatch):
    real, calls = tune._open_storage, []

    def racing(url):
        calls.append(url)
        if len(calls) == 1:
            raise sqlalchemy.exc.IntegrityError("INSERT INTO alembic_version", {}, Exception("UNIQUE constraint failed"))
        return real(url)

    monkeypatch.setattr(tune.study, "_open_storage", racing)  # where make_storage looks it up
    storage = tune.make_storage(f"sqlite:///{isolated['tmp'] / 'race.db'}")
    assert len(calls) == 2 and isinstance(storage, optuna.storages.RDBStorage)

# ... and when SQLite refuses the journal-mode change at once ("database is locked", sqlite3's own
# error, without waiting for the lock: seen in the four-process test below on a loaded machine).
def test_storage_creation_retries_a_journal_mode_refused_while_locked(isolated, monkeypatch):
    import sqlite3

    real, calls = sqlite3.connect, []

    class Refusing:
        def __init__(self, con):
            self.con = con

        def execute(self, sql):
            calls.append(sql)
            if len(calls) == 1:
                raise sqlite3.OperationalError("database is locked")
            return self.con.execute(sql)

        def close(self):
            self.con.close()

    monkeypatch.setattr(tune.study.sqlite3, "connect", lambda *a, **k: Refusing(real(*a, **k)))
    storage = tune.make_storage(f"sqlite:///{isolated['tmp'] / 'locked.db'}")
    assert calls == ["PRAGMA journal_mode=WAL"] * 2 and isinstance(storage, optuna.storages.RDBStorage)


def test_concurrent_creation_of_one_database(isolated):
    # Four processes open the same fresh database at once (the crash the issue saw in 2 of 4 runs).
    url = f"sqlite:///{isolated['tmp'] / 'fresh.db'}"
    code = f"from cce_autotune import tuner; tuner.make_storage({url!r}); print('ok')"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]

def _with_a_dead_workers_trial(isolated, n_trials):
    """``(spec, url, study, trial)``: a fresh study with one measured trial left RUNNING by a worker
    process that has exited."""
    url = f"sqlite:///{isolated['tmp'] / 'studies.db'}"
    spec = tune.StudySpec("h200", "indexed_dot", PROBLEM, n_trials=n_trials)
    study = tune.open_study(spec, url)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    trial = study.ask(tune._distributions(tune.load_space(spec.kernel)))
    trial.set_user_attr("measured", True)
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}:w0")
    return spec, url, study, trial


# A trial left RUNNING by a killed worker does not count against --trials.
def test_trials_of_a_dead_worker_do_not_count(isolated):
    spec, url, study, _ = _with_a_dead_workers_trial(isolated, 5)
    backend = tune.make_backend("fake")
    stats = tune.run_study(spec, backend, url)
    trials = study.get_trials()
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and t.user_attrs.get("measured")]
    assert len(done) == 5, stats
    assert study.get_trials()[0].state == TrialState.FAIL


# Issue 21 item 13: a worker whose studies database fails reports it to the parent in one line and
# exits 3, without a traceback (the parent raises it as StorageFailed, which cce-tune says in one line).
def test_a_workers_failing_studies_database_is_sent_to_the_parent(isolated, monkeypatch):
    pytest.importorskip("optuna")
    import queue

    from cce_autotune.tuner import workers

    def full(*a, **k):
        try:
            raise sqlalchemy.exc.OperationalError("INSERT INTO trials", {}, Exception("database or disk is full"))
        except sqlalchemy.exc.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc

    monkeypatch.setattr(workers, "run_study", full)
    results = queue.Queue()
    spec = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=2)
    with pytest.raises(SystemExit) as info:
        workers._worker_main(1, 2, "fake", {}, _url(isolated), [spec], 0, None, None, None, results, None)
    assert info.value.code == 3
    name, (kind, line) = results.get_nowait()
    assert name == workers._FAILED and kind == "storage"
    assert line == "worker 1: Exception: database or disk is full"
    assert tune.storage_failure(tune.StorageFailed(line), _url(isolated)) == line


# A killed run's orphaned worker that nothing reaps (many containers' PID 1 reaps nothing) still answers
# signal 0 as a zombie: its claimed trials must be freed all the same.
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_an_exited_unreaped_worker_counts_as_dead():
    from cce_autotune.tuner import study

    host = socket.gethostname()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not study._zombie(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert study._worker_dead(f"{host}:{child.pid}:w0")  # exited, not reaped yet
    finally:
        child.wait()
    assert study._worker_dead(f"{host}:{child.pid}:w0")  # reaped: gone
    assert not study._worker_dead(f"{host}:{os.getpid()}:w0")  # this live process
    assert not study._worker_dead(f"another-host:{child.pid}:w0")  # (judged by the trial's age instead)


# Two workers may both find a dead worker's trial and close it: on a server database the second's write
# fails (Optuna's UpdateFinishedTrialError) although it skipped finished trials when it read them.
def test_a_dead_workers_trial_closed_by_another_worker_first_is_no_error(isolated, monkeypatch):
    spec, url, study, trial = _with_a_dead_workers_trial(isolated, 3)
    real_tell, raced = optuna.Study.tell, []

    def tell(self, trial, *args, **kwargs):
        if isinstance(trial, int) and kwargs.get("state") == TrialState.FAIL and not raced:
            raced.append(trial)
            real_tell(self, trial, *args, **kwargs)  # the other worker's write lands first
            raise optuna.exceptions.UpdateFinishedTrialError(f"Trial#{trial} has already finished")
        return real_tell(self, trial, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", tell)
    tune.run_study(spec, tune.make_backend("fake"), url)
    assert raced == [trial.number]
    done = [t for t in study.get_trials() if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
            and t.user_attrs.get("measured")]
    assert len(done) == 3

"""cce-tune: dry run, GPU checks, the whole loop on the fake backend, show, render, usage errors."""

from __future__ import annotations

import pytest

pytest.importorskip("optuna", reason="the tuner needs Optuna (not in the GPU image)")  # noqa: E402
import sqlalchemy.exc
import torch
import yaml
from conftest_tune import (
    isolated,  # noqa: F401
    run_cli,
)

from cce_autotune import cli
from cce_autotune import tuner as tune
from cce_autotune.configdb import dispatch
from cce_autotune.configdb import store as db
from cce_autotune.variant import KernelVariants


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_prints_the_plan_without_a_gpu(isolated, capsys):
    rc, out, err = run(capsys, "--gpu", "a100", "--vocab", "262208", "--tokens", "8192", "--dry-run")
    assert rc == 0
    assert "cce-tune plan for GPU a100 (shared memory per block 166912 bytes)" in out
    assert "V=262208 is Gemma 3 4B (D=2560), Gemma 3 12B (D=3840); tuning D=2560, 3840" in out  # --hidden defaulted
    for kernel in ("indexed_dot", "lse_forward", "backward"):
        assert kernel in out
    assert out.count("after rules, 50 trials") == 6
    assert "6 studies (indexed_dot, lse_forward, backward), 300 trials" in out and "min" in out
    assert not (isolated["cache"] / "tuned_configs").exists()  # nothing written


def test_dry_run_budget_and_kernels(isolated, capsys):
    rc, out, _ = run(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "4096", "--tokens", "4096,8192",
                     "--kernels", "backward", "--trials", "20", "--budget-minutes", "3", "--dry-run")
    assert rc == 0
    assert "2 studies (backward), 40 trials" in out and "capped by --budget-minutes 3" in out
    assert "indexed_dot" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_and_without_dry_run_fails_clearly(isolated, capsys):
    rc, out, err = run(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "4096")
    assert rc != 0
    assert "no GPU" in err and "--dry-run" in err


def test_gpu_mismatch_is_refused(isolated, capsys):
    rc, out, err = run(capsys, "--gpu", "a100", "--vocab", "32000", "--hidden", "256", "--tokens", "512",
                       "--backend", "fake")  # the fake device is an "NVIDIA H200"
    assert rc == 2
    assert "--gpu a100" in err and "'NVIDIA H200'" in err and "--gpu h200" in err
    assert not (isolated["cache"] / "tuned_configs" / "a100.yaml").exists()


def test_whole_loop_tune_show_dispatch(isolated, capsys, monkeypatch):
    out_dir = isolated["tmp"] / "out"
    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    argv = ["--gpu", "NVIDIA H200", "--vocab", "32000", "--hidden", "256", "--tokens", "512", "--trials", "6",
            "--out", str(out_dir), "--kernels", "indexed_dot,lse_forward"]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    assert "done: 2 of 2 studies produced a winner" in out
    assert "2/6 trials" not in err and "6/6 trials" in err  # progress line: trials done and best so far
    assert "best" in err and "winner" in err
    stored = db.load_file(out_dir / "h200.yaml", expect_gpu="h200")
    assert {e.key.kernel for e in stored.entries} == {"indexed_dot", "lse_forward"}
    assert (isolated["cache"] / "studies.db").exists()  # studies in the user cache by default

    # the runtime dispatcher reads what cce-tune wrote (here through CCE_AUTOTUNE_CONFIG_DIR)
    monkeypatch.setenv("CCE_AUTOTUNE_CONFIG_DIR", str(out_dir))
    dispatch.clear_cache()
    picked = dispatch.select("h200", "bf16", 512, 32000, 256, warn=False)
    by_kernel = {e.key.kernel: e.variant for e in stored.entries}
    assert picked.indexed_dot == by_kernel["indexed_dot"] and picked.lse_forward == by_kernel["lse_forward"]
    assert picked.backward == KernelVariants().backward

    rc, out, _ = run(capsys, "show", "--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "600")
    assert rc == 0
    assert f"{out_dir / 'h200.yaml'}: 2 entries" in out
    assert "indexed_dot: exact match" in out and "backward: built-in default" in out
    assert "cce-tune --gpu h200 --vocab 32000 --hidden 256 --tokens 512 --dtype bf16 --kernels backward" in out

    # running it again resumes the finished studies: no new trials, the same winners
    rc, out, err = run(capsys, *argv)
    assert rc == 0 and "trial budget reached" in err
    assert "0 added" in out


def test_two_workers_from_the_cli(isolated, capsys, monkeypatch):
    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    rc, out, err = run(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512",
                       "--trials", "6", "--kernels", "indexed_dot", "--workers", "2",
                       "--storage", f"sqlite:///{isolated['tmp'] / 'shared.db'}")
    assert rc == 0, err
    assert (isolated["tmp"] / "shared.db").exists()
    assert len(db.load_file(isolated["cache"] / "tuned_configs" / "h200.yaml").entries) == 1


def test_show_without_configs_and_with_a_broken_file(isolated, capsys):
    rc, out, _ = run(capsys, "show", "--gpu", "a100")
    assert rc == 0 and "no tuned configs for 'a100'" in out
    bad = isolated["config"] / "a100.yaml"
    bad.write_text(yaml.safe_dump({"schema_version": 3, "gpu": "a100", "entries": []}))
    rc, _, err = run(capsys, "show", "--gpu", "a100")
    assert rc == 1 and str(bad) in err and "schema_version 3" in err


def test_render_prints_the_variant_source(capsys):
    rc, out, _ = run(capsys, "render", "backward", "block_b=64", "filter_eps=none", "sort_vocab=false", "num_stages=2",
                     "strategy=sparse")
    assert rc == 0
    assert "def cce_sparse_grad_kernel(" in out
    assert "BLOCK_B=64" in out and "FILTER_EPS=None" in out and "NUM_STAGES=2" in out
    # strategy=auto (the default) is decided per call by the planner: render says so in one line and
    # shows the chunked strategy's kernel (the one the tiling knobs shape); strategy=sparse another
    rc, out, err = run(capsys, "render", "backward", "filter_eps=none", "sort_vocab=false")
    assert rc == 0 and "def cce_grad_chunk_kernel(" in out and "STRATEGY=chunked" in out
    assert "cce_sparse_grad_kernel" not in out
    notes = err.strip().splitlines()
    assert len(notes) == 1 and "chosen per call" in notes[0] and "rendering the chunked" in notes[0]
    assert "chunked, sparse, fused)" in notes[0]  # the strategies strategy=NAME accepts
    rc, out, err = run(capsys, "render", "backward", "strategy=chunked")
    assert rc == 0 and "def cce_grad_chunk_kernel(" in out and "STRATEGY=chunked" in out and err == ""
    rc, out, _ = run(capsys, "render", "lse_forward", "merge=lock", "--bias", "--softcap")
    assert rc == 0 and "MERGE=lock" in out and "HAS_BIAS=True" in out and "HAS_SOFTCAP=True" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["render", "backward", "block_b=48"], "block_b=48: must be a power of two"),
        (["render", "backward", "warps=4"], "unknown knob(s) ['warps']"),
        (["render", "backward", "block_b"], "expected name=value"),
        (["--gpu", "h200", "--vocab", "32000", "--dtype", "fp8", "--dry-run"], "--dtype"),
        (["--gpu", "h200", "--vocab", "32000", "--kernels", "forward", "--dry-run"], "--kernels"),
        (["--gpu", "h200", "--vocab", "-5", "--dry-run"], "--vocab"),
        (["--vocab", "32000", "--dry-run"], "--gpu"),
    ],
)
def test_usage_errors_name_the_argument(capsys, argv, message):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert message in err


def test_tune_on_an_activation_file_measures_the_costs_first(isolated, capsys, monkeypatch):
    from cce_autotune import tuner as tune
    from cce_autotune.data import captured as activations

    g = torch.Generator().manual_seed(0)
    path = activations.save_activations(isolated["tmp"] / "acts.pt", torch.randn(40, 32, generator=g),
                                        torch.randn(300, 32, generator=g), torch.randint(0, 300, (40,), generator=g),
                                        softcap=20.0)
    digest = activations.load_activations(path).digest[:16]
    out_dir = isolated["tmp"] / "out"
    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    rc, out, err = run(capsys, "--gpu", "h200", "--data", str(path), "--tokens", "256", "--trials", "4",
                       "--kernels", "lse_forward,backward", "--out", str(out_dir))
    assert rc == 0, err
    assert "V=300, D=32, softcap 20" in out and "done: 2 of 2" in out
    assert "calibration:" in err and "saved the planner's cost model" in out
    stored = db.load_file(out_dir / "h200.yaml", expect_gpu="h200")
    assert {(e.key.V, e.key.D, e.key.has_softcap) for e in stored.entries} == {(300, 32, True)}
    assert all(e.data == {"kind": "file", "name": "acts.pt", "sha256": digest} for e in stored.entries)
    # the coefficients the fake GPU follows, recovered by the calibration and saved for the dispatcher
    # (at this tiny head the chunked strategy is bound by its launches: recompute and products are
    # not informed and keep the defaults)
    for name in ("forward", "sparse_per_live"):
        assert stored.cost_model[name] == pytest.approx(tune.FakeBackend.TRUE_COSTS[name], rel=0.05), name
    assert "fitted by cce-tune on NVIDIA H200" in stored.cost_model["note"]

    rc, _, err = run(capsys, "--gpu", "h200", "--data", str(path), "--vocab", "512", "--dry-run")
    assert rc == 2 and "--vocab: [512] differs" in err
    rc, _, err = run(capsys, "--gpu", "h200", "--data", str(isolated["tmp"] / "none.pt"), "--dry-run")
    assert rc == 2 and "--data" in err


# An unusable results folder or studies database is found before tuning, in one line.
@pytest.mark.parametrize("case", ["notaurl", "foo://bar", "memory", "out"])
def test_bad_out_and_storage_fail_early_in_one_line(case, isolated, capsys, monkeypatch):
    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    argv = ["--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512", "--trials", "3",
            "--kernels", "indexed_dot"]
    if case == "out":
        blocker = isolated["tmp"] / "a_file"
        blocker.write_text("x")
        argv += ["--out", str(blocker / "sub")]
    else:
        argv += ["--storage", {"memory": "sqlite://"}.get(case, case)]
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip() and "starting the" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert ("results folder" in err) if case == "out" else ("--storage" in err)
    assert "studies" not in out  # nothing was tuned

# Ctrl-C during the plan step: a line, exit status 130, no traceback.
def test_ctrl_c_during_planning(isolated, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "make_plan", interrupted)
    rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "32000", "--dry-run")
    assert rc == 130 and "interrupted" in err and "Traceback" not in err

def test_unknown_gpu_in_a_dry_run_is_said(isolated, capsys):
    rc, out, err = run_cli(capsys, "--gpu", "nonsense", "--vocab", "32000", "--hidden", "256", "--dry-run")
    assert rc == 0 and "no GPU the alias table knows" in err

def test_render_fp32_uses_the_fp32_defaults(capsys):
    rc, out, _ = run_cli(capsys, "render", "backward", "--dtype", "fp32")
    assert rc == 0 and "BLOCK_B=64" in out and "BLOCK_D=32" in out  # KernelVariants.defaults(elem_bytes=4)

def test_a_failing_studies_database_or_results_disk_mid_run_is_one_line(isolated, capsys, monkeypatch):
    # A full studies disk during the run: one line and exit status 3, no traceback; a results file
    # that cannot be written: said, and the plan goes on.
    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    argv = ["--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512", "--trials", "3",
            "--kernels", "indexed_dot"]

    def full(*a, **k):
        raise sqlalchemy.exc.OperationalError("INSERT INTO trials", {}, Exception("database or disk is full"))

    real = tune.run_plan
    monkeypatch.setattr(tune, "run_plan", full)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 3 and "disk is full" in err and "Traceback" not in err
    monkeypatch.setattr(tune, "run_plan", real)

    def no_space(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(db, "save_entries", no_space)
    rc, out, err = run_cli(capsys, *argv)
    assert "could not save" in err and "No space left on device" in err and "Traceback" not in err


# -- issue 21 item 9: a storage URL is never shown with its password --------------------------------
SECRET_URL = "postgresql://user:s3cret@127.0.0.1:1/studies"


def test_a_storage_url_is_shown_without_its_password():
    pytest.importorskip("optuna")
    from cce_autotune import tuner

    assert tuner.display_url(SECRET_URL) == "postgresql://user:***@127.0.0.1:1/studies"
    assert tuner.display_url("postgresql://u%40x:s3%2Fcret@h/db") == "postgresql://u%40x:***@h/db"
    assert tuner.display_url("sqlite:////tmp/my dir/studies.db") == "sqlite:////tmp/my dir/studies.db"  # as given
    assert tuner.display_url("notaurl") == "notaurl"  # unparseable, no '@': as is
    assert "s3cret" not in tuner.display_url("foo//user:s3cret@host/db")  # unparseable with '@': masked
    assert tuner.hide_secrets(f"cannot connect to {SECRET_URL}: s3cret refused", SECRET_URL) == (
        "cannot connect to postgresql://user:***@127.0.0.1:1/studies: *** refused")


def test_a_storage_password_appears_in_no_output(isolated, capsys, monkeypatch):
    # A server URL that cannot be opened here: one line, exit 2, the password nowhere.
    pytest.importorskip("optuna")
    from cce_autotune.tuner import study

    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    argv = ["--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512", "--trials", "3",
            "--kernels", "indexed_dot", "--out", str(isolated["tmp"] / "out"), "--no-calibrate"]
    for url in (SECRET_URL, "foo//user:s3cret@host/db"):
        rc, out, err = run_cli(capsys, *argv, "--storage", url)
        lines = [line for line in err.splitlines() if line.strip() and "starting the" not in line]
        assert rc == 2 and len(lines) == 1 and "--storage" in err, err
        assert "s3cret" not in out + err
    # The same URL, served by a SQLite file (SQLite takes no password): the run says where the
    # studies are without it, and so does a database failing mid-run.
    sqlite_url = f"sqlite:///{isolated['tmp'] / 'served.db'}"
    real_open = study._open_storage
    monkeypatch.setattr(study, "_open_storage", lambda url: real_open(sqlite_url if url == SECRET_URL else url))
    rc, out, err = run_cli(capsys, *argv, "--storage", SECRET_URL)
    assert rc == 0, err
    assert "studies: postgresql://user:***@127.0.0.1:1/studies" in out
    assert "s3cret" not in out + err

    def fails(*a, **k):
        raise optuna.exceptions.StorageInternalError(f"lost {SECRET_URL}")

    import optuna

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", fails)
    rc, out, err = run_cli(capsys, *argv, "--trials", "5", "--storage", SECRET_URL)
    assert rc == 3 and "the studies database postgresql://user:***@127.0.0.1:1/studies failed" in err, err
    assert "s3cret" not in out + err


# -- issue 21 item 13: the studies database failing mid-run -------------------------------------------
def test_the_studies_database_failing_mid_run_is_one_line(isolated, capsys, monkeypatch):
    # Optuna wraps the driver's error of a commit in its own StorageInternalError: one line naming the
    # database and the driver's reason, exit status 3 (as a lost GPU), no traceback.
    pytest.importorskip("optuna")
    import optuna
    import sqlalchemy.exc

    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    url = f"sqlite:///{isolated['tmp'] / 'studies.db'}"
    real = optuna.storages.RDBStorage.set_trial_state_values
    calls = []

    def full_after_two(self, *a, **k):
        calls.append(1)
        if len(calls) > 2:
            try:
                raise sqlalchemy.exc.OperationalError("UPDATE trials", {}, Exception("database or disk is full"))
            except sqlalchemy.exc.OperationalError as exc:
                raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc
        return real(self, *a, **k)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", full_after_two)
    rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512",
                           "--trials", "6", "--kernels", "indexed_dot", "--storage", url, "--no-calibrate",
                           "--out", str(isolated["tmp"] / "out"))
    assert rc == 3, err
    failure = [line for line in err.splitlines() if line.startswith("cce-tune:") and "starting the" not in line]
    assert len(failure) == 1 and "Traceback" not in err
    assert f"the studies database {url} failed: " in failure[0] and "database or disk is full" in failure[0]
    assert "done:" not in out


# -- issue 21 item 14: unsaved results and a swallowed Ctrl-C -----------------------------------------
def test_results_that_could_not_be_saved_fail_the_run(isolated, capsys, monkeypatch):
    # The results folder becomes unwritable after the first winner: the second is said not saved,
    # the summary counts what was saved, and the status is non-zero.
    pytest.importorskip("optuna")
    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    real = db.save_entries
    calls = []

    def first_only(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise PermissionError(13, "Permission denied")
        return real(*a, **k)

    monkeypatch.setattr(db, "save_entries", first_only)
    out_dir = isolated["tmp"] / "out"
    rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512",
                           "--trials", "3", "--kernels", "indexed_dot,lse_forward", "--out", str(out_dir))
    assert rc == 3, err
    assert f"done: 2 of 2 studies produced a winner; 1 saved to {out_dir / 'h200.yaml'}, 1 not" in out
    summary = [line for line in err.splitlines() if line.startswith("cce-tune: not saved to")]
    assert len(summary) == 1 and "lse_forward bf16 B=512" in summary[0] and "indexed_dot" not in summary[0]
    assert len(db.load_file(out_dir / "h200.yaml").entries) == 1


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_run(isolated, capsys, monkeypatch):
    # Ctrl-C lands in code that swallows KeyboardInterrupt (as a SQLAlchemy finalizer does): the run
    # stops after the current trial all the same, with the interrupted status.
    pytest.importorskip("optuna")
    import signal

    import optuna

    monkeypatch.setenv("CCE_AUTOTUNE_BACKEND", "fake")
    real = tune.FakeBackend.time
    timed = []

    def ctrl_c_swallowed(self, *a, **k):
        timed.append(1)
        if len(timed) == 2:
            try:  # the handler Ctrl-C runs, called where a finalizer runs
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            except KeyboardInterrupt:
                pass  # swallowed
        return real(self, *a, **k)

    monkeypatch.setattr(tune.FakeBackend, "time", ctrl_c_swallowed)
    # (Python's own handler, whatever the process that runs the tests inherited: a job started in the
    # background from a script ignores SIGINT)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        url = f"sqlite:///{isolated['tmp'] / 'studies.db'}"
        rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "256", "--tokens", "512",
                               "--trials", "8", "--kernels", "indexed_dot,lse_forward", "--storage", url,
                               "--out", str(isolated["tmp"] / "out"))
        handler_after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert rc == 130 and "interrupted; run the same command again to resume" in err, err
    assert "done:" not in out
    assert len(timed) == 2  # stopped after the trial it was pressed in
    assert optuna.study.get_all_study_names(tune.make_storage(url)) == [
        tune.StudySpec("h200", "indexed_dot", tune.TuningProblem(B=512, V=32000, D=256)).name]
    assert handler_after is signal.default_int_handler  # the handler is put back


def test_a_run_that_ignores_ctrl_c_keeps_ignoring_it():
    # A run started with SIGINT ignored (nohup, a background job of a script) is not made
    # interruptible by the guard: the handler stays SIG_IGN inside and after it.
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with tune.stop_on_interrupt():
            inside = signal.getsignal(signal.SIGINT)
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, before)
    assert inside is signal.SIG_IGN and after is signal.SIG_IGN
    assert not tune.interrupt_requested()


# -- issue 21 item 18: explain / show without a GPU, the default budget, merge's lock ----------------
def test_dry_run_says_when_the_budget_is_the_default(isolated, capsys):
    rc, out, _ = run_cli(capsys, "--gpu", "h200", "--vocab", "32000", "--hidden", "4096", "--tokens", "4096",
                         "--kernels", "backward", "--dry-run")
    assert rc == 0
    assert "capped by the default budget of 8 minutes (--budget-minutes)" in out
    assert "capped by --budget-minutes" not in out


def test_explain_and_show_without_a_gpu_say_which_gpu_they_plan_for(isolated, capsys, monkeypatch):
    monkeypatch.setattr(dispatch, "gpu_slug", lambda device=None: dispatch.CPU_SLUG)  # (a machine without a GPU)
    rc, out, err = run_cli(capsys, "explain", "--vocab", "32000", "--hidden", "4096", "--tokens", "8192",
                           "--live", "0.5")
    assert rc == 0, err
    assert err.count("\n") == 1 and "no GPU detected" in err and "--gpu h200" in err
    assert "GPU h200, bf16, B=8192" in out and "GPU cpu" not in out
    rc, out, err = run_cli(capsys, "show")
    assert rc == 0 and err.count("\n") == 1 and "no GPU detected" in err and "--gpu h200" in err
    assert out.startswith("GPU slug: h200\n")
    # a GPU named: planned for, nothing to say
    rc, out, err = run_cli(capsys, "explain", "--gpu", "a100", "--vocab", "32000", "--hidden", "4096",
                           "--tokens", "8192", "--live", "0.5")
    assert rc == 0 and err == "" and "GPU a100, bf16" in out


def test_explain_plans_an_fp32_classifier_as_a_mixed_precision_loop_calls_it(isolated, capsys):
    # --classifier fp32: dC in fp32 and the copy in e's dtype made once where it fits (its bytes
    # counted in the default budget and held outside what the strategies get), as plan_call does.
    from cce_autotune.planning import planner
    from cce_autotune.plans import CallProblem, MiB

    args = ("explain", "--gpu", "h200", "--vocab", "50000", "--hidden", "2048", "--tokens", "8192", "--live", "1")
    rc, same, err = run_cli(capsys, *args)
    assert rc == 0, err
    rc, mixed, err = run_cli(capsys, *args, "--classifier", "fp32")
    assert rc == 0, err
    p = CallProblem(n=8192, n_all=8192, V=50000, D=2048, elem=2, grad_bytes=2 * 8192 * 2048 + 4 * 50000 * 2048,
                    c_elem=4, cast_bytes=50000 * 2048 * 2)
    assert planner.converts_whole(p, "auto")
    budget = planner.call_budget(p, "auto", converted=True)
    head = mixed.splitlines()[0]
    assert f"memory budget {budget / MiB:.0f} MiB, fp32 classifier: its 195 MiB copy in bf16 made once (held" in head
    assert "fp32 classifier" not in same.splitlines()[0] and same != mixed
    assert "  exact: backward fused" in mixed  # (an fp32 dC sums the blocks without rounding: exact may fuse)
    # Too small a budget for the copy: converted a chunk at a time, and no fused plan (it reads the copy).
    rc, small, err = run_cli(capsys, *args, "--classifier", "fp32", "--max-extra-memory", "64MiB")
    assert rc == 0, err
    assert "does not fit: converted a chunk at a time" in small and "fused" not in small


def test_merge_leaves_no_lock_file_beside_the_output(isolated, capsys):
    from conftest_tune import make_entry

    a = isolated["tmp"] / "a.yaml"
    a.write_text(yaml.safe_dump({"schema_version": 1, "gpu": "h200", "entries": [make_entry().to_dict()]}))
    out_dir = isolated["tmp"] / "merged"
    out_dir.mkdir()
    rc, _, err = run_cli(capsys, "merge", str(a), "--out", str(out_dir / "h200.yaml"))
    assert rc == 0, err
    assert sorted(p.name for p in out_dir.iterdir()) == ["h200.yaml"]
    assert not list(isolated["tmp"].glob("*.lock"))

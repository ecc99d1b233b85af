"""Defects found by fault injection and bad input (issue 10): each test failed before its fix."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import subprocess
import sys

import optuna
import pytest
import sqlalchemy.exc
import torch
import torch.nn.functional as F
from conftest_tune import isolated, make_entry  # noqa: F401
from optuna.trial import TrialState

from cce_autotune import cli, codegen, linear_cross_entropy
from cce_autotune.configdb import store as db
from cce_autotune import tuner as tune
from helpers import make_inputs, rel_err
from test_loss import SMALL

PROBLEM = tune.TuningProblem(B=512, V=32000, D=256)


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# 1. Second derivatives: refused clearly on both paths (the torch path used to return a wrong one).
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_double_backward_is_refused_clearly(impl, device):
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float32, device=device)
    e.requires_grad_()
    loss = linear_cross_entropy(e, c, t, impl=impl, variants=SMALL)
    (g,) = torch.autograd.grad(loss, e, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        torch.autograd.grad((g * g).sum(), e)


# 2. Unsigned targets: ignore_index=-100 must not wrap to 156 (class 156 silently ignored).
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_uint8_targets_compare_in_int64(impl, device):
    e, c, _, _ = make_inputs((8,), 200, 16, torch.float32, device=device)
    t = torch.tensor([156, 3, 156, 199, 0, 156, 7, 100], dtype=torch.uint8, device=device)
    out = linear_cross_entropy(e, c, t, impl=impl, variants=SMALL)
    ref = F.cross_entropy(e.double() @ c.double().T, t.long())
    assert torch.isfinite(out) and rel_err(out, ref) < 1e-5


# 3. Several processes creating one fresh studies database: the loser of the race opens it again.
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


def test_concurrent_creation_of_one_database(isolated):
    # Four processes open the same fresh database at once (the crash the issue saw in 2 of 4 runs).
    url = f"sqlite:///{isolated['tmp'] / 'fresh.db'}"
    code = f"from cce_autotune import tuner; tuner.make_storage({url!r}); print('ok')"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    results = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-500:] for r in results]


# 4. The saved YAML keeps the existing file's mode, or follows the umask for a new one (not 0600).
def test_saved_configs_keep_their_mode(isolated):
    path = isolated["tmp"] / "h200.yaml"
    old = os.umask(0o022)
    try:
        db.save_entries(path, [make_entry(median=1.0)], gpu="h200")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        path.chmod(0o640)
        db.save_entries(path, [make_entry(median=0.5)], gpu="h200")
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(old)


# 5. A trial left RUNNING by a killed worker does not count against --trials.
def test_trials_of_a_dead_worker_do_not_count(isolated):
    url = f"sqlite:///{isolated['tmp'] / 'studies.db'}"
    spec = tune.StudySpec("h200", "indexed_dot", PROBLEM, n_trials=5)
    study = tune.open_study(spec, url)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    trial = study.ask(tune._distributions(tune.load_space(spec.kernel)))
    trial.set_user_attr("measured", True)
    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}:w0")
    backend = tune.make_backend("fake")
    stats = tune.run_study(spec, backend, url)
    trials = study.get_trials()
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED) and t.user_attrs.get("measured")]
    assert len(done) == 5, stats
    assert study.get_trials()[0].state == TrialState.FAIL


# 6. An unusable results folder or studies database is found before tuning, in one line.
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


# 7. A config file that is not UTF-8 is named in the error (API and cce-tune show).
def test_non_utf8_config_is_named(isolated, capsys):
    bad = isolated["config"] / "h200.yaml"
    bad.write_bytes(b"schema_version: 1\ngpu: h200\n# \xff\xfe\n")
    with pytest.raises(db.ConfigDBError, match="h200.yaml.*not UTF-8"):
        db.load_file(bad)
    rc, out, err = run_cli(capsys, "show", "--gpu", "h200")
    assert rc == 1 and "h200.yaml" in err and "UTF-8" in err and "Traceback" not in err


# 9. An entry tuned on the current template replaces one tuned on an older template.
def test_current_template_entry_wins_over_a_stale_one():
    stale = make_entry(kernel="indexed_dot", median=1.0)  # template hash 0123456789abcdef
    current = dataclasses.replace(make_entry(kernel="indexed_dot", median=1.05),
                                  template_hash=codegen.template_hash("indexed_dot"))
    merged, report = db.merge_entries([stale], [current])
    assert merged == [current] and report.replaced
    faster_stale = make_entry(kernel="indexed_dot", median=0.5)
    merged, report = db.merge_entries([current], [faster_stale])
    assert merged == [current] and report.kept


# 10. Ctrl-C during the plan step: a line, exit status 130, no traceback.
def test_ctrl_c_during_planning(isolated, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune, "make_plan", interrupted)
    rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "32000", "--dry-run")
    assert rc == 130 and "interrupted" in err and "Traceback" not in err


# 8. A broken config file is skipped with one warning (other folders still apply); the database can
#    be switched off.
def test_broken_lower_priority_config_is_skipped(isolated, monkeypatch):
    from cce_autotune.configdb import dispatch

    good = isolated["config"]
    lower = isolated["cache"] / "tuned_configs"
    lower.mkdir(parents=True)
    (lower / "h200.yaml").write_text("schema_version: 1\ngpu: h200\nentries: [{broken\n")
    entry = make_entry(kernel="indexed_dot", dtype="bf16", B=512, V=32000, D=256, block_b=16, block_d=64)
    db.save_entries(good / "h200.yaml", [entry], gpu="h200")
    dispatch.clear_cache()
    with pytest.warns(UserWarning, match="skipping a tuned-config file"):
        picked = dispatch.select("h200", "bf16", 512, 32000, 256, warn=False)
    assert picked.indexed_dot == entry.variant
    monkeypatch.setenv("CCE_AUTOTUNE_NO_CONFIGS", "1")
    dispatch.clear_cache()
    picked = dispatch.select("h200", "bf16", 512, 32000, 256, warn=False)
    assert picked.indexed_dot != entry.variant  # the built-in default


# 11. Smaller items.
def test_float64_on_the_cpu_with_impl_auto():
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float64)
    assert torch.equal(linear_cross_entropy(e, c, t), linear_cross_entropy(e, c, t, impl="torch"))


def test_softcap_as_a_numpy_scalar_or_a_0d_tensor():
    np = pytest.importorskip("numpy")
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float32)
    ref = linear_cross_entropy(e, c, t, softcap=30.0)
    for cap in (np.float32(30), torch.tensor(30.0)):
        assert torch.equal(linear_cross_entropy(e, c, t, softcap=cap), ref)
    with pytest.raises(ValueError, match="^softcap: "):
        linear_cross_entropy(e, c, t, softcap=torch.ones(2))


def test_error_prefixes_are_not_doubled(capsys):
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float32)
    with pytest.raises(ValueError) as exc:
        linear_cross_entropy(e, c, t, variants={"nonsense": {}})
    assert str(exc.value).startswith("variants: ") and "variants: variants:" not in str(exc.value)
    rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "0", "--dry-run")
    assert rc == 2 and "--vocab: --vocab" not in err and "argument --vocab: expected positive integers" in err


def test_duplicate_yaml_keys_and_cut_files_are_refused(isolated):
    path = isolated["tmp"] / "h200.yaml"
    db.save_entries(path, [make_entry(kernel="indexed_dot"), make_entry(kernel="backward")], gpu="h200")
    text = path.read_text()
    assert "entry_count: 2" in text
    dup = text.replace("gpu: h200\n", "gpu: h200\ngpu: h200\n", 1)
    with pytest.raises(db.ConfigDBError, match="duplicate key 'gpu'"):
        db.parse_config(dup, path)
    cut = text[: text.rindex("\n- ")]  # the last entry lost at an entry boundary
    with pytest.raises(db.ConfigDBError, match="entry_count is 2 but the file holds 1"):
        db.parse_config(cut, path)


def test_unknown_gpu_in_a_dry_run_is_said(isolated, capsys):
    rc, out, err = run_cli(capsys, "--gpu", "nonsense", "--vocab", "32000", "--hidden", "256", "--dry-run")
    assert rc == 0 and "no GPU the alias table knows" in err


def test_render_fp32_uses_the_fp32_defaults(capsys):
    rc, out, _ = run_cli(capsys, "render", "backward", "--dtype", "fp32")
    assert rc == 0 and "BLOCK_B=64" in out and "BLOCK_D=32" in out  # KernelVariants.defaults(elem_bytes=4)


def test_license_file_matches_pyproject():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "LICENSE")) as f:
        assert "Apache License" in f.read(200)
    with open(os.path.join(root, "pyproject.toml")) as f:
        assert 'license = { text = "Apache-2.0" }' in f.read()


def test_the_suite_removes_its_cache_folder(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_x():\n    assert True\n")
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "CCE_AUTOTUNE_CACHE_DIR"}
    env["TMPDIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--confcutdir={tests}",
                    "--rootdir", tests, "-c", os.devnull, str(tmp_path / "test_x.py"), "-o",
                    f"pythonpath={tests}", "-p", "conftest"],
                   env=env, cwd=tests, check=True, capture_output=True, timeout=240)
    assert not list(tmp_path.glob("cce_autotune_test_cache_*"))


def test_readme_yaml_example_is_the_shipped_entry():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    block = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    shipped = db.load_file(os.path.join(root, "tuned_configs", "h200.yaml"))
    first = shipped.entries[0]
    assert f"entry_count: {len(shipped.entries)}" in block
    assert f"median: {first.timing_ms['median']!r}" in block and f"speedup: {round(first.speedup, 4)}" in block
    assert f"template_hash: {first.template_hash}" in block


def test_changing_triton_interpret_after_import_is_explained(monkeypatch):
    from cce_autotune import codegen

    monkeypatch.setenv("TRITON_INTERPRET", "0" if codegen._INTERPRET_AT_IMPORT else "1")
    e, c, t, _ = make_inputs((5,), 40, 16, torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET .* when Triton was imported"):
        codegen.load_kernel(SMALL.indexed_dot, codegen.Flags())


# 12. Determinism: the same gradient bits run to run, in the default filtered mode too.
def test_segment_sums_are_run_sums():
    from cce_autotune.strategies.common import segment_sums

    keys = torch.tensor([1, 1, 1, 3, 4, 4, 7])
    vals = torch.arange(7, dtype=torch.float32)[:, None] * torch.tensor([[1.0, 2.0]])
    out = segment_sums(keys, vals)
    assert torch.equal(out[:, 0], torch.tensor([0.0, 0, 3, 3, 0, 9, 6])) and torch.equal(out[:, 1], 2 * out[:, 0])


def _deterministic_run(device, deterministic, bias=True, strategy="tiles"):
    """Two training-like calls (the second walks the first's order and launches from its map) from
    a clean slate; returns the second call's gradients and the strategies the planner ran."""
    from cce_autotune import memory
    from cce_autotune.planning import explain
    from test_tile_map import MAPPED

    memory.clear()
    e, c, t, b = make_inputs((61,), 300, 45, torch.float32, bias=bias, peaked=2.0, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(strategy=strategy, filter_eps=2.0**-10),
                        lse_forward=MAPPED.lse_forward.replace(merge="lock"))
    with explain.recording() as made:
        for _ in range(2):
            ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
            bb = b.clone().requires_grad_() if b is not None else None
            linear_cross_entropy(ee, cc, t, bb, variants=kv, filter_eps="auto", impl="triton",
                                 deterministic=deterministic).backward()
    return (ee.grad, cc.grad, bb.grad if bb is not None else None), [r.call.backward.strategy for r in made]


@pytest.mark.parametrize("bias", [False, True])
def test_deterministic_gradients_are_bitwise_identical_and_accurate(bias, device):
    (ge, gc, gb), plans = _deterministic_run(device, True, bias=bias)
    assert plans == ["chunked", "chunked"]  # the variant asked for tiles (float atomics)
    (ge2, gc2, gb2), _ = _deterministic_run(device, True, bias=bias)
    assert torch.equal(ge, ge2) and torch.equal(gc, gc2) and (gb is None or torch.equal(gb, gb2))
    _, plans = _deterministic_run(device, False, bias=bias)
    assert plans == ["tiles", "tiles"]
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

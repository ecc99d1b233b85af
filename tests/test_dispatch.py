"""The dispatcher: GPU slug, search path, nearest bucket, device re-validation, one warning,
cached lookups, explain(), and a runtime path that never imports optuna."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from conftest_tune import isolated, make_entry  # noqa: F401

from cce_autotune import codegen
from cce_autotune.configdb import dispatch
from cce_autotune.configdb import store as db
from cce_autotune.variant import KernelVariants


def _tensors(B=8192, V=32000, D=4096, dtype=torch.bfloat16):
    # select_variants only reads shapes, dtype and device: expand() keeps these tiny in memory
    return torch.zeros((), dtype=dtype).expand(B, D), torch.zeros((), dtype=dtype).expand(V, D)


def _select(**kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        variants = dispatch.select_variants(*_tensors(**kw))
    return variants, [w for w in caught if issubclass(w.category, dispatch.TunedConfigWarning)]


def test_cpu_tensors_give_defaults_quietly(isolated):
    variants, warned = _select()
    assert variants == KernelVariants() and warned == []


def test_unknown_gpu_default_and_exactly_one_warning(isolated, monkeypatch):
    monkeypatch.setenv("CCE_AUTOTUNE_GPU", "Mystery GPU 9000")
    v1, w1 = _select(B=4096)
    v2, w2 = _select(B=16384, V=128256)  # another shape: still no second warning
    v3, w3 = _select(B=4096)
    assert v1 == v2 == v3 == KernelVariants()
    assert len(w1) == 1 and w2 == [] and w3 == []
    msg = str(w1[0].message)
    assert "cce-tune --gpu mystery-gpu-9000 --vocab 32000 --hidden 4096 --tokens 4096 --dtype bf16" in msg


def test_tuned_entry_is_used_and_flags_dtype_match_exactly(isolated, monkeypatch):
    db.save_entries(isolated["config"] / "h200.yaml", [
        make_entry("backward", B=8192, V=32000, D=4096, block_b=64),
        make_entry("lse_forward", B=8192, V=32000, D=4096, num_splits=64),
        make_entry("indexed_dot", B=8192, V=32000, D=4096, block_b=16),
        make_entry("backward", B=8192, V=32000, D=4096, has_softcap=True, block_b=32),
    ])
    monkeypatch.setenv("CCE_AUTOTUNE_GPU", "NVIDIA H200")  # a device name resolves through the aliases
    variants, warned = _select()
    assert warned == []
    assert (variants.backward.block_b, variants.lse_forward.num_splits, variants.indexed_dot.block_b) == (64, 64, 16)
    soft = dispatch.select("h200", torch.bfloat16, 8192, 32000, 4096, has_softcap=True, warn=False)
    assert soft.backward.block_b == 32 and soft.lse_forward == KernelVariants().lse_forward
    fp16 = dispatch.select("h200", torch.float16, 8192, 32000, 4096, warn=False)
    assert fp16 == KernelVariants()  # dtype must match exactly


def test_nearest_bucket_by_log_distance(isolated):
    db.save_entries(isolated["config"] / "h200.yaml", [
        make_entry("backward", B=4096, V=32000, D=4096, block_b=32),
        make_entry("backward", B=16384, V=32000, D=4096, block_b=128),
        make_entry("backward", B=8192, V=256128, D=2304, block_b=16),
    ])
    pick = lambda B, V=32000, D=4096: dispatch.select("h200", "bf16", B, V, D, warn=False).backward.block_b  # noqa: E731
    assert pick(4096) == 32
    assert pick(5000) == 32  # bucket 4096
    assert pick(12000) == 128  # bucket 16384 (log2 distance 0 vs 2)
    assert pick(1_000_000) == 128
    assert pick(8192, V=200000, D=2048) == 16  # V and D count too
    ex = dispatch.explain("h200", "bf16", 5000, 32000, 4096)
    assert ex.choices["backward"].entry.key.B == 4096
    assert "exact match" in ex.choices["backward"].reason
    ex = dispatch.explain("h200", "bf16", 8192, 32000, 4096)
    assert "nearest tuned shape (log2 distance 1.00)" in ex.choices["backward"].reason
    assert str(isolated["config"] / "h200.yaml") in str(ex)
    assert "cce-tune --gpu h200" in str(ex) and "--kernels indexed_dot,lse_forward" in str(ex)


def test_entry_too_big_for_the_device_is_skipped(isolated):
    big = dict(block_b=256, block_v=256, block_d=128, num_stages=2, num_warps=16)
    db.save_entries(isolated["config"] / "a100.yaml", [
        make_entry("lse_forward", B=8192, **big),
        make_entry("lse_forward", B=4096, num_splits=8),
    ])
    need = KernelVariants().lse_forward.replace(**big).smem_bytes(2)
    roomy = dispatch.select("a100", "bf16", 8192, 32000, 4096, smem_limit=need, warn=False)
    assert roomy.lse_forward.block_b == 256
    tight = dispatch.select("a100", "bf16", 8192, 32000, 4096, smem_limit=need - 1, warn=False)
    assert tight.lse_forward.num_splits == 8  # the next nearest entry that fits
    ex = dispatch.explain("a100", "bf16", 8192, 32000, 4096, smem_limit=need - 1)
    assert "skipped" in str(ex) and "shared memory" in str(ex)


def test_search_path_order_env_then_cache_then_package(isolated, monkeypatch):
    cache_configs = isolated["cache"] / "tuned_configs"
    db.save_entries(cache_configs / "h200.yaml", [make_entry(block_b=32), make_entry(B=4096, block_b=128)])
    db.save_entries(isolated["config"] / "h200.yaml", [make_entry(block_b=64)])  # same key as the first
    path = dispatch.config_search_path()
    assert path == [isolated["config"], cache_configs, isolated["packaged"]]  # env, cache, then the package
    assert dispatch.select("h200", "bf16", 8192, 32000, 4096, warn=False).backward.block_b == 64
    assert dispatch.select("h200", "bf16", 4096, 32000, 4096, warn=False).backward.block_b == 128


def test_lookups_are_cached(isolated, monkeypatch):
    db.save_entries(isolated["config"] / "h200.yaml", [make_entry(block_b=64)])
    monkeypatch.setenv("CCE_AUTOTUNE_GPU", "h200")
    calls = {"load": 0, "yaml": 0}
    real_load, real_yaml = db.load_file, db._load_yaml

    def counting_load(*a, **k):
        calls["load"] += 1
        return real_load(*a, **k)

    def counting_yaml(*a, **k):
        calls["yaml"] += 1
        return real_yaml(*a, **k)

    monkeypatch.setattr(db, "load_file", counting_load)
    monkeypatch.setattr(db, "_load_yaml", counting_yaml)
    first, _ = _select()
    after_first = dict(calls)
    assert after_first["load"] == 1 and after_first["yaml"] >= 1
    for _ in range(5):
        again, _ = _select()
        assert again == first and again.backward.block_b == 64
    _select(B=4096)  # another key, same GPU: the parsed file is reused too
    assert calls == after_first


def test_corrupted_config_is_skipped_with_a_warning_naming_the_file(isolated):
    # Runtime lookups skip a file that does not load (one warning naming it) and use the defaults;
    # loading it explicitly (cce-tune show, saving) still raises.
    bad = isolated["config"] / "h200.yaml"
    bad.write_text("schema_version: 7\ngpu: h200\nentries: []\n")
    with pytest.warns(UserWarning, match="schema_version 7") as record:
        picked = dispatch.select("h200", "bf16", 8192, 32000, 4096, warn=False)
    assert str(bad) in str(record[0].message)
    assert picked == KernelVariants()
    with pytest.raises(db.ConfigDBError, match="schema_version 7"):
        db.load_file(bad)


def test_gpu_slug_and_helpers(isolated, monkeypatch):
    assert dispatch.gpu_slug(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("CCE_AUTOTUNE_GPU", "NVIDIA A100-SXM4-80GB")
    assert dispatch.gpu_slug(torch.device("cpu")) == "a100"
    assert dispatch.dtype_name(torch.bfloat16) == "bf16" and dispatch.dtype_name("fp32") == "fp32"
    assert [dispatch.b_bucket(b) for b in (1, 3000, 4096, 6000, 12000)] == [1, 4096, 4096, 8192, 16384]
    assert dispatch.smem_limit_for("a100") == 166912 and dispatch.smem_limit_for("cpu") is None


def test_runtime_path_never_imports_optuna(isolated):
    code = (
        "import sys, torch\n"
        "from cce_autotune import linear_cross_entropy\n"
        "from cce_autotune.configdb import dispatch\n"
        "e = torch.randn(8, 16); c = torch.randn(32, 16); t = torch.randint(0, 32, (8,))\n"
        "linear_cross_entropy(e, c, t).item()\n"
        "import os; os.environ['CCE_AUTOTUNE_GPU'] = 'h200'\n"
        "dispatch.select_variants(e, c); dispatch.explain('h200', 'bf16', 8, 32, 16)\n"
        "assert 'optuna' not in sys.modules, 'optuna imported'\n"
        "assert 'cce_autotune.tuner' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_is_looked_up(isolated):
    slug = dispatch.gpu_slug()
    assert slug != "cpu"
    e, c = torch.zeros(64, 128, device="cuda", dtype=torch.bfloat16), torch.zeros(256, 128, device="cuda", dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch.select_variants(e, c)
    assert sum(issubclass(w.category, dispatch.TunedConfigWarning) for w in caught) <= 1


def test_packaged_h200_configs_load_and_are_used():
    # The shipped database is valid, and an H200 lookup at a tuned shape picks its entry.
    from cce_autotune import paths

    dispatch.clear_cache()
    f = db.load_file(paths.resource_dir("tuned_configs") / "h200.yaml", expect_gpu="h200")
    keys = {(k.kernel, k.V, k.D) for k in f.by_key()}
    assert ("backward", 32768, 4096) in keys and ("lse_forward", 256000, 2304) in keys
    # What ships: at least ten heads, softcapped ones, three token buckets at three heads or more,
    # every entry on the current templates with what it was tuned on, and the fitted cost model.
    heads = {(k.V, k.D) for k in f.by_key()}
    buckets = {}
    for k in f.by_key():
        buckets.setdefault((k.V, k.D), set()).add(k.B)
    assert len(heads) >= 10 and any(k.has_softcap for k in f.by_key())
    assert sum(1 for b in buckets.values() if {2048, 8192, 32768} <= b) >= 3
    assert all(e.template_hash == codegen.template_hash(e.key.kernel) and e.data for e in f.entries)
    assert "fitted by cce-tune" in f.cost_model["note"]
    why = dispatch.explain("h200", "bf16", 8192, 32768, 4096, smem_limit=232448)
    assert "exact match" in str(why) and "h200.yaml" in str(why)
    dispatch.clear_cache()


# A broken config file is skipped with one warning (other folders still apply); the database can
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


# Issue 21 item 10, at run time: an entry whose filter is coarser than the bound, in any folder, is
# skipped with a warning naming its file and entry; the file's other entries apply.
def test_a_coarse_filter_entry_is_not_used_at_run_time(isolated):
    path = isolated["config"] / "h200.yaml"
    good = make_entry(kernel="indexed_dot", block_b=16)
    path.write_text(yaml.safe_dump({"schema_version": 1, "gpu": "h200", "entries": [
        make_entry(filter_eps=0.5, block_b=64).to_dict(), good.to_dict()]}))
    with pytest.warns(UserWarning, match=r"skipping entries\[0\] \(backward bf16 B=8192.*filter_eps=0\.5") as rec:
        picked = dispatch.select("h200", "bf16", 8192, 32000, 4096, warn=False)
    assert any(str(path) in str(w.message) for w in rec)
    assert picked.backward == KernelVariants().backward and picked.indexed_dot == good.variant


# Issue 21 item 11, at run time: a cost_model section that does not validate (an unknown coefficient
# of a newer file, a zero rate) is ignored with a warning: the loss runs on the built-in cost model and
# the file's entries still apply.
@pytest.mark.parametrize("section", [{"matmul_tflops": 0}, {"sparse_per_live": 6.5, "sparse_per_bank": 2.0},
                                     {"row_group_min": 0}], ids=["zero-rate", "unknown", "zero-count"])
def test_a_bad_cost_model_section_warns_and_the_loss_runs(isolated, monkeypatch, section, device):
    from cce_autotune import linear_cross_entropy
    from cce_autotune.planning import costs as cost_models
    from cce_autotune.runtime import ops
    from helpers import make_inputs, rel_err, torch_loss
    from test_loss import SMALL

    path = isolated["config"] / "a100.yaml"
    entry = make_entry(kernel="indexed_dot", block_b=16)
    path.write_text(yaml.safe_dump({"schema_version": 1, "gpu": "a100", "cost_model": section,
                                    "entries": [entry.to_dict()]}))
    monkeypatch.setenv("CCE_AUTOTUNE_GPU", "a100")
    # The CPU path plans with the GPU's cost model, as a CUDA tensor's call does.
    monkeypatch.setattr(ops, "_costs", lambda device: dispatch.costs_for(dispatch.gpu_slug(device)))
    e, c, t, _ = make_inputs((6,), 40, 16, torch.float32, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.costs_for("a100") == cost_models.builtin("a100")
        e.requires_grad_()
        loss = linear_cross_entropy(e, c, t, impl="triton", variants=SMALL)
        loss.backward()
    said = [str(w.message) for w in caught if "cost_model" in str(w.message)]
    assert said and all(str(path) in m for m in said), said
    assert rel_err(loss.detach(), torch_loss(e.detach().double(), c.double(), t)) < 1e-4 and torch.isfinite(e.grad).all()
    assert dispatch.select("a100", "bf16", 8192, 32000, 4096, warn=False).indexed_dot == entry.variant


def _deny(monkeypatch, folder):
    """Files under ``folder`` cannot be looked up, as in a mode-000 folder (root could read one)."""
    real = os.stat
    inside = str(folder) + os.sep

    def stat(path, *args, **kwargs):
        if os.fspath(path).startswith(inside):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)


# Issue 21 item 12: a config folder that cannot be searched is skipped with one warning (loss, show,
# explain); a cache folder that is a file, or cannot be created, is never created by a lookup.
@pytest.mark.parametrize("how", ["simulated", "chmod"])
def test_an_unsearchable_config_folder_is_skipped(isolated, monkeypatch, capsys, how):
    from conftest_tune import run_cli

    locked = isolated["tmp"] / "locked"
    locked.mkdir()
    db.save_entries(locked / "h200.yaml", [make_entry(block_b=32)])
    db.save_entries(isolated["config"] / "h200.yaml", [make_entry(kernel="indexed_dot", block_b=16)])
    monkeypatch.setenv("CCE_AUTOTUNE_CONFIG_DIR", os.pathsep.join([str(locked), str(isolated["config"])]))
    if how == "chmod":
        locked.chmod(0)
        if os.access(locked, os.X_OK):
            locked.chmod(0o755)
            pytest.skip("this process reads a mode-000 folder (root)")
    else:
        _deny(monkeypatch, locked)
    dispatch.clear_cache()
    try:
        with pytest.warns(UserWarning, match=f"skipping tuned-config folder {locked}: cannot search it"):
            picked = dispatch.select("h200", "bf16", 8192, 32000, 4096, warn=False)
        assert picked.indexed_dot.block_b == 16 and picked.backward == KernelVariants().backward
        assert locked not in dispatch.config_search_path()
        for argv in (["show", "--gpu", "h200"], ["explain", "--gpu", "h200", "--vocab", "32000", "--hidden", "4096"]):
            dispatch.clear_cache()
            with pytest.warns(UserWarning, match="skipping tuned-config folder"):
                rc, out, err = run_cli(capsys, *argv)
            assert rc == 0 and "Traceback" not in err, err
    finally:
        if how == "chmod":
            locked.chmod(0o755)


@pytest.mark.parametrize("how", ["file", "cannot-create"])
def test_lookups_never_create_the_cache_folder(isolated, monkeypatch, capsys, how):
    from conftest_tune import run_cli

    cache = isolated["tmp"] / "cache-here"
    db.save_entries(isolated["config"] / "h200.yaml", [make_entry(kernel="indexed_dot", block_b=16)])
    if how == "file":
        cache.write_text("not a folder")
    else:  # a read-only parent (simulated: root may write anywhere)
        def refuse(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))

        monkeypatch.setattr(Path, "mkdir", refuse)
    monkeypatch.setenv("CCE_AUTOTUNE_CACHE_DIR", str(cache))
    monkeypatch.setenv("CCE_AUTOTUNE_GPU", "h200")
    dispatch.clear_cache()
    assert _select()[0].indexed_dot.block_b == 16
    assert dispatch.costs_for("h200") is not None and "h200" in str(dispatch.explain("h200", "bf16", 8192, 32000, 4096))
    for argv in (["show", "--gpu", "h200"], ["explain", "--gpu", "h200", "--vocab", "32000", "--hidden", "4096"]):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 0 and "Traceback" not in err, err
    assert cache.is_file() if how == "file" else not cache.exists()

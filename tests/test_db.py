"""The YAML database: schema, validation errors naming the file, merge rules, atomic locked saves,
concurrent writers, and the GPU alias table."""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import stat

import pytest
import yaml
from conftest_tune import isolated, make_entry, run_cli  # noqa: F401

from cce_autotune import codegen
from cce_autotune.configdb import store as db


def test_save_load_roundtrip(tmp_path):
    path = tmp_path / "h200.yaml"
    entries = [
        make_entry("backward", B=8192, block_b=64, filter_eps=None, sort_vocab=False),
        make_entry("lse_forward", B=4096, merge="lock", num_locks=16),
        make_entry("indexed_dot", dtype="fp32", has_bias=True, block_d=256),
    ]
    report = db.save_entries(path, entries)
    assert len(report.added) == 3 and not report.replaced
    text = path.read_text()
    assert yaml.safe_load(text)["schema_version"] == 1
    loaded = db.load_file(path, expect_gpu="h200")
    assert loaded.gpu == "h200"
    assert {e.key: e for e in loaded.entries} == {e.key: e for e in entries}
    bwd = loaded.by_key()[entries[0].key]
    assert bwd.variant.filter_eps is None and bwd.variant.block_b == 64
    assert bwd.speedup == pytest.approx(1.5)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # no temp file left


def test_faster_replaces_slower_is_kept(tmp_path):
    path = tmp_path / "a100.yaml"
    db.save_entries(path, [make_entry(median=2.0, block_b=64)])
    report = db.save_entries(path, [make_entry(median=3.0, block_b=32)])
    assert report.kept and not report.replaced
    assert db.load_file(path).entries[0].variant.block_b == 64
    report = db.save_entries(path, [make_entry(median=1.0, block_b=16)])
    assert report.replaced
    [entry] = db.load_file(path).entries
    assert entry.variant.block_b == 16 and entry.median_ms == 1.0


def _valid_doc():
    return {"schema_version": 1, "gpu": "h200", "entries": [make_entry().to_dict()]}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=2), "schema_version 2 is not supported"),
        (lambda d: d.pop("schema_version"), "missing schema_version"),
        (lambda d: d.update(gpu="a100"), "file is for 'a100'"),
        (lambda d: d["entries"][0]["variant"].update(block_b=48), "entries[0].variant: block_b=48"),
        (lambda d: d["entries"][0]["variant"].update(warp_size=4), "unknown knob(s) ['warp_size']"),
        (lambda d: d["entries"][0]["key"].update(dtype="fp8"), "entries[0].key.dtype"),
        (lambda d: d["entries"][0]["key"].pop("V"), "missing ['V']"),
        (lambda d: d["entries"][0]["timing_ms"].update(median=-1), "entries[0].timing_ms.median"),
        (lambda d: d["entries"].append(copy.deepcopy(d["entries"][0])), "appears twice"),
        (lambda d: d.update(extra=1), "unknown top-level key(s) ['extra']"),
    ],
)
def test_bad_file_names_file_and_problem(tmp_path, mutate, message):
    doc = _valid_doc()
    mutate(doc)
    path = tmp_path / "h200.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(db.ConfigDBError) as err:
        db.load_file(path, expect_gpu="h200")
    assert err.value.path == str(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_corrupted_yaml_is_refused_and_never_overwritten(tmp_path):
    path = tmp_path / "h200.yaml"
    path.write_text("schema_version: 1\nentries: [ {key: \n")  # truncated
    with pytest.raises(db.ConfigDBError, match="not valid YAML") as err:
        db.load_file(path)
    assert str(path) in str(err.value)
    with pytest.raises(db.ConfigDBError):
        db.save_entries(path, [make_entry()])
    assert path.read_text().startswith("schema_version: 1\nentries: [ {key:")


def _writer(path: str, base: int, n: int) -> None:
    for i in range(n):
        db.save_entries(path, [make_entry(B=base + i, median=1.0)])


def test_two_processes_writing_one_file_lose_nothing(tmp_path):
    path = tmp_path / "h200.yaml"
    n = 12
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), base, n)) for base in (1000, 2000)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    keys = {e.key.B for e in db.load_file(path).entries}
    assert keys == set(range(1000, 1000 + n)) | set(range(2000, 2000 + n))
    assert sorted(os.listdir(tmp_path)) == ["h200.yaml"]  # no temp file, and the lock removed with its release


def test_alias_table_exact_then_substring_then_slug():
    table = db.load_aliases([db.Path(__file__).resolve().parents[1] / "tuned_configs" / "aliases.yaml"])
    assert table.resolve("NVIDIA H200") == "h200"
    assert table.resolve("NVIDIA H100 80GB HBM3") == "h100"
    assert table.resolve("NVIDIA A100-SXM4-80GB") == "a100"
    assert table.resolve("nvidia a100 custom board") == "a100"  # case-insensitive substring rule
    assert table.resolve("NVIDIA GH200 96GB HBM3") == "gh200"  # the more specific rule comes first
    assert table.resolve("h200") == "h200"  # a slug is itself
    assert table.resolve("NVIDIA GeForce RTX 5090") == "geforce-rtx-5090"  # unknown: slugified
    assert table.shared_memory["a100"] == 166912


def test_earlier_alias_file_wins(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("schema_version: 1\nexact: {NVIDIA H200: my-h200}\ncontains: [{match: mystery, slug: myst}]\n")
    table = db.load_aliases([mine, db.Path(__file__).resolve().parents[1] / "tuned_configs" / "aliases.yaml"])
    assert table.resolve("NVIDIA H200") == "my-h200"
    assert table.resolve("Mystery Accelerator") == "myst"
    assert table.resolve("NVIDIA A100-SXM4-80GB") == "a100"


def test_bad_alias_file_names_it(tmp_path):
    bad = tmp_path / "aliases.yaml"
    bad.write_text("schema_version: 1\ncontains: [{match: h200}]\n")
    with pytest.raises(db.ConfigDBError, match=r"contains\[0\]") as err:
        db.load_aliases([bad])
    assert str(bad) in str(err.value)


def test_cost_model_section_is_validated_kept_by_saves_and_read_by_the_planner(isolated):
    from cce_autotune.configdb import dispatch
    from cce_autotune.planning import costs as cost_models

    path = isolated["config"] / "a100.yaml"
    doc = _valid_doc()
    doc["gpu"] = "a100"
    doc["cost_model"] = {"sparse_per_live": 6.5, "chunk_ms": 0.05, "measured_on": "2026-12-01"}
    path.write_text(yaml.safe_dump(doc))
    assert db.load_file(path).cost_model["sparse_per_live"] == 6.5
    # Saving new entries keeps the section.
    db.save_entries(path, [make_entry(B=4096)], gpu="a100")
    assert db.load_file(path).cost_model == doc["cost_model"]
    # The planner takes the file's coefficients over the built-in ones, name by name.
    dispatch.clear_cache()
    costs = dispatch.costs_for("a100")
    assert costs.sparse_per_live == 6.5 and costs.chunk_ms == 0.05
    assert costs.products == cost_models.CostModel().products
    assert dispatch.costs_for("b200") == cost_models.builtin("h200")  # no file: the built-in coefficients
    # Bad sections name the file and the field.
    doc["cost_model"] = {"sparse_per_live": -1}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(db.ConfigDBError, match=r"a100\.yaml.*cost_model\.sparse_per_live"):
        db.load_file(path)
    doc["cost_model"] = {"sparse_per_liv": 6.5}
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(db.ConfigDBError, match=r"a100\.yaml: cost_model: unknown coefficient\(s\) \['sparse_per_liv'\]"):
        db.load_file(path)
    # The coefficients of the removed tiles strategy, in a file of an earlier version: the file loads,
    # they are dropped, and the planner takes the rest.
    doc["cost_model"] = {"tiles_per_live": 7.955, "tiles_recompute": 1.2, "window_ms": 0.3, "chunk_ms": 0.07}
    path.write_text(yaml.safe_dump(doc))
    assert db.load_file(path).cost_model == {"chunk_ms": 0.07}
    dispatch.clear_cache()
    assert dispatch.costs_for("a100").chunk_ms == 0.07


def test_shipped_h200_file_carries_the_cost_model():
    from cce_autotune import paths
    from cce_autotune.planning import costs

    cfg = db.load_file(paths.resource_dir("tuned_configs") / "h200.yaml", expect_gpu="h200")
    assert cfg.cost_model and set(cfg.cost_model) - {"measured_on", "note"} <= set(costs.CostModel().to_dict())


# The saved YAML keeps the existing file's mode, or follows the umask for a new one (not 0600).
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

# A config file that is not UTF-8 is named in the error (API and cce-tune show).
def test_non_utf8_config_is_named(isolated, capsys):
    bad = isolated["config"] / "h200.yaml"
    bad.write_bytes(b"schema_version: 1\ngpu: h200\n# \xff\xfe\n")
    with pytest.raises(db.ConfigDBError, match="h200.yaml.*not UTF-8"):
        db.load_file(bad)
    rc, out, err = run_cli(capsys, "show", "--gpu", "h200")
    assert rc == 1 and "h200.yaml" in err and "UTF-8" in err and "Traceback" not in err

# An entry tuned on the current template replaces one tuned on an older template.
def test_current_template_entry_wins_over_a_stale_one():
    stale = make_entry(kernel="indexed_dot", median=1.0)  # template hash 0123456789abcdef
    current = dataclasses.replace(make_entry(kernel="indexed_dot", median=1.05),
                                  template_hash=codegen.template_hash("indexed_dot"))
    merged, report = db.merge_entries([stale], [current])
    assert merged == [current] and report.replaced
    faster_stale = make_entry(kernel="indexed_dot", median=0.5)
    merged, report = db.merge_entries([current], [faster_stale])
    assert merged == [current] and report.kept

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


# Issue 21 item 8: nested YAML aliases (a "billion laughs": here 9^7 leaves from a few hundred bytes)
# are refused at the first anchor, fast, naming the file; what a message shows of a value is short.
def test_yaml_aliases_are_refused_fast_and_long_values_are_cut(tmp_path):
    import time

    levels = ['&l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 7):
        levels.append(f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    bomb = tmp_path / "h200.yaml"
    bomb.write_text("schema_version: [" + ", ".join(levels) + "]\ngpu: h200\nentries: []\n")
    assert bomb.stat().st_size < 600
    start = time.perf_counter()
    with pytest.raises(db.ConfigDBError, match="anchors and aliases are not allowed") as err:
        db.load_file(bomb)
    assert time.perf_counter() - start < 1.0
    assert str(bomb) in str(err.value) and len(str(err.value)) < 400
    aliases = tmp_path / "aliases.yaml"
    aliases.write_text("schema_version: 1\nexact: {a: &s h200, b: *s}\n")
    with pytest.raises(db.ConfigDBError, match="anchors and aliases"):
        db.load_aliases([aliases])
    # Values far longer than a message shows: cut to their head and the reason.
    doc = _valid_doc()
    doc["schema_version"] = list(range(5000))
    bad = tmp_path / "long.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(db.ConfigDBError, match=r"schema_version \[0, 1, 2") as err:
        db.load_file(bad)
    assert len(str(err.value)) < 400 and "is not supported" in str(err.value)
    doc = _valid_doc()
    doc["entries"][0]["variant"]["block_b"] = list(range(3000))
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(db.ConfigDBError, match=r"entries\[0\]\.variant: block_b=\[0, 1") as err:
        db.load_file(bad)
    assert len(str(err.value)) < 500 and "must be a power of two" in str(err.value)
    # What the database writes has no anchor even where two entries share a value.
    shared = make_entry(B=4096)
    twin = dataclasses.replace(make_entry(B=8192), versions=shared.versions, timing_ms=shared.timing_ms)
    db.save_entries(tmp_path / "h100.yaml", [shared, twin])
    assert "&id" not in (tmp_path / "h100.yaml").read_text() and len(db.load_file(tmp_path / "h100.yaml").entries) == 2


# Issue 21 item 10: an entry's knobs are bounded at load: a filter coarser than the accuracy check can
# lower to the built-in filter is skipped with a warning naming the file and the entry; the others load.
def test_an_entry_with_a_filter_beyond_the_bound_is_skipped(tmp_path):
    from cce_autotune import paths
    from cce_autotune.planning import filters
    from cce_autotune.variant import BackwardVariant

    # The bound: the coarsest filter the tuner tries, from which the check's ladder reaches the default.
    space = yaml.safe_load((paths.resource_dir("search_spaces") / "backward.yaml").read_text())
    assert db.MAX_FILTER_EPS == max(x for x in space["knobs"]["filter_eps"] if x is not None)
    assert db.MAX_FILTER_EPS * filters.LADDER[-1] == BackwardVariant().filter_eps
    path = tmp_path / "h200.yaml"
    coarse = make_entry(B=4096, filter_eps=0.5)
    edge = make_entry(B=8192, filter_eps=db.MAX_FILTER_EPS)
    other = make_entry(kernel="indexed_dot", block_b=16)
    path.write_text(yaml.safe_dump({"schema_version": 1, "gpu": "h200",
                                    "entries": [coarse.to_dict(), edge.to_dict(), other.to_dict()]}))
    with pytest.warns(UserWarning, match=r"h200\.yaml: skipping entries\[0\] \(backward bf16 B=4096 .*filter_eps=0\.5") as rec:
        cfg = db.load_file(path, expect_gpu="h200")
    assert str(path) in str(rec[0].message)
    assert {e.key for e in cfg.entries} == {edge.key, other.key} and len(cfg.skipped) == 1


BAD_COST_MODELS = [
    ({"matmul_tflops": 0}, r"cost_model\.matmul_tflops: expected a positive finite number, got 0"),
    ({"flops_per_byte": float("inf")}, r"cost_model\.flops_per_byte: expected a positive finite number"),
    ({"sparse_per_live": 6.5, "sparse_per_bank": 2.0}, r"unknown coefficient\(s\) \['sparse_per_bank'\]"),
    ({"pause_calls": 1.5}, r"cost_model\.pause_calls: expected a positive integer, got 1\.5"),
    ({"row_group_min": 0}, r"cost_model\.row_group_min: expected a positive integer"),
    ({"fused_block_v": 1000}, r"cost_model\.fused_block_v: expected a power of two"),
    ({"note": 3}, r"cost_model\.note: expected a string"),
]


# Issue 21 item 11: the cost_model section is validated at load (known names, positive finite rates,
# integer counts as integers); `show` and `merge` report a bad one in one line.
@pytest.mark.parametrize("section, message", BAD_COST_MODELS, ids=lambda x: str(x)[:30])
def test_a_bad_cost_model_section_is_refused_by_load_show_and_merge(isolated, capsys, section, message):
    path = isolated["config"] / "a100.yaml"
    doc = _valid_doc()
    doc.update(gpu="a100", cost_model=section)
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(db.ConfigDBError, match=message) as err:
        db.load_file(path)
    assert str(path) in str(err.value)
    rc, out, err = run_cli(capsys, "show", "--gpu", "a100")
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert str(path) in err and "cost_model" in err
    merged = isolated["tmp"] / "merged.yaml"
    rc, out, err = run_cli(capsys, "merge", str(path), "--out", str(merged))
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1 and "cost_model" in err
    assert not merged.exists()
    with pytest.raises(db.ConfigDBError, match="not written"):  # nor is such a section ever saved
        db.save_entries(merged, [make_entry()], gpu="a100", cost_model=section)
    assert not merged.exists()

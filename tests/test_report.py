"""cce-tune report (plots, importances, the winners table) and cce-tune merge, on tiny fake studies."""

from __future__ import annotations

import builtins
import dataclasses
import re

import pytest

pytest.importorskip("optuna", reason="the tuner needs Optuna (not in the GPU image)")  # noqa: E402
import yaml
from conftest_tune import isolated, make_entry  # noqa: F401

from cce_autotune import cli, codegen
from cce_autotune.configdb import store as db
from cce_autotune.cli import report
from cce_autotune import tuner as tune

SMALL = tune.TuningProblem(B=512, V=32000, D=256)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """One storage, built once: an indexed_dot study with enough trials for importances (one kernel
    variant, the space's seed, fails to build), and a 2-trial lse_forward study (too few); both for GPU h200."""
    tmp = tmp_path_factory.mktemp("report")
    url = f"sqlite:///{tmp / 'studies.db'}"
    many = tune.StudySpec("h200", "indexed_dot", SMALL, n_trials=8)
    few = tune.StudySpec("h200", "lse_forward", SMALL, n_trials=2)
    broken = [{"block_b": 64}, {"block_b": 8, "block_d": 256}]  # the second is the space's seed
    tune.run_study(many, tune.FakeBackend(fail_resources=broken), url, seed=0)
    tune.run_study(few, tune.FakeBackend(), url, seed=0)
    return {"url": url, "many": many, "few": few, "tmp": tmp}


def _configs(path, *entries, gpu="h200", cost_model=None):
    body = {"schema_version": 1, "gpu": gpu, "entries": [e.to_dict() for e in entries]}
    if cost_model:
        body["cost_model"] = cost_model
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


def _current(entry):
    return dataclasses.replace(entry, template_hash=codegen.template_hash(entry.key.kernel))


# -- report --------------------------------------------------------------------------------------
def test_report_draws_each_study_and_tabulates_winners(isolated, studies, capsys):
    # The indexed_dot winner of the study's key, on the current template: 0.2 ms against 0.5 ms.
    key = studies["many"].key
    winner = _current(make_entry("indexed_dot", B=key.B, V=key.V, D=key.D, median=0.2))
    winner = dataclasses.replace(winner, default_ms={"median": 0.5, "p20": 0.49, "p80": 0.51}, trials=8)
    stale = make_entry("backward", B=4096, V=key.V, D=key.D, median=1.0)  # default 1.5 ms, old template hash
    cfg = _configs(isolated["tmp"] / "h200.yaml", winner, stale)
    out_dir = isolated["tmp"] / "report"
    rc, out, err = run(capsys, "report", "--gpu", "h200", "--storage", studies["url"], "--out", out_dir,
                       "--configs", cfg)
    assert rc == 0, err
    pngs = sorted(out_dir.glob("*.png"))
    assert len(pngs) == 2 and {p.name.split("-")[0] for p in pngs} == {"indexed_dot", "lse_forward"}
    for p in pngs:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 10_000
    assert (out_dir / "report.md").read_text().count("![plot](") == 2

    # winners against the defaults: speed-ups from the entries, template current / stale
    rows = [line for line in out.splitlines() if line.startswith("| indexed_dot |") or line.startswith("| backward |")]
    assert len(rows) == 2
    assert re.search(r"\| indexed_dot \| bf16 \| 512 \| 32000 \| 256 \| no \| no \| 0\.2 \| 0\.5 \| 2\.50x \| 8 \| "
                     r"current \|", out)
    assert re.search(r"\| backward \| bf16 \| 4096 \| .* \| 1 \| 1\.5 \| 1\.50x \| 10 \| stale \|", out)
    assert "| data |" not in out  # no entry carries a data field

    # the studies table: the indexed_dot study takes its default time from the matching entry
    study_row = next(line for line in out.splitlines() if line.startswith("| indexed_dot bf16 B=512"))
    cells = [c.strip() for c in study_row.strip("|").split("|")]
    assert cells[1] == "current" and cells[3] == "8" and cells[9] == "0.5"
    assert int(cells[6]) >= 1  # the seed (block_b=8, block_d=256) failed to build: counted as failed

    # importances: printed for the 8-trial study, skipped with a reason for the 2-trial one
    imp = re.search(r"^- indexed_dot bf16 B=512 V=32000 D=256 \(PED-ANOVA on \d+ complete trials\): (.*)$", out, re.M)
    assert imp, out
    knobs = dict(item.rsplit(" ", 1) for item in imp.group(1).split(", "))
    assert set(knobs) <= {"num_warps", "num_stages", "block_b", "block_d"} and len(knobs) >= 2
    assert abs(sum(float(v) for v in knobs.values()) - 1) < 0.02
    assert "- lse_forward bf16 B=512 V=32000 D=256: skipped: 2 complete trial(s), importances need 3" in out
    assert "wrote" in err and "2 PNG(s)" in err


def test_report_without_matplotlib_still_prints_the_tables(isolated, studies, capsys, monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out_dir = isolated["tmp"] / "tables"
    rc, out, err = run(capsys, "report", "--gpu", "h200", "--storage", studies["url"], "--out", out_dir)
    assert rc == 0, err
    assert "pip install 'cce-autotune[report]'" in err
    assert "## Studies" in out and "| indexed_dot bf16 B=512" in out and "PED-ANOVA" in out
    assert "No tuned-config entries for this GPU." in out  # the isolated search path holds no h200.yaml
    assert not list(out_dir.glob("*.png")) and (out_dir / "report.md").is_file()


def test_report_on_an_empty_or_missing_storage_fails_clearly(isolated, studies, capsys):
    rc, out, err = run(capsys, "report", "--gpu", "a100", "--storage", studies["url"], "--out", isolated["tmp"] / "r")
    assert rc == 1 and out == ""
    assert "no studies for GPU 'a100'" in err and "studies for: h200" in err
    assert not (isolated["tmp"] / "r").exists()
    missing = isolated["tmp"] / "none.db"
    rc, _, err = run(capsys, "report", "--gpu", "h200", "--storage", f"sqlite:///{missing}")
    assert rc == 1 and f"no studies database at {missing}" in err
    assert not missing.exists()  # reading a report creates no database


def test_study_names_parse():
    spec = tune.StudySpec("h200", "backward", dataclasses.replace(SMALL, data="real", has_bias=True))
    parts = report.parse_study_name(spec.name)
    assert (parts["gpu"], parts["kernel"], parts["data"]) == ("h200", "backward", "real")
    assert (parts["B"], parts["bias"], parts["softcap"]) == ("512", "1", "0")
    assert report.parse_study_name("cce:h200:odd") is None


# -- merge ---------------------------------------------------------------------------------------
def test_merge_takes_current_templates_then_the_faster(isolated, capsys):
    tmp = isolated["tmp"]
    a_stale_fast = make_entry("backward", B=4096, median=0.5)  # old template hash, faster
    b_current = _current(make_entry("backward", B=4096, median=0.9))
    a_current_slow = _current(make_entry("indexed_dot", B=4096, median=0.8))
    b_current_fast = _current(make_entry("indexed_dot", B=4096, median=0.6))
    only_a = make_entry("lse_forward", B=8192, median=1.0)
    only_b = make_entry("lse_forward", B=16384, median=1.0)
    a = _configs(tmp / "a.yaml", a_stale_fast, a_current_slow, only_a, cost_model={"forward": 1.0})
    b = _configs(tmp / "b.yaml", b_current, b_current_fast, only_b, cost_model={"forward": 2.0})
    out_path = tmp / "merged" / "h200.yaml"
    rc, out, err = run(capsys, "merge", a, b, "--out", out_path)
    assert rc == 0, err
    merged = db.load_file(out_path, expect_gpu="h200").by_key()
    assert len(merged) == 4  # the union of the keys
    assert merged[b_current.key] == b_current  # current template beats a faster stale entry
    assert merged[b_current_fast.key] == b_current_fast  # both current: the faster
    assert merged[only_a.key] == only_a and merged[only_b.key] == only_b
    assert f"{a}: 3 entries, 1 in the result" in out and f"{b}: 3 entries, 3 in the result" in out
    assert "2 key(s) in several files" in out
    assert f"-> {b} (tuned on the current template)" in out and f"-> {b} (faster)" in out
    assert db.load_file(out_path).cost_model == {"forward": 2.0}  # the file listed last
    assert "cost_model: the files disagree" in out and f"taking {b}'s" in out

    # OUT exists: it is an input too (merged first); a third file adds to it
    c = _configs(tmp / "c.yaml", make_entry("lse_forward", B=1024, median=1.0))
    rc, out, _ = run(capsys, "merge", c, "--out", out_path)
    assert rc == 0 and "(the existing output): 4 entries, 4 in the result" in out
    assert len(db.load_file(out_path).entries) == 5
    assert db.load_file(out_path).cost_model == {"forward": 2.0}  # c has none: the output's is kept


def test_merge_prefers_real_data_over_a_faster_lm_like_entry(isolated, capsys):
    # Timings on different data do not compare: an entry tuned on real hidden states replaces a
    # faster one tuned on LM-like data, and one tuned on captured activations replaces both.
    tmp = isolated["tmp"]
    lm_fast = dataclasses.replace(_current(make_entry("backward", B=8192, median=0.5)), data={"kind": "lm"})
    real_slow = dataclasses.replace(_current(make_entry("backward", B=8192, median=0.9)), data={"kind": "real"})
    a = _configs(tmp / "a.yaml", lm_fast)
    b = _configs(tmp / "b.yaml", real_slow)
    out_path = tmp / "merged" / "h200.yaml"
    rc, out, err = run(capsys, "merge", a, b, "--out", out_path)
    assert rc == 0, err
    assert db.load_file(out_path).by_key()[real_slow.key] == real_slow
    assert f"-> {b} (tuned on real data)" in out
    rc, out, err = run(capsys, "merge", a, "--out", out_path)  # merging the LM-like one again changes nothing
    assert db.load_file(out_path).by_key()[real_slow.key] == real_slow
    filed = dataclasses.replace(real_slow, timing_ms={"median": 2.0, "p20": 2.0, "p80": 2.0},
                                data={"kind": "file", "name": "acts.pt", "sha256": "0" * 16})
    c = _configs(tmp / "c.yaml", filed)
    rc, out, err = run(capsys, "merge", c, "--out", out_path)
    assert db.load_file(out_path).by_key()[filed.key] == filed and "(tuned on file data)" in out


def test_merge_refuses_another_gpu_or_schema(isolated, capsys):
    tmp = isolated["tmp"]
    a = _configs(tmp / "a.yaml", make_entry(median=1.0))
    other = _configs(tmp / "other.yaml", make_entry(median=0.5), gpu="a100")
    out_path = tmp / "h200.yaml"
    rc, out, err = run(capsys, "merge", a, other, "--out", out_path)
    assert rc == 2 and str(other) in err and "'a100'" in err and "nothing written" in err
    assert not out_path.exists()
    future = tmp / "future.yaml"
    future.write_text(yaml.safe_dump({"schema_version": 2, "gpu": "h200", "entries": []}))
    rc, _, err = run(capsys, "merge", a, future, "--out", out_path)
    assert rc == 2 and str(future) in err and "schema_version 2" in err
    assert not out_path.exists()


# -- issue 21 items 9 and 13: the studies database shown without its password, read without a change --
def _copy_db(url: str, path) -> str:
    """A copy of the SQLite studies database at ``url`` in one file (no write-ahead log) at ``path``."""
    import sqlite3

    src, dst = sqlite3.connect(url[len("sqlite:///"):]), sqlite3.connect(path)
    try:
        src.backup(dst)
        dst.execute("PRAGMA journal_mode=DELETE")
    finally:
        src.close()
        dst.close()
    return f"sqlite:///{path}"


def _tables(path) -> set:
    import sqlite3

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        con.close()


def test_report_shows_the_storage_without_its_password(isolated, studies, capsys, monkeypatch):
    # A server URL with a password, served here by the SQLite studies (SQLite takes no password):
    # stdout, stderr and report.md show it masked.
    from cce_autotune.tuner import study

    secret = "postgresql://user:s3cret@db.example/studies"
    real_open, real_read = study._open_storage, getattr(study, "_read_only", None)
    monkeypatch.setattr(study, "_open_storage", lambda url: real_open(studies["url"] if url == secret else url))
    monkeypatch.setattr(study, "_read_only", lambda url: real_read(studies["url"] if url == secret else url),
                        raising=False)
    monkeypatch.setattr(report, "_figure_class", lambda: None)  # (tables only: quicker)
    out_dir = isolated["tmp"] / "r"
    rc, out, err = run(capsys, "report", "--gpu", "h200", "--storage", secret, "--out", out_dir)
    assert rc == 0, err
    md = (out_dir / "report.md").read_text()
    assert "Studies: `postgresql://user:***@db.example/studies` (2 for h200)." in md and "user:***@" in out
    assert "s3cret" not in out + err + md
    rc, out, err = run(capsys, "report", "--gpu", "a100", "--storage", secret, "--out", out_dir)
    assert rc == 1 and "no studies for GPU 'a100' in postgresql://user:***@db.example/studies" in err
    assert "s3cret" not in out + err


def test_report_on_a_damaged_studies_database_is_one_line(isolated, studies, capsys):
    # Random bytes, and a real database whose table of trials is overwritten with random bytes (its
    # schema intact: it opens, and fails when the trials are read): one line, exit status 1, no
    # traceback, the file as it was.
    import os
    import random
    import sqlite3

    noise = isolated["tmp"] / "noise.db"
    noise.write_bytes(b"not sqlite" + os.urandom(64 * 1024))
    damaged = isolated["tmp"] / "damaged.db"
    _copy_db(studies["url"], damaged)
    con = sqlite3.connect(damaged)
    (root,) = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'trials'").fetchone()
    con.close()
    data = bytearray(damaged.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    rng = random.Random(0)
    data[(root - 1) * page:root * page] = bytes(rng.randrange(256) for _ in range(page))
    damaged.write_bytes(bytes(data))
    for path in (noise, damaged):
        before = path.read_bytes()
        rc, out, err = run(capsys, "report", "--gpu", "h200", "--storage", f"sqlite:///{path}",
                           "--out", isolated["tmp"] / "r")
        assert rc == 1 and out == "", err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err and f"sqlite:///{path}" in lines[0], err
        assert path.read_bytes() == before
        assert not (isolated["tmp"] / "r").exists()


def test_report_on_a_database_missing_a_table_creates_nothing(isolated, studies, capsys):
    # Optuna's storage would create the missing table (and the report say: no trials, exit 0).
    import sqlite3

    path = isolated["tmp"] / "cut.db"
    _copy_db(studies["url"], path)
    con = sqlite3.connect(path)
    con.execute("DROP TABLE trials")
    con.commit()
    con.close()
    tables, before = _tables(path), path.read_bytes()
    rc, out, err = run(capsys, "report", "--gpu", "h200", "--storage", f"sqlite:///{path}", "--out", isolated["tmp"] / "r")
    assert rc == 1 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "trials" in lines[0] and "missing" in lines[0], err
    assert _tables(path) == tables and "trials" not in tables  # no table created
    assert path.read_bytes() == before

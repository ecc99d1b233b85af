"""The repository around the package: its licence, the README's example, the suite's own hygiene."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cce_autotune.configdb import store as db


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


def test_the_interpreter_versions_are_checked_and_pinned():
    # numpy 2.4 with Triton < 3.7 failed 235 interpreted tests; the [test] extra pins numpy and the
    # suite says it in one line when the pair is wrong anyway.
    from conftest import interpreter_problem

    assert "numpy 2.4.6 breaks the interpreter of Triton 3.6.0" in interpreter_problem("3.6.0", "2.4.6")
    assert interpreter_problem("3.6.0", "2.3.5") is None
    assert interpreter_problem("3.7.1", "2.4.6") is None and interpreter_problem("3.9.0+git1", "2.5.0") is None
    root = Path(__file__).resolve().parents[1]
    test_extra = next(line for line in (root / "pyproject.toml").read_text().splitlines() if line.startswith("test = "))
    assert '"numpy<2.4"' in test_extra


def test_the_docs_explain_sample_is_what_explain_prints(capsys, monkeypatch):
    # The sample in docs/planner.md is the output of the command it shows, with the shipped configs.
    from conftest_tune import run_cli

    monkeypatch.delenv("CCE_AUTOTUNE_CONFIG_DIR", raising=False)
    monkeypatch.delenv("CCE_AUTOTUNE_NO_CONFIGS", raising=False)
    text = (Path(__file__).resolve().parents[1] / "docs" / "planner.md").read_text()
    block = text.split("```\n$ cce-tune explain ", 1)[1].split("```", 1)[0]
    command, expected = block.split("\n", 1)
    rc, out, err = run_cli(capsys, "explain", *command.split())
    assert rc == 0 and out == expected

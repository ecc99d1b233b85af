"""The repository around the package: its licence, the README's example, the suite's own hygiene."""

from __future__ import annotations

import os
import subprocess
import sys

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

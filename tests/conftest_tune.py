"""Shared fixtures of the tuner / database / dispatcher / CLI tests (imported by those test files).

``isolated``: every cache and config folder in tmp_path, no GPU override, dispatcher caches cleared,
so no test reads or writes the real user cache; the packaged tuned configs are replaced by a folder
holding only the packaged alias table, so that shipped results do not leak into the tests.
"""

from __future__ import annotations

import shutil

import pytest

from cce_autotune import paths
from cce_autotune.configdb import dispatch
from cce_autotune.configdb.store import Entry, EntryKey
from cce_autotune.planning import costs
from cce_autotune.variant import KERNELS


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    config = tmp_path / "config"
    config.mkdir()
    packaged = tmp_path / "packaged"
    packaged.mkdir()
    shutil.copy(paths.resource_dir("tuned_configs") / "aliases.yaml", packaged / "aliases.yaml")
    real = dispatch.resource_dir
    monkeypatch.setattr(dispatch, "resource_dir", lambda name: packaged if name == "tuned_configs" else real(name))
    monkeypatch.setenv("CCE_AUTOTUNE_CACHE_DIR", str(cache))
    monkeypatch.setenv("CCE_AUTOTUNE_CONFIG_DIR", str(config))
    monkeypatch.delenv("CCE_AUTOTUNE_GPU", raising=False)
    monkeypatch.delenv("CCE_AUTOTUNE_BACKEND", raising=False)
    dispatch.clear_cache()
    yield {"cache": cache, "config": config, "tmp": tmp_path, "packaged": packaged}
    dispatch.clear_cache()
    costs.forget_overrides()  # (a tuning run sets the cost model it calibrated for the rest of its process)


def make_entry(kernel="backward", dtype="bf16", B=8192, V=32000, D=4096, median=1.0, has_bias=False,
               has_softcap=False, **knobs) -> Entry:
    variant = KERNELS[kernel](**knobs)
    return Entry(
        key=EntryKey(kernel, dtype, B, V, D, has_bias, has_softcap),
        variant=variant,
        timing_ms={"median": median, "p20": median * 0.99, "p80": median * 1.01},
        default_ms={"median": 1.5, "p20": 1.49, "p80": 1.51},
        template_hash="0123456789abcdef",
        tuned_on="2026-01-01T00:00:00+00:00",
        versions={"torch": "2.13.0", "triton": "3.9.0"},
        device_name="NVIDIA H200",
        trials=10,
    )


def run_cli(capsys, *argv):
    """``cce-tune argv``: (exit status, stdout, stderr)."""
    from cce_autotune import cli

    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err

"""Test set-up: kernels run on the CPU through Triton's interpreter unless a GPU is present."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Keep rendered kernels and studies out of the user's home cache, in a folder removed at exit.
if "CCE_AUTOTUNE_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="cce_autotune_test_cache_")
    os.environ["CCE_AUTOTUNE_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _forget_vocab_orders():
    """Each test starts without remembered vocabulary orders or filter checks (a stale one only
    costs speed or accuracy margin, but tests should not depend on which tensors an earlier test left
    at an address)."""
    from cce_autotune import accuracy, vocab_order

    vocab_order.clear()
    accuracy.clear()
    yield
    vocab_order.clear()
    accuracy.clear()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def no_accuracy_guard(monkeypatch):
    """Filter at exactly the variant's filter_eps, however much it drops: for tests of the skipping
    machinery with deliberately coarse filters (the planner's guard would lower them)."""
    from cce_autotune import accuracy, planner

    monkeypatch.setattr(planner, "MAX_DROPPED", float("inf"))
    monkeypatch.setattr(accuracy, "MAX_ERROR", float("inf"))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)

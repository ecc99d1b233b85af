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


def _release(version: str) -> tuple:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run the kernels with these versions, or None. Triton before 3.7
    turns a 1-element array into an index with int(), which numpy 2.4 refuses: every interpreted test
    would fail with "only 0-dimensional arrays can be converted to Python scalars"."""
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"numpy {numpy_version} breaks the interpreter of Triton {triton_version} (the CPU tests run "
                "the kernels through it): pip install 'numpy<2.4' (the [test] extra pins it), or Triton 3.7 or newer")
    return None


def pytest_configure(config):
    if not HAS_CUDA:
        import numpy
        import triton

        problem = interpreter_problem(triton.__version__, numpy.__version__)
        if problem:
            raise pytest.UsageError(problem)


@pytest.fixture(autouse=True)
def _forget_classifiers():
    """Each test starts without remembered vocabulary orders, pauses or filter checks (a stale one only
    costs speed or accuracy margin, but tests should not depend on which tensors an earlier test left
    at an address)."""
    from cce_autotune import memory

    memory.clear()
    yield
    memory.clear()


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def planned():
    """The plans made during the test, in order (:class:`cce_autotune.planning.explain.Recorded`: each
    call's backward, or its fused forward; ``.call`` is the whole call's plan)."""
    from cce_autotune.planning import explain

    with explain.recording() as made:
        yield made


@pytest.fixture
def set_costs(monkeypatch):
    """``set_costs(**values)``: the planner's cost model is the built-in one with these values (on a GPU
    too: its tuned-config file's section is not read) for the rest of the test."""
    from cce_autotune.configdb import dispatch
    from cce_autotune.planning import costs

    def set_(**values):
        monkeypatch.setitem(costs.BUILTIN, "h200", {**costs.BUILTIN["h200"], **values})
        monkeypatch.setattr(dispatch, "costs_for", lambda gpu: costs.builtin(gpu))

    return set_


@pytest.fixture
def no_accuracy_guard(monkeypatch, set_costs):
    """Filter at exactly the variant's filter_eps, however much it drops: for tests of the skipping
    machinery with deliberately coarse filters (the planner's guard would lower them)."""
    from cce_autotune.planning import filters

    set_costs(max_dropped=float("inf"))
    monkeypatch.setattr(filters, "MAX_ERROR", float("inf"))


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)

"""The strategies that compute a call's gradients, and the one table that names them.

Each strategy is one module of this package (its knobs, cost and memory formulas, template and
launch; see :class:`~cce_autotune.strategies.base.Strategy`); :data:`TABLE` maps its name to the
module, in the planner's order of preference between equal estimates. The variant schema, codegen,
the planner, the calibration and the search space all read the strategies through this table.

A new strategy is a module here plus one line in :data:`TABLE` (or, outside the package, one
:func:`register` call). The forward's own kernels (indexed dot, blockwise LSE, classifier
conversion) are :mod:`cce_autotune.strategies.forward`; the launch helpers several strategies share
are :mod:`cce_autotune.strategies.common`.
"""

from __future__ import annotations

import importlib
import threading

__all__ = ["TABLE", "AUTO_RENDERS", "names", "get", "all_strategies", "register", "unregister", "generation"]

# name -> module of this package
TABLE = {
    "chunked": "chunked",
    "sparse": "sparse",
    "fused": "fused",
}

_lock = threading.Lock()
_loaded: dict = {}
# What ``cce-tune render backward`` shows for strategy="auto" (which the planner resolves per call):
# the kernel that the backward variant's tiling knobs (block_b, block_v, block_d, group_b) shape most
# directly: the chunked strategy's gradient kernel, which every dense plan within the budget runs.
AUTO_RENDERS = "chunked"
_registered: dict = {}  # strategies registered at run time (outside the package)
_generation = [0]  # counts register/unregister calls: what a cache of plans keys on (see generation)


def names() -> tuple:
    """Every strategy's name, in :data:`TABLE` order, then those registered at run time (no module is
    imported: the variant schema validates names without PyTorch)."""
    return tuple(TABLE) + tuple(n for n in _registered if n not in TABLE)


def get(name: str):
    """The strategy called ``name`` (its module's ``STRATEGY``); ValueError when none is."""
    hit = _registered.get(name) or _loaded.get(name)
    if hit is not None:
        return hit
    if name not in TABLE:
        raise ValueError(f"strategy {name!r}: no such strategy; known: {list(names())}")
    with _lock:
        if name not in _loaded:
            # Imported on first use: the modules import PyTorch, which the CLI's commands that only
            # read names (show, merge, --help) do without.
            _loaded[name] = importlib.import_module(f".{TABLE[name]}", __name__).STRATEGY
    return _loaded[name]


def all_strategies() -> list:
    """Every strategy, in :func:`names` order."""
    return [get(n) for n in names()]


def register(strategy) -> None:
    """Add a strategy (an instance of :class:`~cce_autotune.strategies.base.Strategy`) for this process."""
    if not strategy.name or strategy.name in TABLE or strategy.name == "auto":
        raise ValueError(f"strategy {strategy.name!r}: the name is empty, 'auto' or taken")
    _registered[strategy.name] = strategy
    _generation[0] += 1


def unregister(name: str) -> None:
    """Forget a strategy :func:`register` added."""
    _registered.pop(name, None)
    _generation[0] += 1


def generation() -> int:
    """A number that changes whenever the set of strategies does (:func:`register`, :func:`unregister`):
    a result computed from :func:`all_strategies` may be kept under it."""
    return _generation[0]

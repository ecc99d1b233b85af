"""A GPU's cost model: the coefficients that price each strategy in matmuls of the shape, and the
constants chosen or measured on that GPU (thresholds, pauses, launch sizes).

Each strategy declares its own coefficients (``Strategy.coefficients``); the ones every plan uses are
:data:`COMMON`. The built-in values were measured on the H200 with the benchmark's LM-like and real
heads; a GPU's tuned-config file may carry its own (``cost_model:`` in ``tuned_configs/<slug>.yaml``,
written by ``cce-tune``'s calibration), which the runtime reads from the config database and hands to
the planner through :func:`cost_model`.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache
from typing import Any, Callable, Mapping

from .. import strategies
from ..strategies.base import Coefficient

__all__ = ["COMMON", "CostModel", "coefficients", "builtin", "cost_model", "set_cost_model", "forget_overrides",
           "BUILTIN", "TEXT_FIELDS", "RETIRED", "check_section"]

MiB = 2**20

COMMON = (
    Coefficient("forward", 1.25, "the LSE forward (with the indexed dot), which every strategy but the fused one "
                "runs", fitted=True),
    Coefficient("flops_per_byte", 200.0, "the matmul rate over the memory bandwidth: what a byte moved costs"),
    Coefficient("matmul_tflops", 700.0, "cuBLAS's 16-bit rate: converts the fixed costs into matmuls"),
    Coefficient("tile_edge", 50.0, "how a live tile's cost depends on its shape: a mapped plan's terms paid per "
                "live tile (the recompute, the products by live tile, the sparse strategy's passes) cost, at block_b x "
                "block_v tiles, (1 + tile_edge (1/block_b + 1/block_v)) / (1 + tile_edge / 64) of what they cost at "
                "128 x 128 (fitted by hand on the H200 over 32-128-row tiles at two heads, benchmarks/NOTES.md rows "
                "270 and 272)"),
    Coefficient("map_ms", 1.5, "a mapped backward's fixed cost: the sort key, the live grid, the host copy, the "
                "target terms"),
    Coefficient("readback_ms", 0.6, "the device's wait when a mapped backward reads its measurements back: the host "
                "waits for the forward, reads the copy and plans before its first launch (0.55-0.74 ms gaps on an "
                "H100's host, benchmarks/NOTES.md row 280); a call planned on the previous call's measurements "
                "instead launches every block"),
    Coefficient("max_dropped", 0.18, "the dropped-mass guard: the largest share of the gradient's L1 mass a filter "
                "may drop by the tile map's bound (above it the filter is lowered)"),
    Coefficient("pause_share", 0.93, "filtering pays only when the forward and a mapped backward are estimated below "
                "this share of the best plan that filters nothing; else the classifier pauses"),
    Coefficient("pause_calls", 15, "calls a classifier pauses for (neither walking nor mapping) when filtering "
                "cannot pay", integer=True),
    Coefficient("convert_bytes", 128 * MiB, "bytes of one converted chunk of an fp32 classifier with 16-bit e when "
                "it is not converted whole (its copy does not fit the memory budget)", integer=True),
    Coefficient("walk_gather", 0.11, "the LSE forward's extra when its kernel gathers C's rows in a walked order "
                "itself (pointer loads in place of TMA tiles), in matmuls"),
    Coefficient("walk_copy_ms", 0.05, "time per chunk of C the forward copies in the walked order instead: its "
                "launches' tails (0.03-0.04 ms a chunk on the H200) and the host's launches"),
    Coefficient("check_rows", 256, "rows the accuracy check samples", integer=True),
    Coefficient("check_every", 32, "calls of a classifier between two accuracy checks", integer=True),
    Coefficient("check_bytes", 64 * MiB, "the accuracy check's transient memory, at most", integer=True),
)

# Values that differ from the declared defaults, per GPU slug (the defaults are the H200's).
BUILTIN: dict[str, dict] = {"h200": {}}


def coefficients() -> dict:
    """Every coefficient by name: :data:`COMMON`, then each strategy's."""
    out = {c.name: c for c in COMMON}
    for s in strategies.all_strategies():
        for c in s.coefficients:
            out.setdefault(c.name, c)
    return out


# Provenance strings a tuned-config file's cost_model section may carry beside the coefficients.
TEXT_FIELDS = ("measured_on", "note")
# Coefficients of strategies since removed (the tiles strategy's): a file of an earlier version that
# carries them loads, the values ignored.
RETIRED = ("tiles_per_live", "tiles_recompute", "window_ms")


def _unknown(section: Mapping, known) -> list:
    """The names of ``section`` that a cost_model section may not carry: neither a coefficient of
    ``known``, nor one of :data:`TEXT_FIELDS`, nor one of :data:`RETIRED`."""
    return sorted(str(k) for k in section if k not in known and k not in TEXT_FIELDS and k not in RETIRED)


def check_section(section: Any, show: Callable[[Any], str] = repr) -> dict:
    """A tuned-config file's ``cost_model`` mapping, validated (ValueError naming the first problem,
    ``cost_model.<name>: ...``): every name a coefficient of :func:`coefficients` or one of
    :data:`TEXT_FIELDS` (strings); every coefficient a positive finite number, the integer ones
    (counts, bytes, rows) positive integers, a block size a power of two in its declared range
    (``Coefficient.power_of_two``). What passes, :class:`CostModel` and :func:`cost_model` take
    without raising, and no plan divides by zero or loops forever on it. ``show`` formats a value for a message."""
    if not isinstance(section, Mapping):
        raise ValueError(f"cost_model: expected a mapping of coefficient -> number, got {show(section)}")
    known = coefficients()
    unknown = _unknown(section, known)
    if unknown:
        raise ValueError(f"cost_model: unknown coefficient(s) {show(unknown)} (a file of a newer version?); "
                         f"known: {sorted(known)}")
    out = {}
    for name, v in section.items():
        if name in RETIRED:
            continue
        if name in TEXT_FIELDS:
            if not isinstance(v, str):
                raise ValueError(f"cost_model.{name}: expected a string, got {show(v)}")
        elif known[name].integer:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"cost_model.{name}: expected a positive integer, got {show(v)}")
            if known[name].power_of_two:
                lo, hi = known[name].power_of_two
                if v & (v - 1) or not lo <= v <= hi:
                    raise ValueError(f"cost_model.{name}: expected a power of two in [{lo}, {hi}], got {show(v)}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"cost_model.{name}: expected a positive finite number, got {show(v)}")
        out[str(name)] = v
    return out


class CostModel:
    """The numbers of one GPU's cost model, by name (``costs.sparse_per_live``); immutable and hashable.
    ``CostModel(**values)`` takes the declared defaults for the names not given; an unknown name is a
    TypeError naming it."""

    def __init__(self, **values):
        known = coefficients()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise TypeError(f"CostModel: unknown coefficient(s) {unknown}; known: {sorted(known)}")
        merged = {name: c.default for name, c in known.items()}
        for name, v in values.items():
            merged[name] = _typed(known[name], v)
        # The coefficients as plain attributes (the planner reads them many times a call).
        self.__dict__.update(merged)
        self.__dict__["_values"] = merged
        self.__dict__["_hash"] = hash(tuple(merged.items()))

    def __getattr__(self, name: str):
        raise AttributeError(f"CostModel has no coefficient {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("CostModel is immutable: use replace()")

    def __eq__(self, other) -> bool:
        return isinstance(other, CostModel) and self._values == other._values

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return "CostModel(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def replace(self, **changes) -> "CostModel":
        return CostModel(**{**self._values, **changes})

    def to_dict(self) -> dict:
        return dict(self._values)


def _typed(c: Coefficient, value):
    if c.integer and float(value) == int(value):
        return int(value)
    return float(value)


@lru_cache(maxsize=32)
def _builtin(gpu: str, items: tuple) -> CostModel:
    return CostModel(**dict(items))


def builtin(gpu: str | None = None) -> CostModel:
    """The built-in cost model of GPU slug ``gpu`` (the H200's for a GPU without its own, or the CPU)."""
    values = BUILTIN.get(gpu or "", BUILTIN["h200"])
    return _builtin(gpu or "", tuple(sorted(values.items())))


_lock = threading.Lock()
_overrides: dict = {}
_from_files: dict = {}


def set_cost_model(gpu: str, costs: CostModel | None) -> None:
    """Use ``costs`` for GPU slug ``gpu`` in this process, over any file (None: stop). The tuner sets
    the coefficients it has just measured, before its studies run."""
    with _lock:
        if costs is None:
            _overrides.pop(gpu, None)
        else:
            _overrides[gpu] = costs


def forget_overrides() -> None:
    """Stop using every cost model :func:`set_cost_model` set in this process."""
    with _lock:
        _overrides.clear()


def cost_model(gpu: str | None, section: dict | None = None, path=None) -> CostModel:
    """The cost model for GPU slug ``gpu``: the one :func:`set_cost_model` set in this process, else
    ``section`` (the ``cost_model`` mapping of the GPU's tuned-config file at ``path``) over the
    built-in values, else the built-in ones. ValueError naming the file for an unknown coefficient."""
    if gpu in _overrides:
        return _overrides[gpu]
    base = builtin(gpu)
    if not section or not gpu or gpu == "cpu":
        return base
    key = (base, tuple(sorted(section.items())))
    hit = _from_files.get(key)
    if hit is None:
        names = set(base.to_dict())
        unknown = _unknown(section, names)
        if unknown:
            raise ValueError(f"{path}: cost_model: unknown coefficient(s) {unknown}; known: {sorted(names)}")
        hit = base.replace(**{k: v for k, v in section.items() if k in names})
        with _lock:
            _from_files[key] = hit
    return hit

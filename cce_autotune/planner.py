"""How one call's backward runs, and why: strategy, row groups, chunk width, memory.

Every decision about *how* a call runs lives here; :mod:`cce_autotune.kernels` only launches what
a :class:`BackwardPlan` says.  The planner weighs, for the call at hand:

- the live share the forward's tile map measures (the share of (row block, vocabulary tile) pairs
  that may hold a softmax value >= filter_eps, or a target) and, for the chunked strategy, the share
  of (row group, vocabulary chunk) blocks that hold a live tile;
- a cost model of each strategy, in units of one matmul of the shape (2·n·V·D flops), with
  coefficients per GPU (:data:`COSTS`, or a database override);
- a memory budget: the extra device memory (beyond dE, dC and dbias themselves) the backward may
  hold at its peak.  By default ``0.05 · (|dE| + |dC|) + 32 MiB`` plus one fp32 copy of dE (its
  accumulator: 4·n·D bytes, the size of one activation whatever the vocabulary); the ``max_extra_memory``
  argument or ``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY`` ("2GiB", "512MiB", a byte count, "auto" or "none")
  change it.  The fastest strategy that fits is taken; when none fits, the smallest.

Strategies (see :class:`~cce_autotune.variant.BackwardVariant`):

- ``tiles``: one program per live tile, fp32 atomics into fp32 dE and dC scratch (4·(n + V)·D bytes):
  cost ≈ ``tiles_per_live`` x live.
- ``sparse``: live tiles' gradients to a compact buffer, then dE and dC passes: ≈ ``sparse_per_live``
  x live, memory ≈ live tiles x block_b x block_v elements.
- ``chunked``: per vocabulary chunk a kernel writes the gradient block g of every row (dead tiles
  as zeros, without recomputing them) and cuBLAS forms dC[chunk] = g^T E and dE += g C[chunk];
  chunks without a live tile are skipped: ≈ ``recompute`` x live + ``products`` x live chunks.
  Memory: the g block (rows x chunk_v), the gathered C and dC rows of a chunk when the vocabulary
  is walked in a sorted order, and an fp32 dE (4·n·D).  Where the g block of every row does not
  fit beside it, rows go in groups (``row_group`` rows per block of g; dC[chunk] summed over the
  groups in an fp32 (chunk_v x D) buffer, one rounding): dE stays fp32 at any number of tokens.
  Only when not even that fits is dE accumulated in its own dtype (fp32 inside cuBLAS, one rounding
  per live chunk: at 32,768 tokens over ~150 chunks a 3.9e-2 dE error, ten times PyTorch's).
  Without a map (a classifier's first call, or exact gradients) every chunk is computed; with one,
  (chunk, row group) blocks without a live tile are skipped.

``$CCE_AUTOTUNE_EXPLAIN=1`` prints each new plan (strategy, shares, estimates, the reason) to
stderr; ``cce-tune explain`` prints the plan of a shape for a given live share.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field, replace
from functools import lru_cache

__all__ = [
    "decide",
    "plan_forward",
    "default_strategy",
    "ENV_MAX_EXTRA",
    "ENV_EXPLAIN",
    "CostModel",
    "COSTS",
    "Problem",
    "BackwardPlan",
    "memory_budget",
    "parse_bytes",
    "plan_backward",
    "chunk_grid",
    "chunked_shape",
    "report",
    "report_check",
    "admissible",
    "set_cost_model",
]

ENV_MAX_EXTRA = "CCE_AUTOTUNE_MAX_EXTRA_MEMORY"
ENV_EXPLAIN = "CCE_AUTOTUNE_EXPLAIN"
MiB = 2**20


@dataclass(frozen=True)
class CostModel:
    """Backward time in matmuls of the shape, as a function of the live shares.

    ``tiles_per_live``: the tile kernel with a map, per unit of live-tile share (recompute, products
    and the fp32 atomics that dominate them); ``tiles_recompute``: its recompute of every tile when
    there is no map; ``sparse_per_live``: the sparse strategy likewise; ``recompute``: the chunked
    strategy's gradient kernel per unit of live-tile share; ``products``: its two cuBLAS products per
    unit of live-chunk share; ``flops_per_byte``: the GPU's matmul rate over its memory bandwidth,
    which prices the chunked strategy's memory traffic (the g block written and read twice, dE read
    and written once per chunk); ``matmul_tflops`` and ``map_ms``: the fixed time a mapped backward
    spends besides its tiles (the sort key, the live grid, the host copy, the target terms), which
    weighs at small heads."""

    forward: float = 1.25  # the LSE forward (with the indexed dot), which every strategy but fused runs
    tiles_per_live: float = 8.0
    tiles_recompute: float = 1.2
    sparse_per_live: float = 9.0
    recompute: float = 1.25
    products: float = 2.0
    flops_per_byte: float = 200.0  # matmul rate over memory bandwidth: what a byte moved costs
    matmul_tflops: float = 700.0  # cuBLAS bf16 rate: converts the fixed costs below into matmuls
    map_ms: float = 1.5  # a mapped backward's fixed cost: sort key, live grid, host copy, target terms
    chunk_ms: float = 0.19  # host time per chunk of the chunked strategy (a kernel launch, two cuBLAS calls)
    gather_chunk_ms: float = 0.1  # and more per chunk in a sorted order (C and dC rows gathered)
    block_ms: float = 0.12  # host time per block of rows of the fused strategy
    window_ms: float = 0.3  # per dC window of the mapped tile strategy (the launch's tail, the rounding pass)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# Built-in coefficients: the defaults of CostModel, measured on the H200 (2026-11-30) with the
# benchmark's LM-like and real heads. A GPU's tuned-config file may carry its own (``cost_model:``
# in ``tuned_configs/<slug>.yaml``); GPUs without one take these.
COSTS: dict[str, CostModel] = {"h200": CostModel()}


_overrides: dict[str, CostModel] = {}


def set_cost_model(gpu: str, costs: CostModel | None) -> None:
    """Use ``costs`` for GPU slug ``gpu`` in this process, over any file (None: stop). The tuner sets
    the coefficients it has just measured, before its studies run."""
    if costs is None:
        _overrides.pop(gpu, None)
    else:
        _overrides[gpu] = costs


def cost_model(gpu: str | None) -> CostModel:
    """The coefficients for GPU slug ``gpu``: those :func:`set_cost_model` set in this process, else
    its tuned-config file's ``cost_model`` section over the built-in defaults, else the built-in ones
    (the H200's for an unknown GPU or the CPU)."""
    if gpu in _overrides:
        return _overrides[gpu]
    base = COSTS.get(gpu or "", COSTS["h200"])
    if not gpu or gpu == "cpu":
        return base
    from .dispatch import cost_model_for

    found = cost_model_for(gpu)
    if found is None:
        return base
    return _from_file(base, *found)


_file_costs: dict = {}


def _from_file(base: CostModel, data: dict, path) -> CostModel:
    key = (base, tuple(sorted(data.items())))
    hit = _file_costs.get(key)
    if hit is None:
        names = set(base.to_dict())
        unknown = sorted(k for k in data if k not in names and k not in ("measured_on", "note"))
        if unknown:
            raise ValueError(f"{path}: cost_model: unknown coefficient(s) {unknown}; known: {sorted(names)}")
        hit = replace(base, **{k: float(v) for k, v in data.items() if k in names})
        _file_costs[key] = hit
    return hit


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": MiB, "mb": 10**6, "mib": MiB,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(value, name: str = "max_extra_memory") -> int | None | str:
    """``"auto"`` (the default budget), None / ``"none"`` (unlimited), or a byte count from an int or
    a string such as ``"512MiB"``, ``"2 GB"``, ``"1.5GiB"``."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("auto", ""):
            return "auto"
        if text in ("none", "unlimited", "inf"):
            return None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
        if not m or m.group(2) not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size; use e.g. '512MiB', '2GiB', a byte count, "
                             "'auto' or 'none'")
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}: expected a non-negative byte count, a size string, 'auto' or None, got {value!r}")
    return int(value)


def memory_budget(requested, grad_bytes: int, accumulator_bytes: int = 0) -> int | None:
    """Extra bytes the backward may hold: ``requested`` (a :func:`parse_bytes` value; "auto" defers to
    ``$CCE_AUTOTUNE_MAX_EXTRA_MEMORY``, then to the default ``0.05 · grad_bytes + 32 MiB`` plus
    ``accumulator_bytes``, one fp32 copy of dE: the accumulator that keeps dE at fp32 accuracy,
    the size of one activation of the model, whatever the vocabulary)."""
    req = parse_bytes(requested)
    if req == "auto":
        env = os.environ.get(ENV_MAX_EXTRA)
        req = parse_bytes(env, ENV_MAX_EXTRA) if env else "auto"
    if req == "auto":
        return int(0.05 * grad_bytes) + 32 * MiB + accumulator_bytes
    return req


@dataclass(frozen=True)
class Problem:
    """What the planner needs to know about a call's backward."""

    n: int  # rows taking part
    n_all: int  # rows of E (more than n with shift): the chunked strategy's buffers line up with them
    V: int
    D: int
    elem: int  # bytes per input element
    grad_bytes: int  # |dE| + |dC| (+ |dbias|): the outputs themselves
    e_view: bool = True  # E reshapes to (n_all, D) without a copy
    sorted_vocab: bool = False  # the vocabulary is walked in a permuted order (C chunks gathered)
    map_bytes: int = 0  # the forward's tile map, alive during the backward


@dataclass(frozen=True)
class BackwardPlan:
    strategy: str  # "tiles" | "sparse" | "chunked"
    use_map: bool  # launch from the forward's tile map
    chunk_v: int = 0  # chunked: vocabulary columns per chunk
    row_group: int = 0  # chunked: rows per block of g (0: all rows in one block)
    row_block: int = 0  # fused: rows per block of logits
    window_v: int = 0  # tiles with a map: walked positions per fp32 dC window (0: one V x D scratch)
    de_fp32: bool = True  # chunked: dE accumulated in an fp32 buffer (else in dE's own dtype)
    filter_eps: float | None = None  # the filter this plan's live grid used, when lowered from the call's
    live: float | None = None  # live-tile share the map measured
    live_chunks: float | None = None  # chunked: share of vocabulary chunks with a live tile
    cost: float = float("nan")  # estimate, in matmuls of the shape
    extra_bytes: int = 0  # estimate of the peak extra memory
    budget: int | None = None
    reason: str = ""
    alternatives: tuple = field(default_factory=tuple)  # (strategy, cost, extra_bytes, why not)

    def describe(self) -> str:
        parts = [f"backward {self.strategy}"]
        if self.strategy == "chunked":
            parts.append(f"chunks of {self.chunk_v}, dE accumulated in {'fp32' if self.de_fp32 else 'its dtype'}")
            if self.row_group:
                parts.append(f"rows in groups of {self.row_group}")
        if self.window_v:
            parts.append(f"dC windows of {self.window_v}")
        if self.row_block:
            parts.append(f"blocks of {self.row_block} rows")
        if self.live is not None:
            parts.append(f"live tiles {self.live:.1%}")
        if self.live_chunks is not None:
            parts.append(f"live chunks {self.live_chunks:.1%}")
        budget = "unlimited" if self.budget is None else f"{self.budget / MiB:.0f} MiB"
        parts.append(f"est {self.cost:.2f} mm, {self.extra_bytes / MiB:.0f} MiB extra (budget {budget})")
        text = ", ".join(parts) + f": {self.reason}"
        for name, cost, mem, why in self.alternatives:
            text += f"\n    {name}: est {cost:.2f} mm, {mem / MiB:.0f} MiB extra{' - ' + why if why else ''}"
        return text


# -- memory of each strategy ------------------------------------------------------------------
def _map_overhead(p: Problem, use_map: bool) -> int:
    # The map itself plus the transient (tiles x rows) comparison that turns it into a live grid.
    return 2 * p.map_bytes if use_map else 0


def tiles_bytes(p: Problem, use_map: bool, n_live: int, window_v: int = 0) -> int:
    dc_rows = min(window_v, p.V) if window_v else p.V
    return 4 * (p.n_all + dc_rows) * p.D + 4 * n_live + _map_overhead(p, use_map)


def tiles_window(p: Problem, block_v: int, n_live: int, budget: int | None) -> int | None:
    """Walked positions per fp32 dC window of the mapped tile strategy: 0 (one V x D scratch) when
    that fits ``budget``, else the widest power-of-two multiple of block_v (at least 1024 columns)
    that fits, else None."""
    if budget is None or tiles_bytes(p, True, n_live) <= budget:
        return 0
    w = block_v
    while w * 2 < p.V:
        w *= 2
    while w >= max(block_v, 1024):
        if tiles_bytes(p, True, n_live, w) <= budget:
            return w
        w //= 2
    return None


def sparse_bytes(p: Problem, block_b: int, block_v: int, n_live: int) -> int:
    return n_live * (block_b * block_v * p.elem + 8) + _map_overhead(p, True)


def chunked_bytes(p: Problem, chunk_v: int, de_fp32: bool, use_map: bool, row_group: int = 0) -> int:
    w = min(chunk_v, p.V)
    grouped = 0 < row_group < p.n
    g_rows = -(-row_group * p.n_all // max(1, p.n)) if grouped else p.n_all  # a group's rows of E
    b = p.elem * g_rows * w  # the g block
    if grouped:
        b += 4 * w * p.D  # dC[chunk] summed over the groups in fp32
    if de_fp32:
        b += 4 * p.n_all * p.D
    if p.sorted_vocab:
        b += 2 * p.elem * w * p.D  # C[chunk] gathered, dC[chunk] before its scatter
    if not p.e_view:
        b += p.elem * p.n_all * p.D  # E copied into a matrix
    b += 4 * min(1024, p.n) * p.D  # target terms outside the launched tiles, in pieces
    if not use_map:
        return b
    # The map stays alive; the transient comparison that turns it into the live grid is freed
    # before these buffers are allocated, so the peak is the larger of the two.
    return p.map_bytes + max(b, p.map_bytes)


ROW_GROUP_MIN = 1024  # fewer rows per group starve cuBLAS's dC product (a power of two: a multiple of block_b)


def chunked_shape(p: Problem, block_v: int, chunk_v: int, budget: int | None, exact: bool,
                  costs: CostModel | None = None) -> tuple[int, bool, int]:
    """(chunk_v, de_fp32, row_group) of the chunked strategy under ``budget``.

    dE is accumulated in fp32 whenever any shape fits: every chunk width from the variant's down to
    256 columns with all rows in one g block, and the power-of-two row groups of at least
    :data:`ROW_GROUP_MIN` rows at each width; of those that fit, the cheapest by
    :func:`chunked_cost` (fewer, wider blocks move less memory and launch less).  Only when none
    fits is dE accumulated in its own dtype (the widest chunk that fits, halving down to 256
    columns; 1024 when none fits).  Exact gradients always keep the fp32 dE (their accuracy
    promise). ``row_group`` is 0 when all rows go in one block."""
    return _chunked_shape(p, block_v, chunk_v, budget, exact, costs or COSTS["h200"])


@lru_cache(maxsize=256)  # pure, and asked for several times per call (decide, each plan, the exact cost)
def _chunked_shape(p: Problem, block_v: int, chunk_v: int, budget: int | None, exact: bool,
                   costs: CostModel) -> tuple[int, bool, int]:
    top = max(block_v, min(chunk_v, -(-p.V // block_v) * block_v))
    floor = max(block_v, min(top, 1024))
    narrowest = max(block_v, 256)
    widths = []
    w = top
    while w >= min(narrowest, top):
        widths.append(w)
        if w // 2 < block_v:
            break
        w = w // 2 // block_v * block_v  # whole tiles: the live grid is read a tile at a time
    groups = [0]
    R = 1 << max(0, (p.n - 1).bit_length() - 1)  # the largest power of two below n
    while R >= ROW_GROUP_MIN:
        groups.append(R)
        R //= 2
    best = None
    for w in widths:
        for R in groups:
            if budget is not None and chunked_bytes(p, w, True, not exact, R) > budget:
                continue
            cost = chunked_cost(p, costs, 1.0, 1.0, w, True, R)
            if best is None or cost < best[0] - 1e-12:
                best = (cost, w, R)
    if best is not None:
        return best[1], True, best[2]
    if exact:
        return floor, True, 0
    w = top
    while True:
        if budget is None or chunked_bytes(p, w, False, True) <= budget:
            return w, False, 0
        if w // 2 < max(block_v, 256):
            return floor, False, 0
        w = w // 2 // block_v * block_v


def chunk_grid(live_grid, chunk_v: int, block_v: int, group_blocks: int = 0):
    """(chunks, row groups) bool: which (vocabulary chunk, row group) blocks of the chunked strategy
    hold a live tile, from the (row blocks, tiles) live grid; ``group_blocks`` row blocks per group
    (0: one group of all rows)."""
    import torch

    Rb, T = live_grid.shape
    cb = chunk_v // block_v
    K = -(-T // cb)
    rg = group_blocks if 0 < group_blocks < Rb else max(1, Rb)
    G = -(-Rb // rg)
    padded = torch.zeros((G * rg, K * cb), dtype=torch.bool, device=live_grid.device)
    padded[:Rb, :T] = live_grid
    return padded.view(G, rg, K, cb).any(dim=3).any(dim=1).T


# -- the decision -----------------------------------------------------------------------------
def plan_backward(p: Problem, variant, *, has_map: bool, live: float | None = None,
                  live_chunks: float | None = None, budget: int | None = None, costs: CostModel | None = None,
                  exact: bool = False, deterministic: bool = False, chunked_only: bool = False) -> BackwardPlan:
    """The plan for one backward.

    ``variant``: the call's :class:`~cce_autotune.variant.BackwardVariant` (block sizes, chunk_v, and
    its ``strategy``: "auto" lets the planner choose; another value is honoured when it fits the
    budget).  ``has_map``: the forward recorded a tile map; ``live``: the live-tile share it
    measured; ``live_chunks``: the chunked strategy's share of live chunks at the width
    :func:`chunked_shape` gives for this budget (None: all live). ``deterministic``: only the
    chunked strategy, whose sums involve no float atomics (the same bits every run).
    ``chunked_only``: only the chunked strategy either (the dead-tile correction of a filter that
    needs it runs there).
    """
    costs = costs or COSTS["h200"]
    bb, bv = variant.block_b, variant.block_v
    n_tiles = -(-p.n // bb) * -(-p.V // bv)
    use_map = has_map and live is not None and not exact
    L = live if use_map else 1.0
    n_live = int(round(L * n_tiles))
    w, de_fp32, rg = chunked_shape(p, bv, variant.chunk_v, budget, exact, costs)
    Lc = float(live_chunks) if use_map and live_chunks is not None else 1.0
    fixed = costs.map_ms / mm_ms(p, costs) if use_map else 0.0
    options = {"chunked": (fixed + chunked_cost(p, costs, L, Lc, w, de_fp32, rg),
                           chunked_bytes(p, w, de_fp32, use_map, rg))}
    window = 0
    if exact:
        tiles_cost = costs.tiles_per_live  # every tile is live
    else:
        tiles_cost = costs.tiles_per_live * L + (0.0 if use_map else costs.tiles_recompute)
    if variant.accum != "fp32":  # native accumulation: bf16 read-modify-write under locks, no scratch
        options["tiles"] = (3.0 * tiles_cost, 0)
    elif use_map:
        found = tiles_window(p, bv, n_live, budget)
        window = found or 0
        windows = costs.window_ms * -(-p.V // window) / mm_ms(p, costs) if window else 0.0
        options["tiles"] = (fixed + tiles_cost + windows, tiles_bytes(p, True, n_live, window) if found is not None
                            else tiles_bytes(p, True, n_live))
    else:
        options["tiles"] = (tiles_cost, tiles_bytes(p, False, 0))
    if use_map and variant.accum == "fp32":
        options["sparse"] = (fixed + costs.sparse_per_live * L, sparse_bytes(p, bb, bv, n_live))
    if deterministic or chunked_only:
        options = {"chunked": options["chunked"]}
    fits = {k: v for k, v in options.items() if budget is None or v[1] <= budget}
    requested = variant.strategy
    if requested != "auto" and requested in fits:
        choice, why = requested, "the variant asks for it"
    elif fits:
        choice = min(fits, key=lambda k: fits[k][0])
        why = "fastest estimate" + (" within the memory budget" if len(fits) < len(options) else "")
        if deterministic:
            why = "deterministic: the strategy without float atomics"
        elif chunked_only:
            why = "the strategy of the dead-tile correction"
        if requested != "auto":
            why += f" ({requested} " + ("cannot run for this call" if requested not in options else "exceeds the budget") + ")"
    else:
        choice = min(options, key=lambda k: options[k][1])
        why = "nothing fits the memory budget: the smallest"
    alternatives = []
    for k, (c, m) in sorted(options.items(), key=lambda kv: kv[1][0]):
        if k != choice:
            alternatives.append((k, c, m, "" if k in fits else "exceeds the budget"))
    cost, mem = options[choice]
    chunked = choice == "chunked"
    return BackwardPlan(
        strategy=choice, use_map=use_map and not (choice == "tiles" and variant.accum == "native"),
        chunk_v=w if chunked else 0, row_group=rg if chunked else 0, de_fp32=de_fp32 if chunked else True,
        window_v=window if choice == "tiles" and use_map else 0,
        live=live if use_map else None, live_chunks=Lc if (use_map and chunked) else None,
        cost=cost, extra_bytes=mem, budget=budget, reason=why, alternatives=tuple(alternatives),
    )


# -- printing plans ---------------------------------------------------------------------------
_seen_lock = threading.Lock()
_seen: set = set()
last_plan: tuple | None = None  # (BackwardPlan, Problem) of the latest plan made (cce_autotune.calibrate reads it)


def report(plan: BackwardPlan, p: Problem, checked: str = "") -> None:
    """Print the plan to stderr when ``$CCE_AUTOTUNE_EXPLAIN`` is set: every new (shape, strategy,
    shape of groups, map or not, filter, what the accuracy check chose: ``checked``, the text
    :func:`decide` puts before the reason) once, or every plan with ``$CCE_AUTOTUNE_EXPLAIN=all``."""
    global last_plan
    last_plan = (plan, p)
    mode = os.environ.get(ENV_EXPLAIN, "").strip().lower()
    if mode in ("", "0", "false", "no"):
        return
    key = (p.n, p.V, p.D, plan.strategy, plan.chunk_v, plan.row_group, plan.de_fp32, plan.window_v, plan.row_block,
           plan.use_map, plan.filter_eps, checked)
    if mode != "all":
        with _seen_lock:
            if key in _seen:
                return
            _seen.add(key)
    print(f"cce_autotune plan (n={p.n}, V={p.V}, D={p.D}): {plan.describe()}", file=sys.stderr, flush=True)


def report_check(p: Problem, measured, limit: float) -> None:
    """Print what the accuracy check measured (``(filter_eps, dE error, corrected)`` triples) to
    stderr when ``$CCE_AUTOTUNE_EXPLAIN=all``."""
    if not measured or os.environ.get(ENV_EXPLAIN, "").strip().lower() != "all":
        return
    text = ", ".join(f"{err:.2e} at {eps:.2g}{' corrected' if fixed else ''}" for eps, err, fixed in measured)
    print(f"cce_autotune check (n={p.n}, V={p.V}, D={p.D}): dE error {text} (limit {limit:g})", file=sys.stderr,
          flush=True)



# -- the forward's decision: the gradient computed during the forward --------------------------
FUSED_MIN_ROWS = 128  # below this cuBLAS reads C for each block of rows more than it computes


def fused_bytes(p: Problem, row_block: int, dense_rows: bool = True) -> int:
    R = min(row_block, p.n)
    b = R * p.V * (4 + p.elem)  # the block's fp32 logits and its gradient
    if not dense_rows:
        b += 2 * R * p.D * p.elem  # the block's rows of E gathered, its dE before the scatter
    return b + 4 * p.V


def fused_cost(p: Problem, costs: CostModel, row_block: int) -> float:
    """Forward and backward together: three products (logits, dE, dC), slowed where a block of rows
    is too short for cuBLAS to reuse each row of C it reads; the logit block's traffic (fp32 logits
    written and read twice, g written and read twice); dC read and written once per block."""
    R = max(1, min(row_block, p.n))
    reuse = max(1.0, costs.flops_per_byte / R)
    traffic = (12 + 3 * p.elem) * costs.flops_per_byte / (2 * p.D)
    dc_traffic = p.elem * costs.flops_per_byte / R  # dC read and written once per block of rows
    host = costs.block_ms * -(-p.n // R) / mm_ms(p, costs)
    return max(1.5 * costs.products * reuse + traffic + dc_traffic, host)


def plan_forward(p: Problem, variant, *, paused: bool, allowed: bool, dense_rows: bool = True,
                 max_extra_memory="auto", gpu: str | None = None) -> BackwardPlan | None:
    """The fused plan (gradients computed in the forward) when it is the one to run, else None
    (the forward computes the LSE and the backward is planned when it runs).

    The forward must decide before any tile map exists, so it goes by what the previous call of the
    classifier found: ``paused`` (filtering could not pay: most tiles live) or an explicit
    ``strategy="fused"``. ``allowed``: the call needs gradients, reduces by "mean" or "sum" and
    does not return the LSE (its gradient would reach the backward only). Fused must fit the budget
    with blocks of at least :data:`FUSED_MIN_ROWS` rows (or all rows) and beat the forward plus the
    exact chunked backward by the cost model."""
    if not allowed or not (variant.strategy == "fused" or (paused and variant.strategy == "auto")):
        return None
    costs = cost_model(gpu)
    budget = memory_budget(max_extra_memory, p.grad_bytes, 4 * p.n_all * p.D)
    R = fused_rows(p, budget, dense_rows)
    if R is None or (R < min(p.n, FUSED_MIN_ROWS) and variant.strategy != "fused"):
        return None
    cost = fused_cost(p, costs, R)
    other = costs.forward + exact_cost(p, variant, budget, costs)
    if cost >= other and variant.strategy != "fused":
        return None
    why = "the variant asks for it" if variant.strategy == "fused" else (
        "the previous call of this classifier found most tiles live; no recompute beats the forward plus "
        f"an exact backward (est {other:.2f} mm)")
    plan = BackwardPlan(strategy="fused", use_map=False, row_block=R, cost=cost,
                        extra_bytes=fused_bytes(p, R, dense_rows), budget=budget, reason=why)
    report(plan, p)
    return plan


def fused_rows(p: Problem, budget: int | None, dense_rows: bool = True) -> int | None:
    """Rows per logit block of the fused strategy: all of them, else the most (a multiple of 16)
    whose block fits ``budget``; None when not even 16 do."""
    R = -(-p.n // 16) * 16
    while budget is not None and R > 16 and fused_bytes(p, R, dense_rows) > budget:
        R = max(16, (R // 2) // 16 * 16)
    if budget is not None and fused_bytes(p, R, dense_rows) > budget:
        return None
    return min(R, p.n)


def default_strategy() -> str:
    """What ``strategy="auto"`` renders as when no live share is known (``cce-tune render``): the
    chunked strategy, which is never far from the best and needs no V x D scratch."""
    return "chunked"


# Filtering pays for its tile map and sort only when it can skip work: when the forward and a mapped
# backward are estimated at more than this share of the best plan that filters nothing (exact, or
# fused), the classifier's next PAUSE_CALLS forwards neither walk nor record (their plans filter
# nothing: fused where it may run, else exact), and the call after them measures again.
PAUSE_SHARE = 0.93
PAUSE_CALLS = 15


def chunked_cost(p: Problem, costs: CostModel, live: float, live_chunks: float, chunk_v: int, de_fp32: bool,
                 row_group: int = 0) -> float:
    """The chunked strategy's estimate: recompute of the live tiles, and per live chunk the two
    products plus the traffic of the g block (written, read twice), of dE (read, written) and, with
    row groups, of the fp32 dC[chunk] they sum into (read, written per group) - or the host's time to
    launch the (chunk, row group) blocks, where that is longer. ``live_chunks``: the share of those
    blocks that hold a live tile."""
    grouped = 0 < row_group < p.n
    traffic = (1.5 * p.elem * costs.flops_per_byte / p.D + (4 if de_fp32 else 2) * costs.flops_per_byte / max(1, chunk_v)
               + (4 * costs.flops_per_byte / row_group if grouped else 0.0))
    device = costs.recompute * live + live_chunks * (costs.products + traffic)
    n_chunks = -(-p.V // max(1, chunk_v))
    n_groups = -(-p.n // row_group) if grouped else 1
    gather = costs.gather_chunk_ms if p.sorted_vocab else 0.0
    host = live_chunks * n_chunks * (costs.chunk_ms * n_groups + gather) / mm_ms(p, costs)
    return max(device, host)


def mm_ms(p: Problem, costs: CostModel) -> float:
    """Estimated time of one matmul of the shape, ms (converts fixed costs into matmuls)."""
    return 2.0 * max(1, p.n) * p.V * p.D / (costs.matmul_tflops * 1e9)


def exact_cost(p: Problem, variant, budget: int | None, costs: CostModel) -> float:
    """Estimated cost of the best backward that computes every tile (no map, natural order)."""
    natural = replace(p, sorted_vocab=False, map_bytes=0)
    return plan_backward(natural, variant.replace(strategy="auto"), has_map=False, budget=budget, costs=costs,
                         exact=True).cost


def unfiltered_cost(p: Problem, variant, budget: int | None, costs: CostModel, fused_allowed: bool) -> float:
    """Estimated forward + backward of the best plan that filters nothing: the forward and the
    exact backward, or the fused strategy where it may run."""
    best = costs.forward + exact_cost(p, variant, budget, costs)
    R = fused_rows(p, budget) if fused_allowed else None
    if R is not None and R >= min(p.n, FUSED_MIN_ROWS):
        best = min(best, fused_cost(p, costs, R))
    return best


# The accuracy guard: the largest share of the gradient's L1 mass that filtering may drop, by the
# tile map's bounds (:func:`~cce_autotune.tile_map.dropped_share`); above it the filter is lowered by
# each further factor of EPS_SCALES in turn, and past the last the call runs exact (and pauses).
# Measured on the H200 (bf16, B = 8192, the default variant at filters 2^-8 .. 2^-20): the bound is
# 0.22-0.36 wherever the dE error exceeded 1e-2 on LM-like data (1.8e-2 .. 3.6e-2) and 0.12-0.14
# where it stayed below (7e-3 .. 9e-3). It is not a predictor across data: on the real-data heads
# (flat softmax, trained classifier rows) 0.05 came with dE errors of 1.1e-2 .. 3.7e-2, so the guard
# stops coarse filters (a config tuned on other data) and cannot promise 1e-2 by itself.
MAX_DROPPED = 0.18
EPS_SCALES = (1.0, 2.0**-4, 2.0**-8)


def admissible(tile_map, lse, filter_eps: float) -> bool:
    """The dropped-mass guard lets ``filter_eps`` run as it is (:data:`MAX_DROPPED`; one host copy)."""
    from .tile_map import dropped_share

    return float(dropped_share(tile_map, lse, filter_eps)) <= MAX_DROPPED


def decide(p: Problem, variant, filter_eps, tile_map, lse, max_extra_memory="auto", gpu: str | None = None,
           fused_allowed: bool = False, deterministic: bool = False, why: str | None = None,
           chunked_only: bool = False):
    """The plan of a call's backward, measured: ``(plan, live, chunks, pause)``.

    With the forward's ``tile_map`` (and filtering), the live grid is built on the device, the
    chunked strategy's live chunks at the width the budget allows are derived from it, and both
    reach the host in one copy. ``live`` (the grid) and ``chunks`` (a list of bool) are what
    :func:`cce_autotune.kernels.backward` launches from (None when the plan does not use them);
    ``pause`` says that filtering cannot pay for this classifier now (see PAUSE_SHARE): its map
    showed so many live tiles that the forward and a mapped backward cost about as much as the
    best plan that filters nothing (the fused one where ``fused_allowed``); this call then runs
    that exact plan too (``plan`` has no map), and the caller pauses the classifier. ``why``: how the
    caller chose ``filter_eps`` (its measured check), put before the plan's reason; ``chunked_only``:
    a filtering plan must be chunked (the check's dead-tile correction needs it)."""
    import torch

    from .tile_map import dropped_share, live_grid

    costs = cost_model(gpu)
    budget = memory_budget(max_extra_memory, p.grad_bytes, 4 * p.n_all * p.D)
    exact = filter_eps is None
    live = chunks = None
    share = chunk_share = None
    eps, lossy = filter_eps, None
    if tile_map is not None and not exact and p.n > 0:
        bv = variant.block_v
        w, _, rg = chunked_shape(p, bv, variant.chunk_v, budget, exact, costs)
        for scale in EPS_SCALES:
            eps = filter_eps * scale
            live = live_grid(tile_map, lse, eps, p.V, variant.block_b, bv)
            grid = chunk_grid(live, w, bv, rg // variant.block_b).reshape(-1)  # chunk-major, as the backward walks
            dropped = dropped_share(tile_map, lse, eps)
            host = torch.cat([dropped.view(1).double(), live.sum().view(1).double(), grid.double()]).tolist()  # one copy
            if host[0] <= MAX_DROPPED:
                break
        else:
            lossy = host[0]
        share = host[1] / max(1, live.numel())
        chunks = [bool(x) for x in host[2:]]
        chunk_share = sum(chunks) / max(1, len(chunks))
    if lossy is not None:  # even the smallest filter drops too much of this call's gradient: exact
        plan = plan_backward(p, variant, has_map=False, budget=budget, costs=costs, exact=True,
                             deterministic=deterministic)
        plan = replace(plan, reason=f"filtering would drop {lossy:.1e} of the gradient's mass even at filter_eps "
                                    f"{eps:.2g} (at most {MAX_DROPPED:g}): exact; " + plan.reason)
        report(plan, p)
        return plan, None, None, True
    plan = plan_backward(p, variant, has_map=tile_map is not None, live=share, live_chunks=chunk_share,
                         budget=budget, costs=costs, exact=exact, deterministic=deterministic,
                         chunked_only=chunked_only)
    if eps != filter_eps:
        plan = replace(plan, filter_eps=eps, reason=f"filter_eps lowered to {eps:.2g} (at {filter_eps:.2g} the filter "
                                                    f"would drop more than {MAX_DROPPED:g} of the gradient's mass); "
                       + plan.reason)
    if eps != filter_eps and chunked_only:  # (the caller applies the correction only at its checked filter)
        plan = replace(plan, reason="no dead-tile correction at the lowered filter; " + plan.reason)
    if why:  # how the caller chose filter_eps (the measured check of cce_autotune.accuracy)
        plan = replace(plan, reason=why + "; " + plan.reason)
    pause = False
    if plan.use_map and variant.strategy == "auto":
        pause = costs.forward + plan.cost >= PAUSE_SHARE * unfiltered_cost(p, variant, budget, costs, fused_allowed)
        if pause:  # this call too: the map showed that filtering would save nothing, and cost accuracy
            plan = plan_backward(p, variant, has_map=False, budget=budget, costs=costs, exact=True,
                                 deterministic=deterministic)
            plan = replace(plan, reason=f"filtering cannot pay (live tiles {share:.1%}): exact; " + plan.reason)
    if not plan.use_map:
        live = chunks = None
    elif plan.strategy != "chunked":
        chunks = None
    report(plan, p, why or "")
    return plan, live, chunks, pause

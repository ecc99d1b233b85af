"""What a call is and how it runs: the plan types, shared by the planner that makes them, the
strategies that run them and the tools that print them. A leaf: it imports nothing of the package.

- :class:`CallProblem`: the sizes of one call, as the planner and the strategies' formulas see them;
- :class:`Option`: what one strategy would cost a call (time, memory, its sizes), or why it cannot run;
- :class:`BackwardPlan`: the strategy chosen for a call's gradients, its sizes, estimates and reasons;
- :class:`ForwardPlan`: what the forward does (walk a remembered order, record the tile map, or compute
  the gradients itself);
- :class:`CallPlan`: the whole call: both of the above, the filter and its correction, the pause.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MiB", "CallProblem", "Option", "BackwardPlan", "ForwardPlan", "CallPlan"]

MiB = 2**20


@dataclass(frozen=True)
class CallProblem:
    """The sizes of a call, as the planner and the strategies' cost and memory formulas see them."""

    n: int  # rows taking part
    n_all: int  # rows of E (more than n with shift): the chunked strategy's buffers line up with them
    V: int
    D: int
    elem: int  # bytes per input element
    grad_bytes: int  # |dE| + |dC| (+ |dbias|): the outputs themselves
    e_view: bool = True  # E reshapes to (n_all, D) without a copy
    sorted_vocab: bool = False  # the vocabulary is walked in a permuted order (C chunks gathered)
    map_bytes: int = 0  # the forward's tile map, alive during the backward
    c_elem: int = 0  # bytes per classifier element (0: as e's): dC's
    cast_bytes: int = 0  # a classifier whose dtype is not e's: its copy in e's dtype (V x D x elem)
    dense_rows: bool = True  # problem row i is row i of E (no table of row offsets)

    @property
    def dc_elem(self) -> int:
        return self.c_elem or self.elem


@dataclass(frozen=True)
class Option:
    """One strategy's answer for a call: its estimated ``cost`` (in matmuls of the shape), its peak
    ``extra_bytes``, whether it launches from the tile map, and its sizes (``BackwardPlan`` fields:
    chunk_v, row_group, de_fp32, row_block, dc_fp32)."""

    cost: float
    extra_bytes: int
    use_map: bool = False
    sizes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BackwardPlan:
    """How a call's gradients are computed: the strategy, its sizes, the estimates and why."""

    strategy: str  # a registered strategy's name (cce_autotune.strategies)
    use_map: bool  # launch from the forward's tile map
    chunk_v: int = 0  # chunked: vocabulary columns per chunk
    row_group: int = 0  # chunked: rows per block of g (0: all rows in one block)
    row_block: int = 0  # fused: rows per block of logits
    de_fp32: bool = True  # chunked: dE accumulated in an fp32 buffer (else in dE's own dtype)
    dc_fp32: bool = False  # fused: a 16-bit dC summed over the blocks in an fp32 accumulator
    tile_products: bool = False  # chunked: dE and dC formed over the live tiles only (Triton), not by cuBLAS
    filter_eps: float | None = None  # the filter this plan's live grid used, when lowered from the call's
    live: float | None = None  # live-tile share the map measured
    live_chunks: float | None = None  # chunked: share of vocabulary chunks with a live tile
    cost: float = float("nan")  # estimate, in matmuls of the shape
    extra_bytes: int = 0  # estimate of the peak extra memory
    budget: int | None = None
    reason: str = ""
    alternatives: tuple = field(default_factory=tuple)  # (strategy, cost, extra_bytes, why not)
    tiles: Any = None  # the kernel's tiling when not the variant's: a dict of BackwardVariant fields

    def describe(self) -> str:
        parts = [f"backward {self.strategy}"]
        if self.chunk_v:
            parts.append(f"chunks of {self.chunk_v}, dE accumulated in {'fp32' if self.de_fp32 else 'its dtype'}")
            if self.row_group:
                parts.append(f"rows in groups of {self.row_group}")
            if self.tile_products:
                parts.append("products by live tile")
        if self.row_block:
            parts.append(f"blocks of {self.row_block} rows" + (", dC accumulated in fp32" if self.dc_fp32 else ""))
        if self.tiles:
            parts.append("the forward's tiles {block_b}x{block_v}x{block_d}".format(**self.tiles))
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


@dataclass(frozen=True)
class ForwardPlan:
    """What a call's forward does.

    ``walk``: the remembered vocabulary order the forward walks, recording the tile map the backward
    launches from (None: the natural order, no map); ``sort``: the backward sorts the vocabulary and
    remembers the order for the classifier's next call, whose forward walks it; ``fused``: the plan of
    gradients computed during the forward (None: the forward computes the LSE only);
    ``convert_classifier``: an fp32 classifier with 16-bit e is converted whole, once (it fits one
    conversion chunk), and every kernel reads the copy; else the forward converts ``convert_chunk``
    rows at a time (in the walked order); with a walk, ``convert_chunk`` rows of C (of e's dtype) are
    copied at a time in the walked order for the LSE kernel to read by position (0: it gathers them);
    ``paused``: the classifier is paused (filtering could not pay on a recent call)."""

    walk: Any = None  # (V,) int32 order, or None
    sort: bool = False
    fused: BackwardPlan | None = None
    convert_classifier: bool = False
    convert_chunk: int = 0
    paused: bool = False


@dataclass(frozen=True)
class CallPlan:
    """Everything about how one call runs, made by :mod:`cce_autotune.planning.planner` and run by
    :mod:`cce_autotune.runtime.execute`, which decides nothing.

    The forward's part is made when the call starts; the backward's (``backward`` and the fields
    after it) once the forward's tile map and the gradient's coefficients exist.

    ``filter_eps``: the call's filter (the variant's or the caller's; None: exact); ``run_eps``: the
    filter the backward's kernels apply (lowered by the accuracy check or the dropped-mass guard, None
    for an exact backward; a mapped backward walks the order the forward walked, any other the natural
    one); ``correction``: the (D,) fp32 direction of the dead-tile correction, or None;
    ``live``: the (row blocks, tiles) live grid, ``blocks``: a strategy's list of live blocks (the
    chunked strategy's (chunk, row group) blocks) and ``columns``: the host's count of live tiles in
    each tile column of the grid, all None without a map; ``pause``: the classifier's
    next calls that neither walk nor map (0: none); ``checked``: what the accuracy check measured
    (``(filter_eps, dE error, corrected)`` triples)."""

    impl: str  # "triton" | "torch"
    variants: Any = None  # KernelVariants the kernels run (None on the PyTorch path)
    filter_eps: float | None = None
    deterministic: bool = False
    forward: ForwardPlan = field(default_factory=ForwardPlan)
    backward: BackwardPlan | None = None
    run_eps: float | None = None
    correction: Any = None
    live: Any = None
    blocks: Any = None
    columns: Any = None
    pause: int = 0
    checked: tuple = ()
    costs: Any = None  # the GPU's cost model the plan was made with (the launch constants chosen on it)

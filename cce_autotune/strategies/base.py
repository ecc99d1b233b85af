"""What every backward strategy is: its name and facts, its knobs, its cost and memory formulas, its
launch. A strategy module defines one subclass of :class:`Strategy` and one instance of it,
``STRATEGY``, and the table in :mod:`cce_autotune.strategies` names the module.

The formulas are pure Python over a :class:`~cce_autotune.plans.CallProblem` and a cost model (any
object with the coefficients as attributes: :class:`cce_autotune.planning.costs.CostModel`); the
planner asks every strategy and chooses, the strategy never decides when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..plans import CallProblem, Option

if TYPE_CHECKING:  # (types only: the launch helpers import PyTorch)
    from .common import BackwardArgs

__all__ = ["FORWARD_TILE_V", "Coefficient", "PlanContext", "Strategy", "mm_ms", "map_overhead", "tile_shape"]


FORWARD_TILE_V = 128
"""The forward's logit tiles' width where a plan is estimated without the call's variants (the
pause rule's estimate of an unfiltered call): the tiled variants' default ``block_v``."""


@dataclass(frozen=True)
class Coefficient:
    """A number of the cost model: its name, built-in value (chosen or measured on the H200), whether
    ``cce-tune``'s calibration fits it, and what it is. A GPU's tuned-config file may set any of them
    (``cost_model:``)."""

    name: str
    default: float
    doc: str
    fitted: bool = False
    integer: bool = False
    power_of_two: tuple | None = None  # (lo, hi): an integer the kernels use as a block size


@dataclass(frozen=True)
class PlanContext:
    """What a strategy's :meth:`Strategy.option` is asked for one call."""

    problem: CallProblem
    variant: Any  # the call's BackwardVariant (block sizes, chunk_v, accum, ...)
    costs: Any  # the GPU's cost model
    budget: int | None  # extra bytes allowed (None: unlimited)
    use_map: bool  # the forward recorded a tile map and the call filters
    live: float  # live-tile share (1.0 without a map)
    live_blocks: float  # this strategy's share of live blocks (1.0 without a map), see Strategy.blocks
    n_live: int  # live tiles at the variant's tiling
    fixed: float  # a mapped backward's fixed cost, in matmuls (0 without a map)
    exact: bool  # no filter: every tile is computed
    # The host has the strategy's live blocks (read back with the call's measurements) and launches
    # only those; False: nothing was read back, and every block is launched (Strategy.unlisted).
    listed: bool = True


def mm_ms(p: CallProblem, costs) -> float:
    """Estimated time of one matmul of the shape, ms (converts fixed costs into matmuls)."""
    return 2.0 * max(1, p.n) * p.V * p.D / (costs.matmul_tflops * 1e9)


def tile_shape(costs, block_b: int, block_v: int) -> float:
    """What a live (``block_b`` x ``block_v``) tile's kernels cost per unit of live share, relative to a
    128 x 128 tile's (the calibration's tiling, which the per-live coefficients are fitted at): a tile
    loads its ``block_b`` rows of E and ``block_v`` rows of C for ``2 block_b block_v D`` flops, so its
    time goes as ``1 + tile_edge (1 / block_b + 1 / block_v)``."""
    edge = costs.tile_edge
    return (1.0 + edge * (1.0 / block_b + 1.0 / block_v)) / (1.0 + edge * (2.0 / 128))


def map_overhead(p: CallProblem, use_map: bool) -> int:
    """The tile map itself plus the transient (tiles x rows) comparison that turns it into a live grid."""
    return 2 * p.map_bytes if use_map else 0


class Strategy:
    """A way of computing the gradients. Subclasses set the class attributes and implement
    :meth:`option` and :meth:`run` (or :meth:`run_forward` when ``in_forward``).

    - ``name``: what ``BackwardVariant.strategy`` and the plans call it;
    - ``template``, ``kernel_function``: the Jinja template it renders and its main ``@triton.jit``
      function (``templates/backward_<name>.py.j2`` by convention: the backward kernel's template hash
      covers every such file);
    - ``knobs``: the BackwardVariant knobs only this strategy reads (the search space pins them when
      another strategy is asked for);
    - ``needs_map``: it can only run from the forward's tile map;
    - ``in_forward``: it computes the gradients during the forward (the backward only scales them);
    - ``deterministic``: its sums use no float atomics (the same bits every run);
    - ``takes_correction``: it can add the dead-tile correction;
    - ``forward_tiles``: without a map its kernel computes every tile of the logits as the forward's
      does, and it runs with the forward variant's tiling (tuned for that dense work: the backward
      variant's is tuned for the mapped, filtered backward and can be many times slower dense);
    - ``coefficients``: its numbers in the cost model;
    - ``space_rules``: ``(name, rule, why)`` rules of the search space that hold when this strategy
      is asked for (rule language of :mod:`cce_autotune.tuner.space`);
    - ``calibration``: ``(run name, exact)`` or ``(run name, exact, shifted)`` runs that ``cce-tune``
      times with this strategy forced, to fit its coefficients (``shifted``: the targets shifted
      along sequences of the batch, as a causal LM's loss, so that the problem's rows are not E's
      rows in order).
    """

    name: str = ""
    template: str = ""
    kernel_function: str = ""
    knobs: tuple = ()
    needs_map: bool = False
    in_forward: bool = False
    deterministic: bool = False
    takes_correction: bool = False
    forward_tiles: bool = False
    coefficients: tuple = ()
    space_rules: tuple = ()
    calibration: tuple = ()

    # -- planning ------------------------------------------------------------------------------
    def option(self, ctx: PlanContext) -> Option | None:
        """The estimate for the call (None: the strategy cannot run for it)."""
        raise NotImplementedError

    def uses_map(self, variant) -> bool:
        """Whether it can launch from the tile map with ``variant``'s knobs (the forward records the
        map for it only then)."""
        return True

    def forward_option(self, p: CallProblem, costs, budget: int | None, forced: bool = False,
                       summed_blocks: int = 1, tile_v: int = FORWARD_TILE_V) -> Option | None:
        """(``in_forward`` strategies) The estimate of forward and backward together (None: it cannot
        run for the call, or, unless ``forced``, should not; ``summed_blocks``: the most blocks of
        rows a 16-bit dC may be summed over in its own dtype, which the call's accuracy allows;
        ``tile_v``: the columns of the forward's logit tiles, its LSE variant's ``block_v``)."""
        return None

    def blocks(self, live, ctx: PlanContext):
        """For strategies that skip blocks of tiles: the (device, bool) grid of this call's blocks that
        hold a live tile, flattened in launch order, from the (row blocks, tiles) ``live`` grid; None
        for the others. Its share of True is ``ctx.live_blocks`` of the next :meth:`option`, the list
        goes to :meth:`run` as ``args.blocks``."""
        return None

    def block_share(self, live: float, ctx: PlanContext) -> float | None:
        """(Strategies with :meth:`blocks`.) The share of blocks holding a live tile when a share
        ``live`` of the tiles is live, spread at random (``cce-tune explain``'s estimate)."""
        return None

    def unlisted(self, plan) -> bool:
        """Whether ``plan`` (a mapped :class:`~cce_autotune.plans.BackwardPlan` of this strategy) runs
        from the device's live grid alone, without the host's lists (``args.blocks`` and
        ``args.columns`` None): its launches are sized for every block and its programs skip the dead
        ones on the device (what those launches cost is priced with ``PlanContext.listed`` False). The planner may then plan the call on the previous call's measurements,
        with nothing read back."""
        return False

    # -- running -------------------------------------------------------------------------------
    def run(self, args: "BackwardArgs", plan) -> tuple:
        """``(dE, dC, dbias)`` as ``plan`` (a :class:`~cce_autotune.plans.BackwardPlan`) says."""
        raise NotImplementedError

    def forward_cost(self, p: CallProblem, costs, plan) -> float:
        """(``in_forward`` strategies) The estimate of forward and backward together for ``plan``'s sizes."""
        raise NotImplementedError

    def run_forward(self, e, c, bias, rows, targets, coef, softcap, variant, plan, *, dc_dtype=None, block_v=2048):
        """(``in_forward`` strategies) ``(lse, zt, dE, dC, dbias)`` for a unit incoming gradient."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

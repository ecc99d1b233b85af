"""The vocabulary order, the forward's tile map and the backward's list of live tiles.

The backward sorts the vocabulary by descending average logit (:func:`sort_order`) so that the few
tiles with any gradient cluster; the classifier's next forward walks that order
(:mod:`cce_autotune.memory` keeps it) and records, for every row i and vocabulary tile t of its own
tiling, an int8

    q[t, i] >= 8 * (max_{j in t} z_ij - z_i,target) + 1/2        (127: no bound, keep the tile)

(eighths of a nat above the target logit, rounded up).  Once the LSE is known, row i's softmax in
tile t is below ``filter_eps`` whenever ``q[t, i] / 8 < log(filter_eps) + lse_i - z_i,target``,
so the backward need not even recompute a (row block x tile) whose rows all pass that test.  The
target's own onehot term is added separately where its tile is not launched, so a target does not keep
its tile live.
The map costs one byte per (row, forward tile): ``n_rows * ceil(V / block_v)`` bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from .codegen import load_utility
from .launch import cdiv

__all__ = ["sort_order", "TileMap", "measure", "live_grid", "dropped_share", "tile_ids", "live_tiles"]


def sort_order(e_rows: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None = None,
               weights: torch.Tensor | None = None) -> torch.Tensor:
    """The vocabulary by descending average logit over the rows of ``e_rows`` (n, D), counting row i
    with ``weights[i]`` (0 for ignored rows; default 1): the order the backward sorts by.  The mean of
    the rows times C is one matrix-vector product in the inputs' dtype (softcap, monotonic, is left
    out of the key).  Returns an int32 (V,) permutation. Any permutation gives exact results: a stale
    or foreign order only makes more tiles look live."""
    n = max(1, e_rows.shape[0])
    if weights is None:
        mean = e_rows.sum(0) / n
    else:
        mean = (weights.to(e_rows.dtype) @ e_rows) / n
    key = torch.mv(c, mean.to(c.dtype)).float()
    if bias is not None:
        key = key + bias.float()
    return torch.argsort(key, descending=True).to(torch.int32)


@dataclass
class TileMap:
    """What the forward leaves for the backward: the bound map, its tile width, the vocabulary order
    it walked and the target logits the bounds are relative to."""

    q: torch.Tensor  # (ceil(V / block_v), n_rows) int8
    block_v: int
    perm: torch.Tensor  # (V,) int32: position p of the walk is vocabulary entry perm[p]
    zt: torch.Tensor  # (n_rows,) fp32 target logits (softcapped)

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size()


def measure(tmap: TileMap, lse: torch.Tensor, filter_eps: float, V: int, block_b: int,
            block_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(live, dropped)`` at ``filter_eps``, in one pass over the map (one launch of
    ``templates/map_measure.py.j2``, then the division of its sums):

    - ``live``: (row blocks, tiles) bool, which of the backward's (``block_b`` x ``block_v``) tiles, in
      the walked order, may hold a softmax value >= ``filter_eps``: row i is live in forward tile t
      where ``q[t, i] >= ceil(8 (log filter_eps + lse_i - z_i,target))`` (a NaN threshold: everywhere),
      unless its LSE is infinite (an ignored row: no gradient);
    - ``dropped``: 0-dim fp32, a bound on the softmax mass that filtering drops, as a share of the
      gradient's L1 mass. Every (row, forward tile) below the row's threshold counts with the tile's
      width times the largest softmax value its bound allows, ``block_v * exp(q / 8 + z_target -
      lse)`` (an upper bound: the backward drops only tiles dead for a whole block of rows, and a
      tile's values sit below its maximum). The gradient of row i, softmax minus onehot, has L1 mass
      ``2 (1 - p_i,target)``; rows with a non-finite LSE or target logit count in neither sum.

    Both widths are powers of two."""
    q = tmap.q
    TF, n = q.shape
    dev = q.device
    R, TB = cdiv(n, block_b), cdiv(V, block_v)
    live = torch.empty((R, TB), dtype=torch.uint8, device=dev)  # (the kernel writes every entry)
    if R == 0 or TB == 0:
        return live.view(torch.bool), torch.zeros((), dtype=torch.float32, device=dev)
    shared = block_v < tmap.block_v  # (a forward tile holds several backward tiles)
    rf = 1 if shared else block_v // tmap.block_v
    bt = max(1, 4096 // (rf * block_b))  # tiles per program: blocks of at most 4096 bounds
    P = cdiv(TB, bt)
    drop = torch.empty((R, P), dtype=torch.float32, device=dev)
    l1 = torch.empty(R, dtype=torch.float32, device=dev)
    kernel = load_utility("map_measure.py.j2", "cce_map_measure_kernel")
    kernel[(R, P)](q, lse, tmap.zt, live, drop, l1, n, TF, TB, P, q.stride(0), q.stride(1), math.log(filter_eps),
                   tmap.block_v, block_v, BLOCK_B=block_b, BLOCK_T=bt, RF=rf, SHARED=shared, num_warps=4)
    dropped = drop.sum() * tmap.block_v / l1.sum().clamp_min(1e-30)
    return live.view(torch.bool), dropped


def live_grid(tmap: TileMap, lse: torch.Tensor, filter_eps: float, V: int, block_b: int, block_v: int) -> torch.Tensor:
    """(row blocks, tiles) bool: which of the backward's (block_b x block_v) tiles, in the walked
    order, may hold a softmax value >= ``filter_eps`` (:func:`measure`'s ``live``)."""
    return measure(tmap, lse, filter_eps, V, block_b, block_v)[0]


def dropped_share(tmap: TileMap, lse: torch.Tensor, filter_eps: float) -> torch.Tensor:
    """0-dim fp32: a bound on the softmax mass that filtering at ``filter_eps`` drops, as a share of
    the gradient's L1 mass (:func:`measure`'s ``dropped``)."""
    return measure(tmap, lse, filter_eps, tmap.q.shape[0] * tmap.block_v, 64, tmap.block_v)[1]


def tile_ids(live: torch.Tensor, group_b: int, swizzle: bool = True, count: int | None = None) -> torch.Tensor:
    """int32 ids ``pid_b * tiles + pid_n`` of the live tiles of a (row blocks, tiles) grid, in the
    swizzled order of the full grid (groups of ``group_b`` row blocks, walked tile-major, so that
    neighbouring programs share C tiles), or with ``swizzle=False`` in row-major order. ``count``:
    the number of live tiles, known on the host (the planner's copy): the list is then made without
    a device-to-host copy (``nonzero_static``); None: ``nonzero``, which waits for the device."""
    R, T = live.shape
    if not swizzle:
        return _nonzero(live.flatten(), count).squeeze(1).to(torch.int32)
    G = max(1, min(group_b, R))
    RG = -(-R // G) * G
    grid = torch.zeros((RG, T), dtype=torch.bool, device=live.device)
    grid[:R] = live
    g, t, j = _nonzero(grid.view(RG // G, G, T).permute(0, 2, 1), count).unbind(1)
    return ((g * G + j) * T + t).to(torch.int32)


def _nonzero(x: torch.Tensor, count: int | None) -> torch.Tensor:
    """(k, x.dim()) indices of x's nonzero entries, in row-major order: with their ``count`` known,
    without a sync."""
    if count is None:
        return x.nonzero()
    return torch.nonzero_static(x, size=count)


def live_tiles(tmap: TileMap, lse: torch.Tensor, filter_eps: float, V: int, block_b: int, block_v: int,
               group_b: int, swizzle: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, live)``: :func:`tile_ids` of :func:`live_grid`, and the grid."""
    live = live_grid(tmap, lse, filter_eps, V, block_b, block_v)
    return tile_ids(live, group_b, swizzle), live

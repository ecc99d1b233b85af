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

__all__ = ["sort_order", "TileMap", "threshold", "live_grid", "dropped_share", "tile_ids", "live_tiles"]


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


def live_grid(tmap: TileMap, lse: torch.Tensor, filter_eps: float, V: int, block_b: int, block_v: int,
              thr: torch.Tensor | None = None) -> torch.Tensor:
    """(row blocks, tiles) bool: which of the backward's (block_b x block_v) tiles, in the walked
    order, may hold a softmax value >= ``filter_eps``. ``thr``: :func:`threshold` at ``filter_eps``,
    where the caller has it already (else made here)."""
    q = tmap.q
    n = q.shape[1]
    dev = q.device
    thr = threshold(tmap, lse, filter_eps) if thr is None else thr
    live_rows = q >= thr[None, :]  # (T_f, n); q == 127 (saturated) passes every threshold
    live_rows &= (lse != float("inf"))[None, :]  # an ignored row (infinite LSE) has no gradient
    # Rows -> row blocks of the backward.
    R = -(-n // block_b)
    padded = torch.zeros((q.shape[0], R * block_b), dtype=torch.bool, device=dev)
    padded[:, :n] = live_rows
    del live_rows
    live = padded.view(q.shape[0], R, block_b).any(dim=2)  # (T_f, R)
    # Forward tiles -> backward tiles (both widths are powers of two).
    T = -(-V // block_v)
    if block_v <= tmap.block_v:
        live = live.repeat_interleave(tmap.block_v // block_v, dim=0)[:T]
    else:
        r = block_v // tmap.block_v
        wide = torch.zeros((T * r, R), dtype=torch.bool, device=dev)
        wide[: live.shape[0]] = live
        live = wide.view(T, r, R).any(dim=1)
    return live.T.contiguous()


def threshold(tmap: TileMap, lse: torch.Tensor, filter_eps: float) -> torch.Tensor:
    """Per row: the smallest q that can be live, as an int8 threshold (NaN -> everything live)."""
    thr = torch.ceil(8.0 * (math.log(filter_eps) + lse.float() - tmap.zt.float()))
    return torch.nan_to_num(thr, nan=-128.0, posinf=127.0, neginf=-128.0).clamp_(-128, 127).to(torch.int8)


def dropped_share(tmap: TileMap, lse: torch.Tensor, filter_eps: float, thr: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim fp32: a bound on the softmax mass that filtering at ``filter_eps`` drops, as a share of
    the gradient's L1 mass.

    Every (row, forward tile) below the row's threshold counts with the tile's width times the
    largest softmax value its bound allows, ``block_v * exp(q / 8 + z_target - lse)`` (an upper
    bound: the backward drops only tiles dead for a whole block of rows, and a tile's values sit
    below its maximum). The gradient of row i, softmax minus onehot, has L1 mass
    ``2 (1 - p_i,target)``; rows with an infinite LSE (ignored) count in neither sum. ``thr``: as
    :func:`live_grid` takes it."""
    q = tmap.q
    T, n = q.shape
    lse = lse.float()
    zt = tmap.zt.float()
    ok = torch.isfinite(lse) & torch.isfinite(zt)
    log_pt = torch.where(ok, zt - lse, -math.inf)  # log of the target's softmax value, per row
    thr = threshold(tmap, lse, filter_eps) if thr is None else thr
    below = torch.zeros(n, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 22) // max(1, n))  # tiles per slice: a few MiB of temporaries
    for t0 in range(0, T, step):
        qs = q[t0 : t0 + step]
        below += torch.where(qs < thr[None, :], torch.exp(qs.float() * 0.125), 0.0).sum(0)
    dropped = (below * torch.exp(log_pt)).sum() * tmap.block_v
    grad_l1 = torch.where(ok, 2.0 * (1.0 - torch.exp(log_pt)), 0.0).clamp_min(0.0).sum()
    return dropped / grad_l1.clamp_min(1e-30)


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

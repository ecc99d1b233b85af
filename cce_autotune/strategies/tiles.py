"""The tiles strategy: one program per (live) tile recomputes its logits and adds its gradient with
fp32 atomics into fp32 dE and dC scratch (4·(n + V)·D bytes), or, with ``accum="native"``, into
dE and dC themselves under locks. With the tile map only the live tiles are launched, each computed
whole (the kernel's own filter is off: the accuracy check measured what the map skips, nothing more),
and, where the V x D scratch does not fit the memory budget, dC is taken one vocabulary window at a time.

Cost: ``tiles_per_live`` x the live share (the atomics dominate), plus ``tiles_recompute`` when
there is no map to skip tiles by (the kernel's own filter still skips their products).
"""

from __future__ import annotations

from .._lazy import torch, triton  # (imported on first use: see cce_autotune._lazy)
from ..codegen import load_kernel
from ..plans import CallProblem, Option
from ..tile_map import tile_ids
from .base import Coefficient, PlanContext, Strategy, map_overhead, mm_ms
from .common import BackwardArgs, RowLayout, add_target_terms, convert_rows, flags, softcap_arg

__all__ = ["Tiles", "STRATEGY", "extra_bytes", "window"]


# -- formulas -------------------------------------------------------------------------------------
def extra_bytes(p: CallProblem, use_map: bool, n_live: int, window_v: int = 0) -> int:
    """fp32 dE and dC scratch (dC one window of ``window_v`` positions, or V rows), the live list, the map."""
    dc_rows = min(window_v, p.V) if window_v else p.V
    return 4 * (p.n_all + dc_rows) * p.D + 4 * n_live + map_overhead(p, use_map)


def window(p: CallProblem, block_v: int, n_live: int, budget: int | None) -> int | None:
    """Walked positions per fp32 dC window of the mapped tile strategy: 0 (one V x D scratch) when
    that fits ``budget``, else the widest power-of-two multiple of block_v (at least 1024 columns)
    that fits, else None."""
    if budget is None or extra_bytes(p, True, n_live) <= budget:
        return 0
    w = block_v
    while w * 2 < p.V:
        w *= 2
    while w >= max(block_v, 1024):
        if extra_bytes(p, True, n_live, w) <= budget:
            return w
        w //= 2
    return None


# -- the strategy ----------------------------------------------------------------------------------
class Tiles(Strategy):
    name = "tiles"
    template = "backward_tiles.py.j2"
    kernel_function = "cce_backward_kernel"
    knobs = ("accum", "num_locks")
    skips_without_map = True
    coefficients = (
        Coefficient("tiles_per_live", 8.0, "the tile kernel with a map, per unit of live-tile share (recompute, "
                    "products and the fp32 atomics that dominate them)", fitted=True),
        Coefficient("tiles_recompute", 1.2, "its recompute of every tile when there is no map"),
        Coefficient("window_ms", 0.3, "per dC window of the mapped tile strategy (the launch's tail, the rounding pass)"),
    )
    calibration = (("tiles", False), ("tiles_exact", True))

    def option(self, ctx: PlanContext) -> Option:
        p, v, costs = ctx.problem, ctx.variant, ctx.costs
        if ctx.exact:
            tiles_cost = costs.tiles_per_live  # every tile is live
        else:
            tiles_cost = costs.tiles_per_live * ctx.live + (0.0 if ctx.use_map else costs.tiles_recompute)
        if v.accum != "fp32":  # native accumulation: bf16 read-modify-write under locks, no scratch, no map
            return Option(3.0 * tiles_cost, 0)
        if not ctx.use_map:
            return Option(tiles_cost, extra_bytes(p, False, 0))
        found = window(p, v.block_v, ctx.n_live, ctx.budget)
        w = found or 0
        windows = costs.window_ms * -(-p.V // w) / mm_ms(p, costs) if w else 0.0
        return Option(ctx.fixed + tiles_cost + windows,
                      extra_bytes(p, True, ctx.n_live, w) if found is not None else extra_bytes(p, True, ctx.n_live),
                      use_map=True, sizes=dict(window_v=w))

    def uses_map(self, variant) -> bool:
        return variant.accum == "fp32"  # (native accumulation has no list of live tiles)

    def run(self, args: BackwardArgs, plan) -> tuple:
        """dE, dC, dbias: the tile kernel over every tile, or over the live tiles of the map (in dC
        windows of ``plan.window_v`` walked positions when that is set); the onehot terms of rows
        whose target tile is not launched are added outside the kernel."""
        e, c, bias, rows, variant = args.e, args.c, args.bias, args.rows, args.variant
        target_pos, targets, lse, coef_s, coef_t = args.target_pos, args.targets, args.lse, args.coef_s, args.coef_t
        coef_out, perm, softcap, filter_eps = args.coef_out, args.perm, args.softcap, args.filter_eps
        tile_map, live, dc_dtype = args.tile_map, args.live, args.dc_dtype
        if plan.use_map and rows.n > 0:
            # The live tiles of each tile column, from the planner's copy (or one of our own).
            columns = args.columns if args.columns is not None else live.sum(0).tolist()
        if plan.use_map and plan.window_v and rows.n > 0:
            return _windowed(e, c, bias, rows, target_pos, targets, lse, coef_s, coef_t, coef_out, perm, softcap,
                             filter_eps, variant, plan, tile_map, live, columns, dc_dtype=dc_dtype)
        n_rows, D = rows.n, e.shape[-1]
        V = c.shape[0]
        dev = e.device
        native = variant.accum == "native"
        use_map = plan.use_map and n_rows > 0
        acc_dtype = e.dtype if native else torch.float32
        de = torch.zeros(e.shape, dtype=acc_dtype, device=dev)
        dc_dtype = dc_dtype or c.dtype
        dc = torch.zeros(c.shape, dtype=dc_dtype if native else torch.float32, device=dev)
        dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
        if n_rows > 0:
            if use_map:
                tiles = tile_ids(live, variant.group_b, count=sum(columns))
                add_target_terms(c, e.reshape(-1, D), rows, targets, coef_out, tile_map.zt, softcap,
                                 de.view(-1, D), dc, dbias)
            else:
                tiles = None
            # Launched from the map, the kernel computes every launched tile: what the accuracy check
            # measured (its own filter would also skip tiles of live forward tiles, unmeasured).
            _launch(e, c, bias, rows, target_pos, lse, coef_s, coef_t, perm, softcap,
                    0.0 if use_map else filter_eps, variant, tiles, de, dc, dbias)
        if not native:
            de = de.to(e.dtype)
            dc = dc.to(dc_dtype)
        if dbias is not None:
            dbias = dbias.to(bias.dtype)
        return de, dc, dbias


def _launch(e, c, bias, rows: RowLayout, target_pos, lse, coef_s, coef_t, perm, softcap, filter_eps,
            variant, tiles, de, dc, dbias, dc_lo: int | None = None, c_window: torch.Tensor | None = None,
            unused_locks: torch.Tensor | None = None, kernel=None) -> None:
    """The tile kernel over every tile (``tiles`` None) or the listed ones; with ``dc_lo``, ``dc`` is
    the fp32 scratch of the vocabulary window starting at walked position ``dc_lo``, and
    ``c_window`` (if given) that window's rows of C converted to e's dtype, read instead of C.
    ``unused_locks``: fp32 accumulation takes no locks; a caller that launches once per window passes
    one int32 placeholder for them rather than two allocations per launch, and ``kernel`` (what
    :func:`_kernel` returns for these arguments: the same for every window)."""
    n_rows, D = rows.n, e.shape[-1]
    V = c.shape[0]
    native = variant.accum == "native"
    if tiles is not None:
        grid = (tiles.numel(),)
    else:
        grid = (triton.cdiv(n_rows, variant.block_b) * triton.cdiv(V, variant.block_v),)
    if grid[0] == 0:
        return
    if kernel is None:
        kernel = _kernel(e, c if c_window is None else c_window, bias, rows, softcap, variant, tiles is not None,
                         dc_lo is not None, c_window is not None)
    c_arg = c if c_window is None else c_window
    if native or unused_locks is None:
        locks_e = torch.zeros(variant.num_locks if native else 1, dtype=torch.int32, device=e.device)
        locks_c = torch.zeros(variant.num_locks if native else 1, dtype=torch.int32, device=e.device)
    else:
        locks_e = locks_c = unused_locks
    kernel[grid](
        e, c_arg, bias if bias is not None else c, rows.offsets, target_pos, lse, coef_s, coef_t,
        perm if perm is not None else target_pos, tiles if tiles is not None else target_pos,
        de, rows.de_offsets, dc, dbias if dbias is not None else lse, locks_e, locks_c,
        n_rows, V, D, rows.stride, e.stride(-1), c_arg.stride(0), c_arg.stride(1), dc.stride(0),
        softcap_arg(softcap),
        float(filter_eps) if filter_eps is not None else 0.0, dc_lo or 0,
        BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
        GROUP_B=variant.group_b, NUM_LOCKS=variant.num_locks,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )


def _kernel(e, c, bias, rows: RowLayout, softcap, variant, tile_list: bool, dc_window: bool, c_local: bool):
    """The tile kernel for these arguments (``c``: what the kernel reads, C or a converted window)."""
    return load_kernel(variant, flags(e, c, bias, softcap, variant.block_d, rows, tile_list=tile_list,
                                      dc_window=dc_window, c_local=c_local))


def _windowed(e, c, bias, rows: RowLayout, target_pos, targets, lse, coef_s, coef_t, coef_out, perm, softcap, filter_eps,
              variant, plan, tile_map, live, columns, dc_dtype=None) -> tuple:
    """The tile kernel over the live tiles, one vocabulary window of ``plan.window_v`` walked
    positions at a time, so that the fp32 dC scratch is window x D instead of V x D: each window's
    dC rows are rounded into dC once its tiles are done. dE keeps its fp32 scratch (n x D).
    ``columns``: the live tiles of each tile column (host ints), which size each window's launch."""
    D = e.shape[-1]
    V = c.shape[0]
    dev = e.device
    W = plan.window_v
    T = live.shape[1]
    per = W // variant.block_v
    de32 = torch.zeros(e.shape, dtype=torch.float32, device=dev)
    dc = torch.zeros(c.shape, dtype=dc_dtype or c.dtype, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    tiles = tile_ids(live, variant.group_b, count=sum(columns))
    window = (tiles % T) // per
    tiles = tiles[torch.argsort(window, stable=True)]
    counts = [sum(columns[k:k + per]) for k in range(0, T, per)]
    scratch = torch.empty((W, D), dtype=torch.float32, device=dev)
    # A classifier wider than e: each window's rows converted to e's dtype once (see lse_forward).
    c_buf = torch.empty((W, D), dtype=e.dtype, device=dev) if c.dtype != e.dtype else None
    # Made once, not per window (launches dominate a window's host time): the walked order's int64
    # indices, and the kernel's lock placeholder (fp32 accumulation takes no locks).
    cols = perm.long()
    no_locks = torch.zeros(1, dtype=torch.int32, device=dev)
    kernel = _kernel(e, c if c_buf is None else c_buf, bias, rows, softcap, variant, True, True, c_buf is not None)
    first = 0
    for k, count in enumerate(counts):
        if count == 0:
            continue  # no live tile: dC rows of the window stay zero (target terms come later)
        lo = k * W
        w = min(W, V - lo)
        scratch.zero_()
        window = convert_rows(c, lo, w, perm, c_buf) if c_buf is not None else None
        _launch(e, c, bias, rows, target_pos, lse, coef_s, coef_t, perm, softcap, 0.0, variant,  # (as in run)
                tiles[first:first + count], de32, scratch, dbias, dc_lo=lo, c_window=window, unused_locks=no_locks,
                kernel=kernel)
        first += count
        dc.index_copy_(0, cols[lo:lo + w], scratch[:w].to(dc.dtype))
    add_target_terms(c, e.reshape(-1, D), rows, targets, coef_out, tile_map.zt, softcap, de32.view(-1, D), dc, dbias)
    if dbias is not None:
        dbias = dbias.to(bias.dtype)
    return de32.to(e.dtype), dc, dbias


STRATEGY = Tiles()

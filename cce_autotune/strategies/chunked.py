"""The chunked strategy: per vocabulary chunk (and group of rows), a kernel writes the gradient block
g of the rows to a small buffer (dead tiles as zeros, without recomputing them) and cuBLAS forms
dC[chunk] = g^T E and dE += g C[chunk]; chunks without a live tile are skipped. With a plan's
``tile_products`` (launched from the map, rows dense), two Triton kernels form those products over
the live (row block, tile) pairs of g only, from lists built on the device: where few of a chunk's
tiles are live, they skip what cuBLAS would multiply as zeros.

Cost: ``recompute`` x live tiles + (``products`` + the buffers' traffic) x live chunks (with tile
products, ``tile_products`` x live tiles + the traffic x live chunks), or the host's time to launch
the blocks where that is longer (without a map, the part that outlasts the forward's device time:
the host launches the chunks while the device runs the forward). Memory: the g block (rows x
chunk_v), the gathered C and dC rows of a chunk in a sorted order, and an fp32 dE (4·n·D). Where the
g block of every row does not fit beside it, rows go in groups (``row_group`` rows per block of g;
dC[chunk] summed over the groups in an fp32 (chunk_v x D) buffer, one rounding): dE stays fp32 at
any number of tokens. Only when not even that fits is dE accumulated in its own dtype (fp32 inside
cuBLAS, one rounding per live chunk). No float atomics: the deterministic strategy, and the one that
takes the dead-tile correction.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .. import replay
from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import load_kernel, load_utility
from ..launch import cdiv, next_power_of_2
from ..plans import CallProblem, Option
from .base import Coefficient, PlanContext, Strategy, mm_ms, tile_shape
from .common import (
    BackwardArgs,
    RowLayout,
    add_matmul,
    add_matmul_fp32,
    add_target_terms,
    convert_rows,
    flags,
    mm_out,
    softcap_arg,
    tma_descriptors,
)

__all__ = ["Chunked", "STRATEGY", "shape", "extra_bytes", "cost", "chunk_grid", "listed_tiles", "live_lists"]

LIST_BYTES = 16  # per tile of the live grid: two int32 lists and their counts (at most an int32 each a tile)
PRODUCT_K = 64  # the tile products' step along the summed dimension (at most a tile's side)


# -- formulas -------------------------------------------------------------------------------------
def extra_bytes(p: CallProblem, chunk_v: int, de_fp32: bool, use_map: bool, row_group: int = 0,
                list_tiles: int = 0) -> int:
    """The chunked strategy's peak extra memory (see the module docstring); ``list_tiles``: with tile
    products, the tiles of the live grid, whose lists they build (they read C's rows and write dC's
    in the walked order where they lie: nothing gathered)."""
    w = min(chunk_v, p.V)
    grouped = 0 < row_group < p.n
    g_rows = -(-row_group * p.n_all // max(1, p.n)) if grouped else p.n_all  # a group's rows of E
    b = p.elem * g_rows * w  # the g block
    if grouped:
        b += 4 * w * p.D  # dC[chunk] summed over the groups in fp32
    if de_fp32:
        b += 4 * p.n_all * p.D
    if p.sorted_vocab and not list_tiles:
        b += 2 * p.elem * w * p.D + 8 * p.V  # C[chunk] gathered, dC[chunk] before its scatter; the order, int64
    elif p.sorted_vocab and grouped:
        # (tile products read C and write dC through the order) the summed dC[chunk] cast; the order, int64
        b += p.elem * w * p.D + 8 * p.V
    if not p.e_view:
        b += p.elem * p.n_all * p.D  # E copied into a matrix
    if not use_map:
        return b
    b += 24 * p.n  # target terms outside the launched tiles: the targets sorted, their order and runs (with a map)
    b += LIST_BYTES * list_tiles  # the tile products' live lists
    # The map stays alive; the transient comparison that turns it into the live grid is freed
    # before these buffers are allocated, so the peak is the larger of the two.
    return p.map_bytes + max(b, p.map_bytes)


def shape(p: CallProblem, block_v: int, chunk_v: int, budget: int | None, exact: bool, costs) -> tuple[int, bool, int]:
    """(chunk_v, de_fp32, row_group) of the chunked strategy under ``budget`` (with cuBLAS's products:
    the tile products, where the plan takes them, run in the same shape).

    dE is accumulated in fp32 whenever any shape fits: all rows in one g block, or the power-of-two
    row groups of at least the cost model's ``row_group_min`` rows, each with its widest chunk that
    fits (at least 256 columns; a mapped plan's the variant's ``chunk_v`` halved, an exact plan's any
    multiple of 256 columns); of those, the cheapest by :func:`cost` (fewer, wider blocks move less
    memory and launch less).  Only when none
    fits is dE accumulated in its own dtype (the widest chunk that fits, halving down to 256
    columns; 1024 when none fits).  Exact gradients always keep the fp32 dE (their accuracy
    promise), and are not narrowed to the variant's ``chunk_v`` (tuned for the mapped backward: an
    exact one computes every tile, with the forward's tiling). ``row_group`` is 0 when all rows go in
    one block."""
    return _shape(p, block_v, chunk_v, budget, exact, costs)


@lru_cache(maxsize=256)  # pure, and asked for several times per call (decide, each plan, the exact cost)
def _shape(p: CallProblem, block_v: int, chunk_v: int, budget: int | None, exact: bool, costs) -> tuple[int, bool, int]:
    whole = -(-p.V // block_v) * block_v
    # (exact: from the power of two at or above the whole vocabulary down)
    top = max(block_v, 1 << (whole - 1).bit_length() if exact else min(chunk_v, whole))
    floor = max(block_v, min(top, 1024))
    narrowest = max(block_v, 256)
    # Chunk widths, whole tiles (the live grid is read a tile at a time). A mapped plan's: the
    # variant's chunk_v halved (narrower chunks also skip more dead ones, which the tuner's chunk_v
    # weighs); an exact plan's, where every chunk is live: any multiple of 256 columns (whole tiles
    # of any tiling that may run it).
    ladder = []
    if not exact:
        w = top
        while w >= min(narrowest, top):
            ladder.append(w)
            if w // 2 < block_v:
                break
            w = w // 2 // block_v * block_v
    groups = [0]
    R = 1 << max(0, (p.n - 1).bit_length() - 1)  # the largest power of two below n
    while R >= costs.row_group_min:
        groups.append(R)
        R //= 2
    # The estimate falls as the chunks widen (fewer of them read and write dE's accumulator and
    # launch): each row group's widest chunk that fits; the wider first where estimates tie.
    shapes = []
    for R in groups:
        if exact:
            w = _widest(p, top, narrowest, budget, R)
        else:
            w = next((w for w in ladder if budget is None or extra_bytes(p, w, True, True, R) <= budget), None)
        if w is not None:
            shapes.append((w, R))
    best = None
    for w, R in sorted(shapes, key=lambda s: -s[0]):  # (stable: groups in order at one width)
        est = cost(p, costs, 1.0, 1.0, w, True, R, after_forward=exact)
        if best is None or est < best[0] - 1e-12:
            best = (est, w, R)
    if best is not None:
        return best[1], True, best[2]
    if exact:
        return floor, True, 0
    return next((w for w in ladder if budget is None or extra_bytes(p, w, False, True) <= budget), floor), False, 0


def _widest(p: CallProblem, top: int, step: int, budget: int | None, row_group: int) -> int | None:
    """The widest chunk of an exact chunked plan, ``top`` or a multiple of ``step`` below it, whose
    fp32-dE shape fits ``budget`` with ``row_group``; None when not even ``step`` columns do (the
    bytes grow with the width: a bisection)."""
    def fits(w):
        return budget is None or extra_bytes(p, w, True, False, row_group) <= budget
    if fits(top):
        return top
    lo, hi = 1, (top - 1) // step  # multiples of step below top
    if lo > hi or not fits(step):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def listed_tiles(p: CallProblem, variant, use_map: bool) -> int:
    """The tiles of the live grid whose lists the tile products would build; 0 where they cannot run.
    They run where the backward launches from the map (its live grid) and problem row i is row i of E
    (so a row block of the grid is a block of g's rows)."""
    return -(-p.n // variant.block_b) * -(-p.V // variant.block_v) if use_map and p.dense_rows else 0


def _padded_grid(live_grid, chunk_tiles: int, group_blocks: int) -> tuple:
    """``(padded, groups, blocks per group, chunks)``: the (row blocks, tiles) live grid padded with dead
    entries to whole chunks of ``chunk_tiles`` tiles and whole groups of ``group_blocks`` row blocks
    (0: one group of all rows)."""
    Rb, T = live_grid.shape
    K, G, rg = _padding(Rb, T, chunk_tiles, group_blocks)
    padded = torch.zeros((G * rg, K * chunk_tiles), dtype=torch.bool, device=live_grid.device)
    padded[:Rb, :T] = live_grid
    return padded, G, rg, K


def _padding(Rb: int, T: int, chunk_tiles: int, group_blocks: int) -> tuple:
    """``(chunks, groups, blocks per group)`` of a (Rb, T) live grid (see :func:`_padded_grid`)."""
    rg = group_blocks if 0 < group_blocks < Rb else max(1, Rb)
    return -(-T // chunk_tiles), -(-Rb // rg), rg


def live_lists(live_grid, chunk_tiles: int, group_blocks: int = 0) -> tuple:
    """The tile products' lists, on the device, from the (row blocks, tiles) live grid, for chunks of
    ``chunk_tiles`` tiles and groups of ``group_blocks`` row blocks (0: one group):

    - ``row_idx`` (row blocks, chunks x chunk_tiles) int32: per row block and chunk, the chunk's tiles
      (0 .. chunk_tiles - 1), the live ones first; ``row_cnt`` (row blocks, chunks): how many are live;
    - ``col_idx`` (groups, tiles, blocks per group) int32: per row group and tile, the group's row
      blocks (0 .. group_blocks - 1), the live ones first; ``col_cnt`` (groups, tiles): how many.

    Row blocks and tiles beyond the grid (the last chunk's and group's padding) are dead. Within each
    list the live entries and then the dead ones keep their order (a stable partition): two launches
    of ``templates/live_lists.py.j2``, one prefix sum per list, in place of sorts."""
    Rb, T = live_grid.shape
    cb = chunk_tiles
    K, G, rg = _padding(Rb, T, cb, group_blocks)
    dev = live_grid.device
    live = live_grid.contiguous().view(torch.uint8)
    row_idx = torch.empty((G * rg, K * cb), dtype=torch.int32, device=dev)
    row_cnt = torch.empty((G * rg, K), dtype=torch.int32, device=dev)
    col_idx = torch.empty((G, K * cb, rg), dtype=torch.int32, device=dev)
    col_cnt = torch.empty((G, K * cb), dtype=torch.int32, device=dev)
    rows = load_utility("live_lists.py.j2", "cce_live_rows_kernel")
    rows[(G * rg, K)](live, row_idx, row_cnt, Rb, T, K, cb, live.stride(0), BLOCK_T=next_power_of_2(cb),
                      num_warps=4)
    block_t = max(1, min(64, 4096 // next_power_of_2(rg)))  # (a block of at most 4096 flags)
    cols = load_utility("live_lists.py.j2", "cce_live_cols_kernel")
    cols[(G, cdiv(K * cb, block_t))](live, col_idx, col_cnt, Rb, T, K * cb, rg, live.stride(0),
                                     BLOCK_R=next_power_of_2(rg), BLOCK_T=block_t, num_warps=4)
    return row_idx, row_cnt, col_idx, col_cnt


def chunk_grid(live_grid, chunk_v: int, block_v: int, group_blocks: int = 0):
    """(chunks, row groups) bool: which (vocabulary chunk, row group) blocks of the chunked strategy
    hold a live tile, from the (row blocks, tiles) live grid; ``group_blocks`` row blocks per group
    (0: one group of all rows)."""
    cb = chunk_v // block_v
    padded, G, rg, K = _padded_grid(live_grid, cb, group_blocks)
    return padded.view(G, rg, K, cb).any(dim=3).any(dim=1).T


def cost(p: CallProblem, costs, live: float, live_chunks: float, chunk_v: int, de_fp32: bool,
         row_group: int = 0, tile_products: bool = False, after_forward: bool = True, tile_factor: float = 1.0,
         launched: float | None = None) -> float:
    """The chunked strategy's estimate: recompute of the live tiles, and per live chunk the two
    products plus the traffic of the g block (written, read twice), of dE (read, written) and, with
    row groups, of the fp32 dC[chunk] they sum into (read, written per group) - or the host's time to
    launch the (chunk, row group) blocks, where that is longer. ``live_chunks``: the share of those
    blocks that hold a live tile. ``tile_products``: the products are formed over the live tiles
    only (``tile_products`` per unit of live-tile share, in place of ``products`` per live chunk).
    ``after_forward``: the host launches the chunks while the device still runs the forward (nothing
    is read back between them: a plan without a map, or one planned on the previous call's shares),
    so only the host time that outlasts the forward's counts. ``tile_factor``: the live tiles' cost
    relative to the calibration's tiles (:func:`~.base.tile_shape`), for the terms paid per live tile.
    ``launched``: the share of the blocks the host launches, where it is not ``live_chunks`` (1: it
    has no list of the live ones and launches every block, whose programs find the dead tiles on
    the device)."""
    grouped = 0 < row_group < p.n
    traffic = (1.5 * p.elem * costs.flops_per_byte / p.D + (4 if de_fp32 else 2) * costs.flops_per_byte / max(1, chunk_v)
               + (4 * costs.flops_per_byte / row_group if grouped else 0.0))
    products = costs.tile_products * tile_factor * live if tile_products else costs.products * live_chunks
    device = costs.recompute * tile_factor * live + products + live_chunks * traffic
    n_chunks = -(-p.V // max(1, chunk_v))
    n_groups = -(-p.n // row_group) if grouped else 1
    # (tile products read C's rows and write dC's through the order: only a sum over groups scatters)
    gather = costs.gather_chunk_ms if p.sorted_vocab and (grouped or not tile_products) else 0.0
    per_chunk = costs.tile_chunk_ms if tile_products else costs.chunk_ms  # (and row group)
    launches = live_chunks if launched is None else launched
    host = launches * n_chunks * (per_chunk * n_groups + gather) / mm_ms(p, costs)
    return max(device, host - costs.forward if after_forward else host)


# -- the strategy ----------------------------------------------------------------------------------
class Chunked(Strategy):
    name = "chunked"
    template = "backward_chunked.py.j2"
    kernel_function = "cce_grad_chunk_kernel"
    knobs = ("chunk_v", "out_block_d")
    deterministic = True
    takes_correction = True
    forward_tiles = True
    coefficients = (
        Coefficient("recompute", 1.25, "the gradient kernel, per unit of live-tile share", fitted=True),
        Coefficient("products", 2.0, "its two cuBLAS products, per unit of live-chunk share", fitted=True),
        Coefficient("tile_products", 4.1, "the same two products formed by live tile (Triton kernels), per unit "
                    "of live-tile share", fitted=True),
        Coefficient("chunk_ms", 0.19, "host time per chunk with cuBLAS's products (a kernel launch, two cuBLAS "
                    "calls)"),
        Coefficient("tile_chunk_ms", 0.075, "host time per chunk with products by live tile (two Triton launches "
                    "through a launch series)"),
        Coefficient("gather_chunk_ms", 0.1, "and more per chunk in a sorted order (C and dC rows gathered)"),
        Coefficient("row_group_min", 1024, "fewest rows per group: fewer starve cuBLAS's dC product (a power of two, "
                    "a multiple of block_b)", integer=True),
    )
    space_rules = (
        ("chunk_buffer", "B * chunk_v * elem_bytes <= 64 * 2**20",
         "an explicitly chunked strategy's gradient buffer (B x chunk_v) stays within 64 MiB (under auto, chunk_v "
         "is an upper bound that the planner narrows to fit the memory budget)"),
    )
    # (shifted rows are not dense, so the products by live tile cannot run: cuBLAS's products per
    # live chunk, whose coefficient no other run separates from the recompute's)
    calibration = (("chunked", False), ("chunked_exact", True), ("chunked_shifted", False, True))

    def option(self, ctx: PlanContext) -> Option:
        p, v, costs = ctx.problem, ctx.variant, ctx.costs
        n_lists = listed_tiles(p, v, ctx.use_map)  # (an exact plan has no map)
        w, de_fp32, rg = shape(p, v.block_v, v.chunk_v, ctx.budget, ctx.exact, costs)
        # (a mapped plan runs the variant's tiles; an exact one the forward's, as the calibration's exact run)
        shp = tile_shape(costs, v.block_b, v.block_v) if ctx.use_map else 1.0
        # Nothing read back between the forward and the backward (no map, or the host without the
        # list of live chunks): the host launches the chunks while the device still runs the forward.
        after_forward = not (ctx.use_map and ctx.listed)
        # (cuBLAS's products without the host's list: every chunk launched and formed, as the run does)
        est = cost(p, costs, ctx.live, ctx.live_blocks if ctx.listed else 1.0, w, de_fp32, rg,
                   after_forward=after_forward, tile_factor=shp)
        mem = extra_bytes(p, w, de_fp32, ctx.use_map, rg)
        sizes = dict(chunk_v=w, row_group=rg, de_fp32=de_fp32, live_chunks=ctx.live_blocks if ctx.use_map else None)
        if n_lists:
            # The products over the live tiles only, where they cost less than cuBLAS's over whole chunks.
            # (without the host's list every chunk is launched; its programs find the dead tiles)
            est_t = cost(p, costs, ctx.live, ctx.live_blocks, w, de_fp32, rg, tile_products=True,
                         after_forward=after_forward, tile_factor=shp, launched=None if ctx.listed else 1.0)
            mem_t = extra_bytes(p, w, de_fp32, True, rg, n_lists)
            fits = ctx.budget is None or mem_t <= ctx.budget
            if fits and (est_t < est or (ctx.budget is not None and mem > ctx.budget)):
                est, mem, sizes = est_t, mem_t, {**sizes, "tile_products": True}
        return Option(ctx.fixed + est, mem, use_map=ctx.use_map, sizes=sizes)

    def blocks(self, live, ctx: PlanContext):
        v = ctx.variant
        w, _, rg = shape(ctx.problem, v.block_v, v.chunk_v, ctx.budget, ctx.exact, ctx.costs)
        return chunk_grid(live, w, v.block_v, rg // v.block_b).reshape(-1)  # chunk-major, as run() walks

    def block_share(self, live: float, ctx: PlanContext) -> float:
        # A chunk holds a live tile when any row block has one there.
        v = ctx.variant
        w, _, rg = shape(ctx.problem, v.block_v, v.chunk_v, ctx.budget, False, ctx.costs)
        per_chunk = max(1, w // v.block_v) * -(-(rg or ctx.problem.n) // v.block_b)
        return 1.0 - (1.0 - live) ** per_chunk

    def unlisted(self, plan) -> bool:
        # With tile products, a chunk without a live tile costs two launches whose programs find
        # nothing live (dC's write the chunk's zeros).
        return plan.tile_products

    def run(self, args: BackwardArgs, plan) -> tuple:
        """For each vocabulary chunk of ``plan.chunk_v`` columns, and each group of ``plan.row_group``
        rows (all rows when 0), that holds a live tile (every block without a map), a kernel writes
        the gradient block g of the group's rows (dead tiles as zeros, not recomputed) to a buffer that
        lines up with the rows of E, and cuBLAS forms dE += g C[chunk], accumulated in fp32 when
        ``plan.de_fp32`` and else in dE itself (fp32 inside cuBLAS, one rounding per live chunk), and
        dC[chunk] = g^T E (one rounding; with row groups summed over the groups in an fp32 buffer
        first). ``args.blocks[k * groups + j]``: whether chunk k holds a live tile in row group j. No
        atomics (but the live mass of the dead-tile correction); no V x D scratch. With
        ``plan.tile_products`` the two products go over the live (row block, tile) pairs of the group
        only (:func:`live_lists`; dense rows: row block b of the grid is a block of g's rows).

        With ``args.correction`` (the dead-tile correction's direction), the kernel sums each row's
        softmax mass in the tiles it computes, and row i's dE gains ``coef_s[i] * (1 - that mass) *
        direction``: the skipped tiles' softmax terms taken along one direction."""
        e, c, bias, rows, variant = args.e, args.c, args.bias, args.rows, args.variant
        target_pos, targets, lse, coef_s, coef_t = args.target_pos, args.targets, args.lse, args.coef_s, args.coef_t
        coef_out, perm, softcap, dc_dtype = args.coef_out, args.perm, args.softcap, args.dc_dtype
        tile_map, live, chunks, dead_dir = args.tile_map, args.live, args.blocks, args.correction
        deterministic = args.deterministic
        n, D = rows.n, e.shape[-1]
        V = c.shape[0]
        dev = e.device
        e2 = e.reshape(-1, D)  # a view unless e's strides forbid it (the planner counts the copy)
        N = e2.shape[0]
        de = (torch.empty if plan.de_fp32 else torch.zeros)(e.shape, dtype=e.dtype, device=dev)  # (fp32: copied at the end)
        de2 = de.view(N, D)
        acc = torch.zeros((N, D), dtype=torch.float32, device=dev) if plan.de_fp32 else de2
        # Every chunk is written unless a map skips it (or no row takes part): then it stays zero, set
        # once here rather than one scatter (and a host-to-device copy) per skipped chunk. With tile
        # products in one row group, dC's kernel writes the skipped chunks' zeros instead (one launch for
        # all of them, after the loop, that reads nothing: a fill of all of dC moves 1.1 GiB at Gemma 2's
        # head; a launch per skipped chunk cost the host more than the device's work, stop 57).
        groups = _row_groups(e, rows, plan.row_group, variant.block_b, N)
        zeros_by_kernel = plan.tile_products and n > 0 and len(groups) == 1
        skips = (chunks is not None or n == 0) and not zeros_by_kernel
        dc = (torch.zeros if skips else torch.empty)(c.shape, dtype=dc_dtype or c.dtype, device=dev)
        dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
        # Deterministic: the kernel's float atomics into dbias go to a scratch that is dropped; dbias is
        # summed from each chunk's g instead.
        dbias_k = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None and deterministic else dbias
        W = min(plan.chunk_v or variant.chunk_v, V)
        if n > 0:
            use_live = live is not None
            # A classifier wider than e: each chunk's rows converted to e's dtype once (see lse_forward),
            # read by the kernel and by cuBLAS.
            c_buf = torch.empty((W, D), dtype=e.dtype, device=dev) if c.dtype != e.dtype else None
            mass = torch.zeros(n, dtype=torch.float32, device=dev) if dead_dir is not None else None
            # E (each group's rows) and C (or the chunk buffer) as TMA descriptors where the layout allows
            # them (see tma_descriptors): the same C every chunk, whose rows are walked by position in
            # the natural order or as the converted chunk. One kernel serves every group.
            c_read = c if c_buf is None else c_buf
            by_position = perm is None or c_buf is not None
            descs = [tma_descriptors(grp.e, c_read, grp.n, rows.dense_stride, variant,
                                     c_by_position=by_position and j == 0)  # (C's once: every group reads it)
                     for j, grp in enumerate(groups)]
            e_descs = [d[0] for d in descs] if all(d[0] is not None for d in descs) else [None] * len(groups)
            c_desc = descs[0][1]
            # With tile products, g's dead tiles are never read (unless a deterministic dbias sums g's
            # columns): the kernel leaves them unwritten.
            unread = plan.tile_products and not (deterministic and dbias is not None)
            kernel_flags = flags(e, c_read, bias, softcap, variant.block_d, rows, tile_live=use_live,
                                 dead_unwritten=use_live and unread,
                                 c_local=c_buf is not None, live_mass=mass is not None,
                                 e_desc=e_descs[0] is not None, c_desc=c_desc is not None)
            # Rows of E that no problem row reads (shift, ignored rows) keep a zero gradient row in g.
            g_rows = max(grp.span for grp in groups)
            g_buf = (torch.zeros if n < N else torch.empty)((g_rows, W), dtype=e.dtype, device=dev)
            # Row groups: dC[chunk] summed over the groups in fp32, one rounding when written.
            dc_part = torch.empty((W, D), dtype=torch.float32, device=dev) if len(groups) > 1 else None
            # Each group's arguments of the gradient kernel but the chunk's (its rows of the per-row ones:
            # views), made once: the host's time per launch is this loop's price where many chunks are live.
            c_in = c_read if c_desc is None else c_desc  # (the chunk's rows convert into c_buf: its address)
            per_group = [(
                (gr.e if e_descs[j] is None else e_descs[j], c_in, bias if bias is not None else c, rows.offsets[gr.lo:],
                 gr.g_offsets, target_pos[gr.lo:], lse[gr.lo:], coef_s[gr.lo:], coef_t[gr.lo:],
                 perm if perm is not None else target_pos, live[gr.lo // variant.block_b:] if use_live else lse, g_buf,
                 dbias_k if dbias_k is not None else lse, gr.n, V, D, rows.stride, e.stride(-1), c_read.stride(0),
                 c_read.stride(1), g_buf.stride(0), softcap_arg(softcap)),
                () if mass is None else (mass[gr.lo:],)) for j, gr in enumerate(groups)]
            # ... and its rows of E, of the dE accumulator and of g, for the products.
            views = [(e2[gr.first : gr.first + gr.span], acc[gr.first : gr.first + gr.span], g_buf[: gr.span])
                     for gr in groups]
            loop = _Chunks(variant, kernel_flags, V, W, groups, chunks, per_group, views, g_buf, acc, c,
                           c_buf, perm, dc, dc_part, dbias, deterministic, zeros_by_kernel,
                           live if plan.tile_products else None, plan.row_group)
            if plan.tile_products:
                # (a loop of launches alone, two a chunk: replayed as a CUDA graph where replays are on and
                # its arguments were seen before; see cce_autotune.replay)
                replay.run(_run_chunks, loop)
            else:
                _run_chunks(loop)
        if coef_out is not None and n > 0:  # target terms of rows whose target tile is dead
            add_target_terms(c, e2, rows, targets, coef_out, tile_map.zt, softcap, acc, dc, dbias)
        if dead_dir is not None and n > 0:
            # The skipped tiles' softmax mass along the fitted direction (a row without a gradient has an
            # infinite LSE: no mass).
            dead = torch.where(torch.isfinite(lse), (1.0 - mass).clamp_min(0.0), 0.0) * coef_s
            acc.index_add_(0, rows.row_index(D), (dead[:, None] * dead_dir.to(device=dev, dtype=torch.float32)[None, :])
                           .to(acc.dtype))
        if plan.de_fp32:
            de2.copy_(acc)
        if dbias is not None:
            dbias = dbias.to(bias.dtype)
        return de, dc, dbias


@dataclass
class _Chunks:
    """Everything the chunk loop of :meth:`Chunked.run` launches from (the call's tensors, views of them,
    the gradient kernel's arguments of each row group, the sizes): a loop of this and nothing else,
    which :mod:`cce_autotune.replay` may capture and replay. ``tile_live``: the live grid, where the
    products go by live tile (else None: cuBLAS's)."""

    variant: Any
    kernel_flags: Any
    V: int
    W: int
    groups: list
    chunks: Any
    per_group: list
    views: list
    g_buf: Any
    acc: Any
    c: Any
    c_buf: Any
    perm: Any
    dc: Any
    dc_part: Any
    dbias: Any
    deterministic: bool
    zeros_by_kernel: bool
    tile_live: Any
    row_group: int


def _run_chunks(loop: _Chunks) -> None:
    """The chunk loop of :meth:`Chunked.run` (see there): per chunk and live row group, the gradient
    kernel into g, then dE's and dC's products (by live tile, or cuBLAS's)."""
    variant, V, W, groups, chunks = loop.variant, loop.V, loop.W, loop.groups, loop.chunks
    per_group, views, g_buf, acc, c = loop.per_group, loop.views, loop.g_buf, loop.acc, loop.c
    c_buf, perm, dc, dc_part, dbias = loop.c_buf, loop.perm, loop.dc, loop.dc_part, loop.dbias
    c_read = c if c_buf is None else c_buf
    constants = dict(BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
                     GROUP_B=variant.group_b, num_warps=variant.num_warps, num_stages=variant.num_stages)
    deterministic, zeros_by_kernel = loop.deterministic, loop.zeros_by_kernel
    D, dev = c.shape[1], c.device
    kernel = load_kernel(variant, loop.kernel_flags).series()  # (a launch per chunk: see launch.Series)
    # Products by live tile: the lists once a call, from the live grid (on the device).
    products = None if loop.tile_live is None else \
        _TileProducts(variant, loop.kernel_flags, loop.tile_live, W, loop.row_group, V)
    # In the order the forward walked, each chunk's rows of C are gathered for cuBLAS and its rows of
    # dC scattered back: the order's int64 indices are made once and the two buffers reused, so that
    # the gather and the scatter are one op each and nothing is allocated a chunk (a live chunk's host
    # time is this loop's price where the device's work per chunk is short).
    # (tile products read C's rows and write dC's through the order: nothing gathered, but a sum over
    # row groups, or a deterministic dbias, scattered)
    gathers = products is None or dc_part is not None or (deterministic and dbias is not None)
    order = perm.long() if perm is not None and gathers else None
    c_rows = torch.empty((W, D), dtype=c.dtype, device=dev) if order is not None and products is None \
        and c_buf is None else None
    dc_rows = torch.empty((W, D), dtype=dc.dtype, device=dev) if order is not None and products is None \
        and dc_part is None else None
    skipped = False
    for k in range(cdiv(V, W)):
        lo = k * W
        w = min(W, V - lo)
        todo = [j for j in range(len(groups)) if chunks is None or chunks[k * len(groups) + j]]
        if not todo:  # no live tile: every gradient of the chunk is negligible
            skipped = True
            continue
        chunk = convert_rows(c, lo, w, perm, c_buf) if c_buf is not None else None  # (into c_buf)
        c_arg = c if chunk is None else chunk
        cols = order[lo : lo + w] if order is not None else None
        c_k = None if products is not None else chunk if chunk is not None else \
            c[lo : lo + w] if cols is None else torch.index_select(c, 0, cols, out=c_rows[:w])
        if dc_part is not None and products is None:  # (the first group's tile products write it)
            dc_part[:w].zero_()
        for j in todo:
            grp = groups[j]
            grid = (cdiv(grp.n, variant.block_b) * cdiv(w, variant.block_v),)
            head, mass_g = per_group[j]
            kernel[grid](*head, lo, w, *mass_g, **constants)
            if grp.holes is not None:
                g_buf.index_fill_(0, grp.holes, 0)  # rows another group wrote, not this group's
            e_rows, acc_g, g = views[j]
            if w != W:
                g = g[:, :w]
            if products is not None:  # over the live tiles: dE += g C[chunk], dC[chunk] (+)= g^T E
                products.run(k, j, grp.n, lo, g, c_arg, perm, acc_g, e_rows,
                             dc if dc_part is None else dc_part, out_local=dc_part is not None,
                             accumulate=dc_part is not None and j != todo[0])
            else:
                add_matmul(acc_g, g, c_k)
                if dc_part is not None:
                    add_matmul_fp32(dc_part[:w], g.T, e_rows)
                elif cols is None:
                    mm_out(g.T, e_rows, dc[lo : lo + w])
                else:
                    mm_out(g.T, e_rows, dc_rows[:w])
                    dc.index_copy_(0, cols, dc_rows[:w])
            if deterministic and dbias is not None:
                part_b = g.sum(0, dtype=torch.float32)
                if cols is None:
                    dbias[lo : lo + w] += part_b
                else:
                    dbias[cols] += part_b
        if dc_part is not None:
            if cols is None:
                dc[lo : lo + w] = dc_part[:w]
            else:
                dc.index_copy_(0, cols, dc_part[:w].to(dc.dtype))
    if skipped and zeros_by_kernel:  # the skipped chunks' dC zeros, one launch for all of them
        products.zeros(groups[0].n, V, views[0][2], c_read, perm, acc, views[0][0], dc)


class _TileProducts:
    """The products of one call by live tile (see :func:`live_lists`): ``run`` launches, for chunk k
    and row group j, one kernel whose programs form dE's part (a program per row block and slice of D,
    over the block's live tiles of the chunk) and dC's (a program per tile and slice of D, over the
    tile's live row blocks of the group); ``zeros``, once after the loop, writes the dC zeros of every
    chunk the host skipped (one row group). Slices of ``variant.out_block_d`` columns of D, steps of
    :data:`PRODUCT_K` along the sum. The kernel and its lists are made at the first ``run``: after
    the first chunk's gradient kernel is launched, so that the device starts on it while the host
    builds them (after the backward's read-back, the device waits for the host's first launch)."""

    def __init__(self, variant, kernel_flags, live, chunk_w: int, row_group: int, V: int):
        bb, bv = variant.block_b, variant.block_v
        if chunk_w < V and chunk_w % bv:  # (the lists, and the zeros' launch, count a chunk's tiles from k x cb)
            raise ValueError(f"chunks of {chunk_w} columns are not whole tiles of {bv}")
        self.variant, self.kernel_flags, self.live = variant, kernel_flags, live
        self.kernel = None
        self.rg = row_group // bb if 0 < row_group < live.shape[0] * bb else live.shape[0]
        self.cb = -(-chunk_w // bv)  # tiles per chunk (whole tiles, or the one chunk of the vocabulary)
        self.K = -(-live.shape[1] // self.cb)  # chunks
        self.bb, self.bv, self.bdo = bb, bv, variant.out_block_d
        # (the probe's best on the H200 at 8192 x 4096: 4 warps and 4 stages for 128 columns of D)
        self.launch = dict(num_warps=4 if self.bdo <= 128 else 8, num_stages=4 if self.bdo <= 128 else 3)

    def run(self, k: int, j: int, n_rows: int, lo: int, g, c, perm, acc, e_rows, out, out_local: bool,
            accumulate: bool) -> None:
        """Chunk k (walked positions lo ..) and row group j (``n_rows`` rows): ``acc`` (the group's rows
        of the dE accumulator) += g C[chunk], ``out`` (dC, or with ``out_local`` the chunk's own
        rows) (+)= g^T E (``e_rows``: the group's rows); ``c``: the classifier as the gradient kernel
        reads it (or the chunk converted), ``perm``: the walked order (or None)."""
        self._launch(k, j, n_rows, lo, g.shape[1], g, c, perm, acc, e_rows, out, out_local, accumulate, False)

    def zeros(self, n_rows: int, V: int, g, c, perm, acc, e_rows, out) -> None:
        """One launch over every tile of the vocabulary (one row group): ``out`` (dC) gets the zeros of
        each tile without a live row block, which covers every chunk the host skipped; the other tiles
        are left to their chunks' launches (a chunk holds whole tiles, so tile t of chunk k is tile
        k x tiles per chunk + t of the vocabulary). Nothing of ``g`` is read."""
        self._launch(0, 0, n_rows, 0, V, g, c, perm, acc, e_rows, out, False, False, True)

    def _launch(self, k, j, n_rows, lo, w, g, c, perm, acc, e_rows, out, out_local, accumulate, zeros_only):
        # (zeros_only: dC's programs alone, n_de = 0)
        if self.kernel is None:
            self.kernel = load_kernel(self.variant, self.kernel_flags, name="cce_chunk_products_kernel").series()
            self.row_idx, self.row_cnt, self.col_idx, self.col_cnt = live_lists(self.live, self.cb, self.rg)
        D = e_rows.shape[1]
        n_d = cdiv(D, self.bdo)
        n_de = 0 if zeros_only else cdiv(n_rows, self.bb) * n_d
        first = j * self.rg  # the group's first row block
        tiles = self.K * self.cb
        self.kernel[(n_de + cdiv(w, self.bv) * n_d,)](
            g, c, e_rows, perm if perm is not None else self.row_cnt, self.row_idx, self.row_cnt, self.col_idx,
            self.col_cnt, acc, out, n_rows, lo, w, D,
            g.stride(0), c.stride(0), c.stride(1), acc.stride(0), e_rows.stride(0), e_rows.stride(1), out.stride(0),
            (first * self.K + k) * self.cb, first * self.K + k, self.K * self.cb, self.K,
            (j * tiles + k * self.cb) * self.rg, j * tiles + k * self.cb, self.rg, n_de,
            BLOCK_B=self.bb, BLOCK_V=self.bv, BLOCK_K_DE=min(PRODUCT_K, self.bv), BLOCK_K_DC=min(PRODUCT_K, self.bb),
            BLOCK_DO=self.bdo, OUT_LOCAL=out_local, ACCUMULATE=accumulate, ZEROS_ONLY=zeros_only, **self.launch)


@dataclass
class _RowGroup:
    """Problem rows lo .. lo + n of the chunked strategy's row group, whose rows of E lie in
    first .. first + span (the rows of g it writes); ``e``: E as the kernel addresses it for the
    group (dense rows: a view starting at its first row); ``g_offsets``: the dE offsets the kernel
    turns into g's rows (relative to ``first``); ``holes``: rows of g in the span that are not the
    group's (zeroed after each launch), or None."""

    lo: int
    n: int
    first: int
    span: int
    e: torch.Tensor
    g_offsets: torch.Tensor
    holes: torch.Tensor | None = None


def _row_groups(e, rows: RowLayout, row_group: int, block_b: int, N: int) -> list:
    """The chunked strategy's row groups: one of every row (g lines up with all of E) unless
    ``row_group`` asks for blocks of that many problem rows (a multiple of ``block_b``: the live
    grid's row blocks)."""
    n, D = rows.n, e.shape[-1]
    if not 0 < row_group < n:
        return [_RowGroup(0, n, 0, N, e, rows.de_offsets)]
    if row_group % block_b:
        raise ValueError(f"plan.row_group={row_group} must be a multiple of the variant's block_b={block_b}")
    bounds = list(range(0, n, row_group))
    idx = rows.row_index(D)
    if rows.dense_stride is not None:  # row i of the problem is row i of E
        firsts, lasts = bounds, [min(n, lo + row_group) - 1 for lo in bounds]
    else:
        ends = [min(n, lo + row_group) for lo in bounds]
        ext = torch.stack([torch.stack([idx[lo:hi].min(), idx[lo:hi].max()]) for lo, hi in zip(bounds, ends)])
        firsts, lasts = zip(*ext.tolist())  # one copy
    out = []
    for lo, first, last in zip(bounds, firsts, lasts):
        m = min(n, lo + row_group) - lo
        span = last - first + 1
        if rows.dense_stride is not None:
            s = rows.dense_stride
            ge = e.as_strided((m, D), (s, e.stride(-1)), e.storage_offset() + lo * s)
            out.append(_RowGroup(lo, m, first, span, ge, rows.de_offsets[lo:]))
            continue
        local = idx[lo : lo + m] - first
        holes = None
        if span > m:  # rows of E between the group's own: other groups' or nobody's
            keep = torch.ones(span, dtype=torch.bool, device=idx.device)
            keep[local] = False
            holes = keep.nonzero().view(-1)
        out.append(_RowGroup(lo, m, first, span, e, (local * D).contiguous(), holes))
    return out


STRATEGY = Chunked()

"""The sparse strategy (needs the tile map): a kernel writes the gradients of the live tiles only to a
compact buffer, then one kernel forms each row block's dE and one each vocabulary tile's dC from it
(plus the target terms), written once in the input dtype: no fp32 scratch, at the price of the buffer
(live tiles x block_b x block_v elements); ``out_block_d`` is the D width of those two passes.

Cost: ``sparse_per_live`` x the live share (x the tile's shape factor, :func:`~.base.tile_shape`).
"""

from __future__ import annotations

from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import load_kernel
from ..launch import cdiv
from ..plans import CallProblem, Option
from ..tile_map import tile_ids
from .base import Coefficient, PlanContext, Strategy, map_overhead, tile_shape
from .common import BackwardArgs, flags, softcap_arg, target_weight

__all__ = ["Sparse", "STRATEGY", "extra_bytes"]


def extra_bytes(p: CallProblem, block_b: int, block_v: int, n_live: int) -> int:
    """The compact buffer of the live tiles' gradients (and their ids), the map."""
    return n_live * (block_b * block_v * p.elem + 8) + map_overhead(p, True)


class Sparse(Strategy):
    name = "sparse"
    template = "backward_sparse.py.j2"
    kernel_function = "cce_sparse_grad_kernel"
    knobs = ("out_block_d",)
    needs_map = True
    coefficients = (
        Coefficient("sparse_per_live", 9.0, "per unit of live-tile share", fitted=True),
        Coefficient("sparse_smem", 200 * 1024, "shared memory the dE / dC passes may fill with pipeline stages (bytes)",
                    integer=True),
    )
    space_rules = (
        ("sparse_needs_the_map", "tile_map",
         "the sparse strategy launches from the tile map"),
    )
    calibration = (("sparse", False),)

    def option(self, ctx: PlanContext) -> Option | None:
        if not ctx.use_map:
            return None
        v = ctx.variant
        return Option(ctx.fixed + ctx.costs.sparse_per_live * tile_shape(ctx.costs, v.block_b, v.block_v) * ctx.live,
                      extra_bytes(ctx.problem, v.block_b, v.block_v, ctx.n_live), use_map=True)

    def run(self, args: BackwardArgs, plan) -> tuple:
        """The live tiles' gradients (softmax part) to a compact buffer, block k for live tile k in
        row-major order; then dE per row block and dC per vocabulary tile from it, each written once,
        with the onehot terms of rows whose target tile is not among them (``args.coef_out``)."""
        e, c, bias, rows, variant = args.e, args.c, args.bias, args.rows, args.variant
        target_pos, targets, lse, coef_s, coef_t = args.target_pos, args.targets, args.lse, args.coef_s, args.coef_t
        coef_out, perm, softcap, tile_map, dc_dtype = args.coef_out, args.perm, args.softcap, args.tile_map, args.dc_dtype
        count = sum(args.columns) if args.columns is not None else None  # (None: nonzero's own copy)
        tiles = tile_ids(args.live, 1, swizzle=False, count=count)
        n, D = rows.n, e.shape[-1]
        V = c.shape[0]
        dev = e.device
        BB, BV, BDO = variant.block_b, variant.block_v, variant.out_block_d
        R, T = cdiv(n, BB), cdiv(V, BV)
        ids = tiles.long()
        n_live = ids.numel()
        fl = flags(e, c, bias, softcap, variant.block_d, rows)
        # Phase 1: the live tiles' gradients (softmax part), block k of G for tile tiles[k].
        g_buf = torch.empty((max(n_live, 1), BB, BV), dtype=e.dtype, device=dev)
        dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
        if n_live:
            load_kernel(variant, fl)[(n_live,)](
                e, c, bias if bias is not None else c, rows.offsets, target_pos, lse, coef_s, coef_t, perm, tiles, g_buf,
                dbias if dbias is not None else lse,
                n, V, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), softcap_arg(softcap),
                BLOCK_B=BB, BLOCK_V=BV, BLOCK_D=variant.block_d,
                num_warps=variant.num_warps, num_stages=variant.num_stages,
            )
        # Row-major (CSR) and column-major (CSC) views of the live tiles, and the rows by target tile.
        # (counts by scatter_add_, not bincount: bincount reads the largest key back to size its output)
        def ptr(keys, size):
            counts = torch.zeros(size + 1, dtype=torch.int64, device=dev)
            counts.scatter_add_(0, keys + 1, torch.ones_like(keys))
            return counts.cumsum_(0).to(torch.int32)

        row_ptr = ptr(ids // T, R)
        col_ptr = ptr(ids % T, T)
        col_idx = torch.argsort((ids % T) * R + ids // T).to(torch.int32)
        w = target_weight(coef_out, tile_map.zt, softcap)
        tgt_tile = target_pos.long() // BV
        tgt_rows = torch.argsort(tgt_tile).to(torch.int32)
        tgt_ptr = ptr(tgt_tile, T)
        # Phase 2: dE per row block, dC per vocabulary tile, each written once.
        per_stage = (BB * BV + max(BB, BV) * BDO) * e.element_size()
        stages = max(1, min(variant.num_stages, args.costs.sparse_smem // per_stage))
        de = torch.zeros(e.shape, dtype=e.dtype, device=dev)
        dc = torch.empty(c.shape, dtype=dc_dtype or c.dtype, device=dev)
        n_d = cdiv(D, BDO)
        load_kernel(variant, fl, "cce_sparse_de_kernel")[(R, n_d)](
            c, perm, tiles, row_ptr, g_buf, targets, w, de, rows.de_offsets,
            n, V, D, c.stride(0), c.stride(1),
            BLOCK_B=BB, BLOCK_V=BV, BLOCK_DO=BDO, num_warps=variant.num_warps, num_stages=stages,
        )
        load_kernel(variant, fl, "cce_sparse_dc_kernel")[(T, n_d)](
            e, rows.offsets, perm, tiles, col_ptr, col_idx, g_buf, tgt_rows, tgt_ptr, target_pos, w, dc,
            n, V, D, rows.stride, e.stride(-1), dc.stride(0),
            BLOCK_B=BB, BLOCK_V=BV, BLOCK_DO=BDO, num_warps=variant.num_warps, num_stages=stages,
        )
        if dbias is not None:
            dbias.index_add_(0, targets, -w)
            dbias = dbias.to(bias.dtype)
        return de, dc, dbias


STRATEGY = Sparse()

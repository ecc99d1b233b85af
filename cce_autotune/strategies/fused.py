"""The fused strategy: the gradients computed during the forward, in blocks of rows. For each block a
kernel forms the logit tiles in registers (the GEMM of the LSE forward, TMA where it can) and writes
u = exp(z - m) (m the largest logit of the row in the tile, u <= 1, 16 bits where g is) into the
block's gradient buffer, with each tile's statistics; a second kernel takes each row's LSE from them
and a third rescales u into g = softmax * coef - onehot * coef in place; cuBLAS dE[block] = g C and
dC += g^T E[block]; the backward only scales them by the incoming gradient. No recompute (three
matmuls where the others need four when most tiles are live), at the price of the block's g (rows x V
in e's dtype). Blocks are as large as the budget allows: dC is read and written once per block, so
fewer blocks move less memory. dC sums over the blocks: straight into an fp32 dC (an fp32
classifier), else in an fp32 accumulator (V x D, 4 bytes each) where the plan says so, else in dC's
own dtype with one rounding per block (over as many blocks as the call's accuracy allows:
:data:`cce_autotune.planning.filters.SUMMED_DC_BLOCKS`, none for exact calls). For the "mean" and
"sum" reductions without the LSE's gradient (the planner takes it only then).
"""

from __future__ import annotations

from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import load_kernel
from ..plans import CallProblem, Option
from .base import FORWARD_TILE_V, Coefficient, PlanContext, Strategy, mm_ms
from .common import RowLayout, add_matmul, flags, mm_out, softcap_arg, tma_descriptors

__all__ = ["Fused", "STRATEGY", "extra_bytes", "cost", "block_rows", "PIECE"]

PIECE = 4096
"""The built-in ``fused_block_v``: columns a program of the rescaling kernel takes (4096: 0.073-0.075 ms
against 0.110 at 2048 for the rescaling of one block at Mistral's and Llama 3's heads on the H200)."""
LSE_STATS = 256
"""Tile statistics a program of the rescaling kernel reads at a time (for its row's LSE)."""


def extra_bytes(p: CallProblem, row_block: int, tile_v: int, dc_fp32: bool = False) -> int:
    """A block's g (in e's dtype) and its tiles' statistics (``tile_v`` columns a tile; rows not
    dense, its rows of E and of dE too); with ``dc_fp32``, dC's fp32 accumulator."""
    R = min(row_block, p.n)
    b = R * _row_bytes(p, tile_v)
    if dc_fp32:
        b += 4 * p.V * p.D
    return b + 4 * p.V  # (+ an fp32 dbias)


def _row_bytes(p: CallProblem, tile_v: int) -> int:
    """A block's bytes per row: g, two fp32 statistics a tile and, rows not dense, its row of E and
    of dE."""
    return p.elem * _aligned(p.V) + 8 * -(-p.V // tile_v) + (0 if p.dense_rows else 2 * p.D * p.elem)


def _aligned(V: int) -> int:
    """Elements between two rows of a block's g: V rounded up to a multiple of 16 (rows 32 bytes apart
    in 2-byte elements: cuBLAS's fast path; and a stride Triton specializes as divisible by 16, so that
    the kernels' loads and stores of g's rows are vectorized)."""
    return -(-V // 16) * 16


def cost(p: CallProblem, costs, row_block: int, dc_fp32: bool = False) -> float:
    """Forward and backward together: the three products (logits, dE, dC), slowed where a block of
    rows is too short for cuBLAS to reuse each row of C it reads; the traffic of the block's gradient
    (u written and read, g written and read twice); dC (or its fp32 accumulator) read and written
    once per block; the tails of each block's kernels - or the host's time to launch the blocks,
    where that is longer."""
    R = max(1, min(row_block, p.n))
    blocks = -(-p.n // R)
    reuse = max(1.0, costs.flops_per_byte / R)
    traffic = 5 * p.elem * costs.flops_per_byte / (2 * p.D)
    dc_traffic = (4 if dc_fp32 else p.dc_elem) * costs.flops_per_byte / R  # dC read and written once per block
    unit = mm_ms(p, costs)
    device = costs.fused_products * reuse + traffic + dc_traffic + blocks * costs.block_tail_ms / unit
    return max(device, blocks * costs.block_ms / unit)


def block_rows(p: CallProblem, budget: int | None, tile_v: int, dc_fp32: bool = False) -> int | None:
    """Rows per logit block of the fused strategy: all of them when they fit ``budget``, else the
    largest power of two (at least 16) whose block fits; None when not even 16 rows do. (A power of
    two: cuBLAS's tiles divide it. Blocks of 1376 rows measured 1-13 % slower than blocks of 1024.)"""
    if budget is None or extra_bytes(p, p.n, tile_v, dc_fp32) <= budget:
        return p.n
    most = (budget - extra_bytes(p, 0, tile_v, dc_fp32)) // _row_bytes(p, tile_v)
    if most < 16:
        return None
    return 1 << (int(most).bit_length() - 1)


class Fused(Strategy):
    name = "fused"
    template = "backward_fused.py.j2"
    kernel_function = "cce_fused_grad_kernel"
    in_forward = True
    deterministic = True
    forward_tiles = True
    coefficients = (
        Coefficient("fused_products", 2.8, "its three products (the logits kernel with the gradient's epilogue, "
                    "cuBLAS's dE and dC) and the LSE, per call", fitted=True),
        Coefficient("block_tail_ms", 0.034, "device time per block of rows beyond its products: the tails of its "
                    "kernels (fitted on the H200 over 2-32 blocks at six heads, with a kernel more than now: the LSE's)"),
        Coefficient("block_ms", 0.3, "host time per block of rows (two kernel launches, two cuBLAS products; "
                    "0.30-0.36 ms measured on the H200's host with three launches)"),
        Coefficient("fused_min_rows", 128, "fewest rows per block: below this cuBLAS reads C for each block of rows more "
                    "than it computes", integer=True),
        Coefficient("fused_block_v", PIECE, "columns per program of the rescaling kernel", integer=True,
                    power_of_two=(16, 65536)),
    )
    space_rules = (
        ("fused_without_filter_knobs", "filter_eps is not None and sort_vocab and not tile_map",
         "the fused strategy computes every tile in the forward; filter, sort and map knobs change nothing for it "
         "(pinned to the filtered default so that trials are not spent on identical kernels)"),
    )
    calibration = (("fused", False),)

    def option(self, ctx: PlanContext) -> None:
        return None  # (it runs in the forward: see forward_option)

    def forward_option(self, p: CallProblem, costs, budget: int | None, forced: bool = False,
                       summed_blocks: int = 1, tile_v: int = FORWARD_TILE_V) -> Option | None:
        """The estimate of forward and backward together, with the most rows per block that fit
        ``budget`` (the logits in tiles ``tile_v`` columns wide). A 16-bit dC that takes more than
        one block sums in an fp32 accumulator where it fits beside a block, else in dC itself over at
        most ``summed_blocks`` blocks. None: nothing fits, or, unless ``forced``, blocks of fewer rows
        than the cost model's ``fused_min_rows``."""
        R = block_rows(p, budget, tile_v)
        acc = False
        if R is not None and R < p.n and p.dc_elem < 4:
            with_acc = block_rows(p, budget, tile_v, dc_fp32=True)
            if with_acc is not None and (with_acc >= min(p.n, costs.fused_min_rows) or forced):
                R, acc = with_acc, with_acc < p.n
            elif -(-p.n // R) > summed_blocks:
                R = None
        if R is None or (R < min(p.n, costs.fused_min_rows) and not forced):
            return None
        return Option(cost(p, costs, R, acc), extra_bytes(p, R, tile_v, acc), sizes=dict(row_block=R, dc_fp32=acc))

    def forward_cost(self, p: CallProblem, costs, plan) -> float:
        return cost(p, costs, plan.row_block, plan.dc_fp32)

    def run_forward(self, e, c, bias, rows: RowLayout, targets, coef, softcap, variant, plan, *,
                    dc_dtype: torch.dtype | None = None, block_v: int = PIECE):
        """The forward of a loss whose gradient with respect to row i's logits is ``softmax * coef[i]
        - onehot * coef[i]`` (times the softcap derivative): ``(lse, zt, dE, dC, dbias)`` (fp32 LSE
        and target logits of the rows taking part; dE, dC, dbias shaped and typed like e, c, bias;
        dbias None without a bias, dC in ``dc_dtype`` when given). Rows go in blocks of
        ``plan.row_block``, the logits in ``variant``'s tiles (block_b x block_v x block_d, warps,
        stages and swizzle: the planner gives the plan the forward's, tuned for this product, as
        ``plan.tiles``); each program of the rescaling kernel takes ``block_v`` columns."""
        row_block = plan.row_block
        n, D = rows.n, e.shape[-1]
        V = c.shape[0]
        dev = e.device
        e2 = e.reshape(-1, D)
        dense = rows.dense_stride is not None and e2.shape[0] == n
        row_idx = None if dense else rows.row_index(D)  # (gathered rows only: one division a call less)
        lse = torch.empty(n, dtype=torch.float32, device=dev)
        zt = torch.empty(n, dtype=torch.float32, device=dev)
        # (dense rows: every row of dE is written by a block's product; dC is written by the first
        # block's and summed into by the others': no fills)
        de = (torch.empty if dense else torch.zeros)(e.shape, dtype=e.dtype, device=dev)
        de2 = de.view(-1, D)
        dc = (torch.empty if n > 0 else torch.zeros)(c.shape, dtype=dc_dtype or c.dtype, device=dev)
        acc = torch.empty(c.shape, dtype=torch.float32, device=dev) if plan.dc_fp32 and dc.dtype != torch.float32 \
            else dc  # (dC's fp32 accumulator, when the plan has one)
        dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
        if n == 0:
            return lse, zt, de, dc, dbias.to(bias.dtype) if bias is not None else None
        R = max(1, min(row_block, n))
        tv = variant.block_v
        n_tiles = -(-V // tv)
        piece = max(block_v, tv)  # (a rescaling program's columns: whole tiles, both powers of two)
        # (rows of g a multiple of 16 elements apart (_aligned): at an odd V such as GPT-2's 50257, cuBLAS
        # takes a path several times slower for its products with g's rows at V elements apart, and the
        # kernels' accesses to g's rows are not vectorized. The columns past V are not the gradient's:
        # the kernels write them as zeros, which a product may read - the CPU's bf16 GEMM, times zero)
        g_rows = torch.empty((R, _aligned(V)), dtype=e.dtype, device=dev)
        g = g_rows[:, :V]
        u = g.view(torch.float16) if g.element_size() == 2 else g  # (u <= 1: fp16, finer than bf16)
        stats = torch.empty((2, R, n_tiles), dtype=torch.float32, device=dev)  # each tile's max, sum
        # E's rows of a block and C as TMA descriptors where the layout allows them (C's once)
        c_desc = tma_descriptors(e2, c, R, None, variant, c_by_position=True)[1]
        v = variant.replace(strategy=self.name)
        bias_arg = bias if bias is not None else g
        cut = V - V % 8 if V > 8 else V  # (see dC's rows and dE's product below)
        cap = softcap_arg(softcap)
        kernels = {}  # (by whether a block's E is read through a TMA descriptor: the one flag that can differ)
        # The loop's views made once, not per block (the host's time per block is this plan's price at
        # small heads): each block's rows of the per-row arguments, of E and of dE (dense rows), the
        # tiles' two statistics, C's two parts of dE's product, and g's pieces for a whole block.
        tgts, cfs, lses, zts = (x.split(R) for x in (targets, coef, lse, zt))
        e_blks, de_blks = (e2.split(R), de2.split(R)) if dense else (None, None)
        st_max, st_sum = stats.unbind(0)
        c_parts = (c[cut:], c[:cut])
        # (dC's rows cut at the same place: with an odd V rows, cuBLAS ran dC's product of a 512-row block on
        # an sm80 kernel at GPT-2's head, 131 us on the H200, against 95 us for the cut rows' sm90 one and a
        # GEMV for the last V % 8 rows)
        acc_parts = (acc[:cut], acc[cut:]) if cut < V else (acc,)
        whole = _products_operands(g, cut)
        for b, r0 in enumerate(range(0, n, R)):
            m = min(R, n - r0)
            e_blk = e_blks[b] if dense else e2[row_idx[r0:r0 + m]]
            e_desc = tma_descriptors(e_blk, c, m, e_blk.stride(0), variant, c_by_position=False)[0]
            if (e_desc is None) not in kernels:
                fl = flags(e, c, bias, softcap, variant.block_d, rows, e_desc=e_desc is not None, c_desc=c_desc is not None)
                kernels[e_desc is None] = tuple(load_kernel(v, fl, name=k).series() for k in (  # (see launch.Series)
                    "cce_fused_logits_kernel", "cce_fused_grad_kernel"))
            logits_kernel, grad_kernel = kernels[e_desc is None]
            tgt, lse_b, zt_b = tgts[b], lses[b], zts[b]
            logits_kernel[(-(-m // variant.block_b) * n_tiles,)](
                e_blk if e_desc is None else e_desc, c if c_desc is None else c_desc, bias_arg, tgt, u,
                st_max, st_sum, zt_b,
                m, V, D, e_blk.stride(0), e_blk.stride(1), c.stride(0), c.stride(1), u.stride(0), stats.stride(1), cap,
                BLOCK_B=variant.block_b, BLOCK_V=tv, BLOCK_D=variant.block_d, GROUP_B=variant.group_b,
                num_warps=variant.num_warps, num_stages=variant.num_stages,
            )
            grad_kernel[(m, -(-V // piece))](
                u, g, st_max, st_sum, tgt, cfs[b], lse_b, zt_b, n_tiles, g.stride(0), stats.stride(1), cap,
                TILE_V=tv, BLOCK_V=piece, BLOCK_S=LSE_STATS, num_warps=4,
            )
            g_blk, g_tail, g_head, g_t = whole if m == R else _products_operands(g[:m], cut)
            de_blk = de_blks[b] if dense else torch.empty((m, D), dtype=de.dtype, device=dev)
            if g_tail is not None:
                # (the sum over V in cuBLAS's fast path, which wants it a multiple of 8: the last
                # V % 8 columns first, the rest then added in cuBLAS's fp32, one rounding of dE)
                torch.mm(g_tail, c_parts[0], out=de_blk)
                de_blk.addmm_(g_head, c_parts[1])
            else:
                torch.mm(g_blk, c, out=de_blk)
            if not dense:
                de2[row_idx[r0:r0 + m]] = de_blk
            for acc_part, g_part in zip(acc_parts, g_t):
                if r0 > 0:  # (fp32 inside cuBLAS; in a 16-bit dC one rounding per block of rows)
                    add_matmul(acc_part, g_part, e_blk)
                else:
                    mm_out(g_part, e_blk, acc_part)  # (the first block writes dC: no fill)
            if dbias is not None:
                dbias += g_blk.sum(0, dtype=torch.float32)
        if acc is not dc:
            dc.copy_(acc)
        return lse, zt, de, dc, dbias.to(bias.dtype) if bias is not None else None


def _products_operands(g_blk, cut: int) -> tuple:
    """A block's g for cuBLAS's products: ``(g, its last V - cut columns, its first cut, g^T's parts)``
    (g^T's first cut rows, then the rest), the two parts of g None and g^T whole where the sums need no
    cut (V a multiple of 8, or at most 8 columns)."""
    V = g_blk.shape[1]
    if cut < V:
        tail, head = g_blk[:, cut:], g_blk[:, :cut]
        return g_blk, tail, head, (head.T, tail.T)
    return g_blk, None, None, (g_blk.T,)


STRATEGY = Fused()

"""The fused strategy: the gradients computed during the forward, in blocks of rows. For each chunk of
columns cuBLAS forms the block's fp32 logits in a scratch and a kernel turns them into u = exp(z - m)
(m the largest logit of each piece of the row, u <= 1, 16 bits where g is) in the block's gradient
buffer, with each piece's statistics; a second kernel takes each row's LSE from them and rescales u
into g = softmax * coef - onehot * coef in place; cuBLAS dE[block] = g C and dC += g^T E[block]; the
backward only scales them by the incoming gradient. No recompute (three matmuls where the others need
four when most tiles are live), at the price of the block's g (rows x V in e's dtype) and a chunk's
fp32 scratch. Blocks are as large as the budget allows: dC is read and written once per block, so
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
from .base import Coefficient, PlanContext, Strategy, mm_ms
from .common import RowLayout, add_matmul, flags, mm_out, softcap_arg

__all__ = ["Fused", "STRATEGY", "extra_bytes", "cost", "block_rows", "chunk_width", "pieces", "LOGIT_CHUNKS"]

LOGIT_CHUNKS = 8
"""Chunks of columns a block's logits are formed in: the fp32 scratch is an eighth of the logits'."""
PIECE = 4096
"""The built-in ``fused_block_v``: columns a program of the row kernels takes (4096: 0.073-0.075 ms
against 0.110 at 2048 for the rescaling of one block at Mistral's and Llama 3's heads on the H200)."""


def chunk_width(V: int) -> int:
    """Columns of a logit chunk: a multiple of 256 (whole cuBLAS tiles), about V / LOGIT_CHUNKS."""
    return min(V, 256 * -(-V // (256 * LOGIT_CHUNKS)))


def pieces(V: int, block_v: int = PIECE) -> tuple:
    """``(pieces per chunk, pieces per row)``: the row kernels' programs along a row, ``block_v``
    columns each, none across two chunks."""
    W = chunk_width(V)
    per_chunk = -(-W // block_v)
    return per_chunk, per_chunk * (V // W) + -(-(V % W) // block_v)


def extra_bytes(p: CallProblem, row_block: int, dc_fp32: bool = False, block_v: int = PIECE) -> int:
    """A block's g (in e's dtype), its fp32 logit chunk and its pieces' statistics (``block_v``
    columns a piece; rows not dense, its rows of E and of dE too); with ``dc_fp32``, dC's fp32
    accumulator."""
    R = min(row_block, p.n)
    b = R * _row_bytes(p, block_v)
    if dc_fp32:
        b += 4 * p.V * p.D
    return b + 4 * p.V


def _row_bytes(p: CallProblem, block_v: int) -> int:
    """A block's bytes per row: g, the fp32 logit chunk (16-bit g; an fp32 g holds its own logits),
    two fp32 statistics a piece and, rows not dense, its row of E and of dE."""
    return (p.elem * p.V + (4 * chunk_width(p.V) if p.elem < 4 else 0) + 8 * pieces(p.V, block_v)[1]
            + (0 if p.dense_rows else 2 * p.D * p.elem))


def cost(p: CallProblem, costs, row_block: int, dc_fp32: bool = False) -> float:
    """Forward and backward together: three products (logits, dE, dC), slowed where a block of rows
    is too short for cuBLAS to reuse each row of C it reads; the logits' traffic (fp32 logits written
    and read, u written and read, g written and read twice); dC (or its fp32 accumulator) read and
    written once per block."""
    R = max(1, min(row_block, p.n))
    reuse = max(1.0, costs.flops_per_byte / R)
    traffic = (8 + 5 * p.elem) * costs.flops_per_byte / (2 * p.D)
    dc_traffic = (4 if dc_fp32 else p.dc_elem) * costs.flops_per_byte / R  # dC read and written once per block
    host = costs.block_ms * -(-p.n // R) / mm_ms(p, costs)
    return max(1.5 * costs.products * reuse + traffic + dc_traffic, host)


def block_rows(p: CallProblem, budget: int | None, dc_fp32: bool = False, block_v: int = PIECE) -> int | None:
    """Rows per logit block of the fused strategy: all of them when they fit ``budget``, else the
    largest power of two (at least 16) whose block fits; None when not even 16 rows do. (A power of
    two: cuBLAS's tiles divide it. Blocks of 1376 rows measured 1-13 % slower than blocks of 1024.)"""
    if budget is None or extra_bytes(p, p.n, dc_fp32, block_v) <= budget:
        return p.n
    most = (budget - extra_bytes(p, 0, dc_fp32, block_v)) // _row_bytes(p, block_v)
    if most < 16:
        return None
    return 1 << (int(most).bit_length() - 1)


class Fused(Strategy):
    name = "fused"
    template = "backward_fused.py.j2"
    kernel_function = "cce_fused_grad_kernel"
    in_forward = True
    deterministic = True
    coefficients = (
        Coefficient("block_ms", 0.5, "host time per block of rows (its logits' chunks: two launches each, then three "
                    "more; 0.45-0.55 ms measured on the H200's host)"),
        Coefficient("fused_min_rows", 128, "fewest rows per block: below this cuBLAS reads C for each block of rows more "
                    "than it computes", integer=True),
        Coefficient("fused_block_v", PIECE, "columns per program of the row kernels", integer=True,
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
                       summed_blocks: int = 1) -> Option | None:
        """The estimate of forward and backward together, with the most rows per block that fit
        ``budget``. A 16-bit dC that takes more than one block sums in an fp32 accumulator where it
        fits beside a block, else in dC itself over at most ``summed_blocks`` blocks. None: nothing
        fits, or, unless ``forced``, blocks of fewer rows than the cost model's ``fused_min_rows``."""
        bv = costs.fused_block_v
        R = block_rows(p, budget, block_v=bv)
        acc = False
        if R is not None and R < p.n and p.dc_elem < 4:
            with_acc = block_rows(p, budget, dc_fp32=True, block_v=bv)
            if with_acc is not None and (with_acc >= min(p.n, costs.fused_min_rows) or forced):
                R, acc = with_acc, with_acc < p.n
            elif -(-p.n // R) > summed_blocks:
                R = None
        if R is None or (R < min(p.n, costs.fused_min_rows) and not forced):
            return None
        return Option(cost(p, costs, R, acc), extra_bytes(p, R, acc, bv), sizes=dict(row_block=R, dc_fp32=acc))

    def forward_cost(self, p: CallProblem, costs, plan) -> float:
        return cost(p, costs, plan.row_block, plan.dc_fp32)

    def run_forward(self, e, c, bias, rows: RowLayout, targets, coef, softcap, variant, plan, *,
                    dc_dtype: torch.dtype | None = None, block_v: int = PIECE):
        """The forward of a loss whose gradient with respect to row i's logits is ``softmax * coef[i]
        - onehot * coef[i]`` (times the softcap derivative): ``(lse, zt, dE, dC, dbias)`` (fp32 LSE
        and target logits of the rows taking part; dE, dC, dbias shaped and typed like e, c, bias;
        dbias None without a bias, dC in ``dc_dtype`` when given). Rows go in blocks of
        ``plan.row_block``, the logits in chunks of :func:`chunk_width` columns; each program of the
        row kernels takes ``block_v`` columns."""
        row_block = plan.row_block
        n, D = rows.n, e.shape[-1]
        V = c.shape[0]
        dev = e.device
        e2 = e.reshape(-1, D)
        dense = rows.dense_stride is not None and e2.shape[0] == n
        row_idx = rows.row_index(D)
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
        W = chunk_width(V)
        per_chunk, n_pieces = pieces(V, block_v)
        g = torch.empty((R, V), dtype=e.dtype, device=dev)
        # one chunk's fp32 logits: a scratch beside a 16-bit g; an fp32 g takes them in place
        z = torch.empty(R * W, dtype=torch.float32, device=dev) if g.element_size() < 4 else None
        u = g.view(torch.float16) if g.element_size() == 2 else g  # (u <= 1: fp16, finer than bf16)
        stats = torch.empty((2, R, n_pieces), dtype=torch.float32, device=dev)  # each piece's max, sum
        fl = flags(e, c, bias, softcap, variant.block_d, rows)
        v = variant.replace(strategy=self.name)
        chunk_kernel = load_kernel(v, fl, name="cce_fused_chunk_kernel")
        grad_kernel = load_kernel(v, fl)
        bias_arg = bias if bias is not None else g
        cap = softcap_arg(softcap)
        for r0 in range(0, n, R):
            r1 = min(n, r0 + R)
            m = r1 - r0
            e_blk = e2[r0:r1] if dense else e2[row_idx[r0:r1]]
            tgt, cf = targets[r0:r1], coef[r0:r1]
            for c0 in range(0, V, W):
                w = min(W, V - c0)
                zc = z[:m * w].view(m, w) if z is not None else g[:m, c0:c0 + w]
                mm_out(e_blk, c[c0:c0 + w].T, zc)
                chunk_kernel[(m, -(-w // block_v))](
                    zc, bias_arg, tgt, u, stats[0], stats[1], zt[r0:r1],
                    c0, w, (c0 // W) * per_chunk, zc.stride(0), u.stride(0), stats.stride(1), cap,
                    BLOCK_V=block_v, num_warps=8,
                )
            grad_kernel[(m, n_pieces)](
                u, g, stats[0], stats[1], tgt, cf, lse[r0:r1], zt[r0:r1],
                V, W, per_chunk, n_pieces, g.stride(0), stats.stride(1), cap,
                BLOCK_V=block_v, BLOCK_S=64, num_warps=4,
            )
            g_blk = g[:m]
            if dense:
                torch.mm(g_blk, c, out=de2[r0:r1])
            else:
                de2[row_idx[r0:r1]] = g_blk @ c
            if r0 > 0:
                add_matmul(acc, g_blk.T, e_blk)  # fp32 inside cuBLAS; in a 16-bit dC one rounding per block of rows
            else:
                mm_out(g_blk.T, e_blk, acc)  # (the first block writes dC: no fill)
            if dbias is not None:
                dbias += g_blk.sum(0, dtype=torch.float32)
        if acc is not dc:
            dc.copy_(acc)
        return lse, zt, de, dc, dbias.to(bias.dtype) if bias is not None else None


STRATEGY = Fused()

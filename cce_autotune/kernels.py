"""Launch wrappers: tensors in, tensors out, one function per kernel.

The kernels address the rows of E through a :class:`RowLayout`: either densely (row i at
``i * stride``) or through int64 element offsets of each row that takes part, so that ignored rows,
``shift`` and non-contiguous batch layouts cost no copy of E.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .codegen import Flags, interpreting, load_kernel
from .tile_map import TileMap, live_tiles
from .variant import BackwardVariant, IndexedDotVariant, LSEForwardVariant

__all__ = ["RowLayout", "indexed_dot", "lse_forward", "backward", "AUTO_CHUNKED_SHARE", "AUTO_WITH_MAP"]

# strategy="auto" with a tile map: above this share of live tiles the chunked strategy is used (on an
# H200 the tile kernel with every tile live costs about 8x a matmul, the chunked one about 3.6x).
AUTO_CHUNKED_SHARE = 0.4
# What strategy="auto" runs with a tile map below that share (on the H200 the tile kernel measured
# 8-27% faster than the sparse strategy, which needs half the memory; the tuner may pick either).
AUTO_WITH_MAP = "tiles"
# Shared memory the sparse strategy's dE / dC passes may fill with pipeline stages.
_SPARSE_SMEM = 200 * 1024


@dataclass
class RowLayout:
    """Where the rows taking part live.

    ``offsets``: element offset of each row in E's storage; ``de_offsets``: in a contiguous tensor
    shaped like E (where dE is accumulated); ``dense_stride``: set when row i is simply at
    ``i * dense_stride`` (and at ``i * D`` in dE), so no table is read; ``aligned``: every offset is
    a multiple of 8 elements and E's base is 16-byte aligned.
    """

    offsets: torch.Tensor
    de_offsets: torch.Tensor
    dense_stride: int | None = None
    aligned: bool = False

    @classmethod
    def dense(cls, n: int, D: int, device) -> "RowLayout":
        """Rows 0..n-1 of a contiguous (n, D) tensor."""
        offsets = torch.arange(n, device=device, dtype=torch.int64) * D
        return cls(offsets=offsets, de_offsets=offsets, dense_stride=D, aligned=D % 8 == 0)

    @property
    def n(self) -> int:
        return self.offsets.shape[0]

    @property
    def stride(self) -> int:
        return self.dense_stride if self.dense_stride is not None else 0

    def row_index(self, D: int) -> torch.Tensor:
        """Row of each row taking part in ``e.reshape(-1, D)`` (and in dE)."""
        return self.de_offsets // D

    def take(self, e: torch.Tensor) -> torch.Tensor:
        """The rows taking part as an (n, D) matrix: a view when they are dense, else a gather."""
        D = e.shape[-1]
        e2 = e.reshape(-1, D)
        return e2 if self.dense_stride is not None and e2.shape[0] == self.n else e2[self.row_index(D)]


def _flags(e: torch.Tensor, bias, softcap, block_d: int, rows: RowLayout, **extra) -> Flags:
    D = e.shape[-1]
    return Flags(
        has_bias=bias is not None,
        has_softcap=softcap is not None,
        even_d=D % block_d == 0,
        ieee_dot=e.dtype == torch.float32,
        interpret=interpreting(),
        dense_rows=rows.dense_stride is not None,
        rows_aligned=rows.aligned,
        **extra,
    )


def _softcap_arg(softcap) -> float:
    return float(softcap) if softcap is not None else 1.0


def indexed_dot(e, c, bias, rows: RowLayout, targets, softcap, variant: IndexedDotVariant) -> torch.Tensor:
    """z[i] = softcap(e_row(i) . c[targets[i]] + bias[targets[i]]) in fp32, shape (n_rows,)."""
    n_rows, D = rows.n, e.shape[-1]
    out = torch.empty(n_rows, dtype=torch.float32, device=e.device)
    if n_rows == 0:
        return out
    kernel = load_kernel(variant, _flags(e, bias, softcap, variant.block_d, rows))
    grid = (triton.cdiv(n_rows, variant.block_b),)
    kernel[grid](
        e, c, bias if bias is not None else c, rows.offsets, targets, out,
        n_rows, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), _softcap_arg(softcap),
        BLOCK_B=variant.block_b, BLOCK_D=variant.block_d,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )
    return out


def split_plan(n_vocab_tiles: int, num_splits: int) -> int:
    """Splits actually launched: no split is left empty (split s walks tiles s, s + splits, ...)."""
    return max(1, min(num_splits, n_vocab_tiles))


def lse_forward(e, c, bias, rows: RowLayout, softcap, variant: LSEForwardVariant,
                perm: torch.Tensor | None = None, zt: torch.Tensor | None = None):
    """Per-row log-sum-exp of the (softcapped) logits, fp32 (n_rows,).

    Returns ``(lse, tile_map)``.  When ``perm`` is given the vocabulary is walked in that order;
    when the target logits ``zt`` are given too, the bounds of
    :class:`~cce_autotune.tile_map.TileMap` are recorded (else ``tile_map`` is None).
    """
    n_rows, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    record = perm is not None and zt is not None
    n_tiles = triton.cdiv(V, variant.block_v)
    tmap = None
    if record:
        tmap = TileMap(q=torch.empty((n_tiles, n_rows), dtype=torch.int8, device=dev), block_v=variant.block_v,
                       perm=perm, zt=zt)
    if n_rows == 0:
        return torch.empty(0, dtype=torch.float32, device=dev), tmap
    num_splits = split_plan(n_tiles, variant.num_splits)
    if variant.merge == "buffer":
        out = torch.empty((num_splits, n_rows), dtype=torch.float32, device=dev)
        locks = out  # unused
    else:
        out = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
        locks = torch.zeros(variant.num_locks, dtype=torch.int32, device=dev)
    flags = _flags(e, bias, softcap, variant.block_d, rows, walk_perm=perm is not None,
                   tile_map=record)
    kernel = load_kernel(variant, flags)
    grid = (triton.cdiv(n_rows, variant.block_b) * num_splits,)
    kernel[grid](
        e, c, bias if bias is not None else c, rows.offsets, out, locks,
        perm if perm is not None else rows.offsets,
        zt if record else out, tmap.q if record else out,
        n_rows, V, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), _softcap_arg(softcap),
        num_splits,
        BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
        GROUP_B=variant.group_b, NUM_LOCKS=variant.num_locks,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )
    lse = torch.logsumexp(out, dim=0) if variant.merge == "buffer" else out
    return lse, tmap


def backward(
    e, c, bias, rows: RowLayout, target_pos, lse, coef_s, coef_t, perm, softcap,
    filter_eps, variant: BackwardVariant, tile_map: TileMap | None = None, targets: torch.Tensor | None = None,
):
    """dE (shape and dtype of ``e``), dC (of ``c``), dbias (of ``bias``, or None).

    ``target_pos[i]`` is the column position of row i's target in the walked vocabulary order (its
    vocab index, or ``inv_perm[target]`` when ``perm`` is given). The gradient of row i's logits is
    ``softmax * coef_s[i] - onehot * coef_t[i]`` (times the softcap derivative).
    ``filter_eps=None``: exact.

    With a forward's ``tile_map`` (filtered, fp32 accumulation), ``perm`` must be the order that
    forward walked and ``targets`` the vocabulary index of each row's target: the tiles and sparse
    strategies launch only the tiles the map leaves live, and the onehot term of a row whose target
    tile is not among them is added outside the kernels; ``strategy="auto"`` takes the chunked
    strategy instead when more than :data:`AUTO_CHUNKED_SHARE` of the tiles are live.
    """
    if tile_map is not None and (filter_eps is None or variant.accum == "native" or targets is None
                                 or perm is not tile_map.perm):
        raise ValueError("tile_map: needs filtering, accum='fp32', the targets and the order the forward walked")
    # The variant as launched: strategy decided, filter and sorting as this call has them.
    auto = variant.strategy == "auto"
    variant = variant.resolved(filter_eps).replace(filter_eps=filter_eps, sort_vocab=perm is not None)
    if tile_map is None and variant.strategy == "sparse":
        variant = variant.replace(strategy="tiles")  # no map (a classifier's first call): every tile
    tiles = None
    if tile_map is not None and rows.n > 0 and variant.strategy in ("tiles", "sparse"):
        if auto:
            variant = variant.replace(strategy=AUTO_WITH_MAP)
        sparse = variant.strategy == "sparse"
        tiles, live = live_tiles(tile_map, lse, filter_eps, c.shape[0], variant.block_b, variant.block_v,
                                 1 if sparse else variant.group_b, swizzle=not sparse)
        if auto and tiles.numel() > AUTO_CHUNKED_SHARE * live.numel():  # (a host count: no further sync)
            # Most tiles are live (flat softmax): the chunked strategy's cuBLAS products beat the
            # tile kernel's atomics; its own filter still skips negligible chunks.
            variant, tile_map = variant.replace(strategy="chunked"), None
        else:
            # The onehot term of a row is added inside a launched tile; rows whose target tile is not
            # launched get theirs from outside (coefficient coef_out).
            in_list = live[torch.arange(rows.n, device=lse.device) // variant.block_b,
                           target_pos.long() // variant.block_v]
            coef_out = torch.where(in_list, 0.0, coef_t)
        if sparse and tile_map is not None:
            return _backward_sparse(e, c, bias, rows, target_pos, targets, lse, coef_s, coef_t, coef_out, perm,
                                    softcap, variant, tiles, tile_map)
    if variant.strategy == "chunked":
        return _backward_chunked(e, c, bias, rows, target_pos, lse, coef_s, coef_t, perm, softcap, filter_eps, variant)
    n_rows, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    native = variant.accum == "native"
    use_map = tile_map is not None and n_rows > 0
    acc_dtype = e.dtype if native else torch.float32
    de = torch.zeros(e.shape, dtype=acc_dtype, device=dev)
    dc = torch.zeros(c.shape, dtype=c.dtype if native else torch.float32, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    if n_rows > 0:
        if use_map:
            grid = (tiles.numel(),)
            _add_target_terms(e, c, rows, targets, tile_map.zt, coef_out, softcap, de, dc, dbias)
        else:
            tiles = target_pos  # unused
            grid = (triton.cdiv(n_rows, variant.block_b) * triton.cdiv(V, variant.block_v),)
        kernel = load_kernel(variant, _flags(e, bias, softcap, variant.block_d, rows, tile_list=use_map))
        locks_e = torch.zeros(variant.num_locks if native else 1, dtype=torch.int32, device=dev)
        locks_c = torch.zeros(variant.num_locks if native else 1, dtype=torch.int32, device=dev)
        if grid[0] > 0:
            kernel[grid](
                e, c, bias if bias is not None else c, rows.offsets, target_pos, lse, coef_s, coef_t,
                perm if perm is not None else target_pos, tiles,
                de, rows.de_offsets, dc, dbias if dbias is not None else lse, locks_e, locks_c,
                n_rows, V, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), dc.stride(0), _softcap_arg(softcap),
                float(filter_eps) if filter_eps is not None else 0.0,
                BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
                GROUP_B=variant.group_b, NUM_LOCKS=variant.num_locks,
                num_warps=variant.num_warps, num_stages=variant.num_stages,
            )
    if not native:
        de = de.to(e.dtype)
        dc = dc.to(c.dtype)
    if dbias is not None:
        dbias = dbias.to(bias.dtype)
    return de, dc, dbias


def _target_weight(coef_t, zt, softcap) -> torch.Tensor:
    """Weight of a row's onehot term: coef_t times the softcap derivative at the target logit."""
    w = coef_t.float()
    if softcap is not None:
        w = w * (1.0 - (zt.float() / float(softcap)) ** 2)
    return w


def _add_target_terms(e, c, rows: RowLayout, targets, zt, coef_t, softcap, de32, dc32, dbias, chunk: int = 4096):
    """The onehot part of the logit gradient, -coef_t[i] (times the softcap derivative at the target
    logit) at (i, targets[i]), added into the fp32 dE, dC (and dbias) accumulators."""
    D = e.shape[-1]
    e2 = e.reshape(-1, D)
    de2 = de32.view(-1, D)
    row_idx = rows.row_index(D)
    w = _target_weight(coef_t, zt, softcap)
    for lo in range(0, rows.n, chunk):
        sl = slice(lo, lo + chunk)
        t, wk = targets[sl], w[sl, None]
        de2.index_add_(0, row_idx[sl], c[t].float() * -wk)
        dc32.index_add_(0, t, e2[row_idx[sl]].float() * -wk)
    if dbias is not None:
        dbias.index_add_(0, targets, -w)


def _backward_sparse(e, c, bias, rows: RowLayout, target_pos, targets, lse, coef_s, coef_t, coef_out, perm, softcap,
                     variant: BackwardVariant, tiles: torch.Tensor, tile_map: TileMap):
    """The ``strategy="sparse"`` backward (see backward_sparse.py.j2): ``tiles`` are the live tile ids
    in row-major order; ``coef_out`` the onehot coefficients of rows whose target tile is not among
    them (0 for the others)."""
    n, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    BB, BV, BDO = variant.block_b, variant.block_v, variant.out_block_d
    R, T = triton.cdiv(n, BB), triton.cdiv(V, BV)
    ids = tiles.long()
    n_live = ids.numel()
    flags = _flags(e, bias, softcap, variant.block_d, rows)
    # Phase 1: the live tiles' gradients (softmax part), block k of G for tile tiles[k].
    g_buf = torch.empty((max(n_live, 1), BB, BV), dtype=e.dtype, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    if n_live:
        load_kernel(variant, flags)[(n_live,)](
            e, c, bias if bias is not None else c, rows.offsets, target_pos, lse, coef_s, coef_t, perm, tiles, g_buf,
            dbias if dbias is not None else lse,
            n, V, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), _softcap_arg(softcap),
            BLOCK_B=BB, BLOCK_V=BV, BLOCK_D=variant.block_d,
            num_warps=variant.num_warps, num_stages=variant.num_stages,
        )
    # Row-major (CSR) and column-major (CSC) views of the live tiles, and the rows by target tile.
    def ptr(keys, size):
        p = torch.zeros(size + 1, dtype=torch.int32, device=dev)
        p[1:] = torch.cumsum(torch.bincount(keys, minlength=size), 0)
        return p

    row_ptr = ptr(ids // T, R)
    col_ptr = ptr(ids % T, T)
    col_idx = torch.argsort((ids % T) * R + ids // T).to(torch.int32)
    w = _target_weight(coef_out, tile_map.zt, softcap)
    tgt_tile = target_pos.long() // BV
    tgt_rows = torch.argsort(tgt_tile).to(torch.int32)
    tgt_ptr = ptr(tgt_tile, T)
    # Phase 2: dE per row block, dC per vocabulary tile, each written once.
    per_stage = (BB * BV + max(BB, BV) * BDO) * e.element_size()
    stages = max(1, min(variant.num_stages, _SPARSE_SMEM // per_stage))
    de = torch.zeros(e.shape, dtype=e.dtype, device=dev)
    dc = torch.empty(c.shape, dtype=c.dtype, device=dev)
    n_d = triton.cdiv(D, BDO)
    load_kernel(variant, flags, "cce_sparse_de_kernel")[(R, n_d)](
        c, perm, tiles, row_ptr, g_buf, targets, w, de, rows.de_offsets,
        n, V, D, c.stride(0), c.stride(1),
        BLOCK_B=BB, BLOCK_V=BV, BLOCK_DO=BDO, num_warps=variant.num_warps, num_stages=stages,
    )
    load_kernel(variant, flags, "cce_sparse_dc_kernel")[(T, n_d)](
        e, rows.offsets, perm, tiles, col_ptr, col_idx, g_buf, tgt_rows, tgt_ptr, target_pos, w, dc,
        n, V, D, rows.stride, e.stride(-1), dc.stride(0),
        BLOCK_B=BB, BLOCK_V=BV, BLOCK_DO=BDO, num_warps=variant.num_warps, num_stages=stages,
    )
    if dbias is not None:
        dbias.index_add_(0, targets, -w)
        dbias = dbias.to(bias.dtype)
    return de, dc, dbias


_FP32_OUT_MM: list = []  # the way _add_matmul_fp32 found to work, decided on its first CUDA call


def _add_matmul_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, where 16-bit a, b are multiplied by cuBLAS into an fp32 result (no
    rounding of the partial product to 16 bits) where this PyTorch offers it (addmm/mm out_dtype)."""
    ways = {
        "addmm": lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc),
        "mm": lambda: acc.add_(torch.mm(a, b, out_dtype=torch.float32)),
    }
    if a.dtype != torch.float32 and a.is_cuda:
        if not _FP32_OUT_MM:  # first call: find the first way this PyTorch supports
            for name, way in ways.items():
                try:
                    way()
                    _FP32_OUT_MM.append(name)
                    return
                except (RuntimeError, TypeError):
                    continue
            _FP32_OUT_MM.append("none")
        elif _FP32_OUT_MM[0] in ways:
            ways[_FP32_OUT_MM[0]]()
            return
    acc += a @ b


def _backward_chunked(e, c, bias, rows: RowLayout, target_pos, lse, coef_s, coef_t, perm, softcap, filter_eps,
                      variant: BackwardVariant):
    """The ``strategy="chunked"`` backward: per vocabulary chunk, a kernel writes g to a buffer of
    (rows x chunk_v) and cuBLAS forms dC[chunk] = g^T E and dE += g C[chunk] (fp32)."""
    n_rows, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    de32 = torch.zeros((n_rows, D), dtype=torch.float32, device=dev)
    dc = torch.zeros(c.shape, dtype=c.dtype, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    row_idx = rows.row_index(D)
    if n_rows > 0:
        kernel = load_kernel(variant, _flags(e, bias, softcap, variant.block_d, rows))
        e_rows = rows.take(e)  # the rows taking part, as a matrix for cuBLAS
        width = min(variant.chunk_v, V)
        g_buf = torch.empty((n_rows, width), dtype=e.dtype, device=dev)
        n_chunks = triton.cdiv(V, width)
        chunk_max = torch.zeros(n_chunks, dtype=torch.float32, device=dev)
        for k in range(n_chunks):
            lo = k * width
            w = min(width, V - lo)
            grid = (triton.cdiv(n_rows, variant.block_b) * triton.cdiv(w, variant.block_v),)
            kernel[grid](
                e, c, bias if bias is not None else c, rows.offsets, target_pos, lse, coef_s, coef_t,
                perm if perm is not None else target_pos, g_buf, dbias if dbias is not None else lse,
                chunk_max[k:],
                n_rows, V, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), g_buf.stride(0),
                _softcap_arg(softcap), lo, w,
                BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
                GROUP_B=variant.group_b, num_warps=variant.num_warps, num_stages=variant.num_stages,
            )
            if filter_eps is not None and float(chunk_max[k]) < filter_eps:
                continue  # every softmax value of the chunk is negligible and it holds no target
            g = g_buf[:, :w]
            if perm is not None:
                cols = perm[lo : lo + w].long()
                dc.index_copy_(0, cols, (g.T @ e_rows).to(c.dtype))
                _add_matmul_fp32(de32, g, c[cols])
            else:
                dc[lo : lo + w] = g.T @ e_rows
                _add_matmul_fp32(de32, g, c[lo : lo + w])
    de = torch.zeros(e.shape, dtype=e.dtype, device=dev)
    de.view(-1, D).index_copy_(0, row_idx, de32.to(e.dtype))
    if dbias is not None:
        dbias = dbias.to(bias.dtype)
    return de, dc, dbias

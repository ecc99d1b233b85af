"""Launch wrappers: tensors in, tensors out, one function per kernel.

The kernels address the rows of E through a :class:`RowLayout`: either densely (row i at
``i * stride``) or through int64 element offsets of each row that takes part, so that ignored rows,
``shift`` and non-contiguous batch layouts cost no copy of E.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .codegen import Flags, interpreting, load_kernel, load_utility
from .planner import BackwardPlan
from .tile_map import TileMap, tile_ids
from .variant import BackwardVariant, IndexedDotVariant, LSEForwardVariant

__all__ = ["RowLayout", "indexed_dot", "lse_forward", "backward"]
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


def _flags(e: torch.Tensor, c: torch.Tensor, bias, softcap, block_d: int, rows: RowLayout, **extra) -> Flags:
    D = e.shape[-1]
    return Flags(
        cast_c=c.dtype != e.dtype,
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
    kernel = load_kernel(variant, _flags(e, c, bias, softcap, variant.block_d, rows))
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

    A classifier wider than e (fp32 with 16-bit e) is converted to e's dtype one vocabulary chunk
    at a time (:func:`convert_width` rows, in the walked order) and each chunk reduced by its own
    launch: every row block reads C's tiles, so reading them in fp32 would double the traffic the
    kernel lives on; the chunk's conversion reads C once.
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
    if c.dtype == e.dtype:
        return _lse_launch(e, c, bias, rows, softcap, variant, perm, zt, tmap.q if record else None), tmap
    W = convert_width(V, D, variant.block_v, e.element_size())
    buf = torch.empty((min(W, V), D), dtype=e.dtype, device=dev)
    lse = None
    for lo in range(0, V, W):
        w = min(W, V - lo)
        chunk = _convert_rows(c, lo, w, perm, buf)
        # Walking an order: cols (bias, map) come from the chunk of the order, C's rows from the
        # chunk; else the chunk's columns are vocabulary entries lo.. (bias sliced to match).
        part = _lse_launch(e, chunk, bias if perm is not None or bias is None else bias[lo : lo + w], rows, softcap,
                           variant, perm[lo : lo + w] if perm is not None else None, zt,
                           tmap.q[lo // variant.block_v :] if record else None, c_local=True)
        lse = part if lse is None else torch.logaddexp(lse, part)
    return lse, tmap


# Bytes of the converted chunk of the classifier (fp32 classifier, 16-bit e).
CONVERT_BYTES = 128 << 20


def convert_width(V: int, D: int, block_v: int, elem: int) -> int:
    """Rows of the classifier converted at a time: a multiple of ``block_v`` within
    :data:`CONVERT_BYTES` (at least one tile)."""
    rows = max(block_v, CONVERT_BYTES // max(1, D * elem) // block_v * block_v)
    return min(rows, triton.cdiv(V, block_v) * block_v)


def converted_classifier(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole classifier converted to ``dtype`` (one launch) when that copy fits in
    :data:`CONVERT_BYTES`, the size of one conversion chunk; else None (the kernels convert it a
    chunk or window at a time)."""
    V, D = c.shape
    if V * D * torch.empty((), dtype=dtype).element_size() > CONVERT_BYTES:
        return None
    return _convert_rows(c, 0, V, None, torch.empty((V, D), dtype=dtype, device=c.device))


def _convert_rows(c: torch.Tensor, lo: int, w: int, perm: torch.Tensor | None, buf: torch.Tensor) -> torch.Tensor:
    """Rows lo..lo+w of the classifier (in the order ``perm`` when given), rounded to nearest in
    ``buf``'s dtype, into ``buf`` (one launch of ``templates/convert.py.j2``: no fp32 staging copy);
    returns the filled view."""
    out = buf[:w]
    D = c.shape[1]
    kernel = load_utility("convert.py.j2", "cce_convert_rows_kernel", GATHER=perm is not None,
                          ROUND_BF16=buf.dtype == torch.bfloat16)
    block_d = min(128, triton.next_power_of_2(D))
    grid = (triton.cdiv(w, 32), triton.cdiv(D, block_d))
    kernel[grid](c, perm if perm is not None else c, out, lo, w, D, c.stride(0), c.stride(1), out.stride(0),
                 BLOCK_R=32, BLOCK_D=block_d, num_warps=4)
    return out


def _lse_launch(e, c, bias, rows: RowLayout, softcap, variant: LSEForwardVariant, perm, zt, q, c_local=False):
    """One launch of the LSE kernel over all of ``c``'s rows (walked in the order ``perm`` when
    given; with ``c_local``, C's row p holds the walked position p); records the map into ``q``
    when given. Returns the (n_rows,) fp32 LSE."""
    n_rows = rows.n
    V = perm.shape[0] if perm is not None else c.shape[0]
    dev = e.device
    n_tiles = triton.cdiv(V, variant.block_v)
    num_splits = split_plan(n_tiles, variant.num_splits)
    if variant.merge == "buffer":
        out = torch.empty((num_splits, n_rows), dtype=torch.float32, device=dev)
        locks = out  # unused
    else:
        out = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
        locks = torch.zeros(variant.num_locks, dtype=torch.int32, device=dev)
    record = q is not None
    flags = _flags(e, c, bias, softcap, variant.block_d, rows, walk_perm=perm is not None,
                   tile_map=record, c_local=c_local)
    kernel = load_kernel(variant, flags)
    grid = (triton.cdiv(n_rows, variant.block_b) * num_splits,)
    kernel[grid](
        e, c, bias if bias is not None else c, rows.offsets, out, locks,
        perm if perm is not None else rows.offsets,
        zt if record else out, q if record else out,
        n_rows, V, e.shape[-1], rows.stride, e.stride(-1), c.stride(0), c.stride(1), _softcap_arg(softcap),
        num_splits,
        BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
        GROUP_B=variant.group_b, NUM_LOCKS=variant.num_locks,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )
    return torch.logsumexp(out, dim=0) if variant.merge == "buffer" else out


def backward(
    e, c, bias, rows: RowLayout, target_pos, lse, coef_s, coef_t, perm, softcap,
    filter_eps, variant: BackwardVariant, plan: BackwardPlan, tile_map: TileMap | None = None,
    live: torch.Tensor | None = None, chunks: list | None = None, targets: torch.Tensor | None = None,
    dc_dtype: torch.dtype | None = None, deterministic: bool = False, dead_dir: torch.Tensor | None = None,
):
    """dE (shape and dtype of ``e``), dC (of ``c``), dbias (of ``bias``, or None), as ``plan`` says
    (see :mod:`cce_autotune.planner`, which decides everything this function launches).

    ``target_pos[i]`` is the column position of row i's target in the walked vocabulary order (its
    vocab index, or ``inv_perm[target]`` when ``perm`` is given). The gradient of row i's logits is
    ``softmax * coef_s[i] - onehot * coef_t[i]`` (times the softcap derivative).
    ``filter_eps=None``: exact.

    With ``plan.use_map``: ``tile_map`` is the forward's map, ``perm`` the order that forward walked,
    ``live`` the (row blocks, tiles) grid of live tiles at the variant's tiling
    (:func:`~cce_autotune.tile_map.live_grid`), ``targets`` the vocabulary index of each row's target
    and, for the chunked strategy, ``chunks[k * G + j]`` whether vocabulary chunk k holds a live
    tile in row group j (G groups of ``plan.row_group`` rows; one without row groups).
    ``dc_dtype``: dC's dtype when it is not c's (``c`` a converted copy of a wider classifier).
    ``deterministic``: the plan is chunked (the planner's choice) and dbias is summed without atomics. Only live tiles are computed; the onehot term of a row whose target tile is dead is
    added outside the kernels.
    ``dead_dir`` (D,) fp32, with a mapped chunked plan: the dead-tile correction. The kernel sums
    each row's softmax mass in the tiles it computes, and row i's dE gains
    ``coef_s[i] * (1 - that mass) * dead_dir``: the skipped tiles' softmax terms taken along one
    direction (:func:`cce_autotune.accuracy.choose_filter` fits and checks it).
    """
    if dead_dir is not None and not (plan.use_map and plan.strategy == "chunked" and not deterministic):
        raise ValueError("dead_dir: the dead-tile correction needs a mapped chunked plan (not deterministic)")
    if plan.use_map and (tile_map is None or live is None or filter_eps is None or targets is None
                         or perm is not tile_map.perm):
        raise ValueError("plan: a mapped backward needs the tile map, its live grid, filtering, the targets "
                         "and the order the forward walked")
    variant = variant.replace(strategy=plan.strategy, filter_eps=filter_eps, sort_vocab=perm is not None)
    coef_out = None
    if plan.use_map and rows.n > 0:
        # The onehot term of a row is added inside a launched tile; rows whose target tile is not
        # launched get theirs from outside (coefficient coef_out).
        in_live = live[torch.arange(rows.n, device=lse.device) // variant.block_b,
                       target_pos.long() // variant.block_v]
        coef_out = torch.where(in_live, 0.0, coef_t)
    if plan.strategy == "chunked":
        return _backward_chunked(e, c, bias, rows, target_pos, targets, lse, coef_s, coef_t, coef_out, perm, softcap,
                                 variant, plan, tile_map, live, chunks, dc_dtype=dc_dtype,
                                 deterministic=deterministic, dead_dir=dead_dir)
    if plan.strategy == "sparse":
        return _backward_sparse(e, c, bias, rows, target_pos, targets, lse, coef_s, coef_t, coef_out, perm,
                                softcap, variant, tile_ids(live, 1, swizzle=False), tile_map, dc_dtype=dc_dtype)
    if plan.use_map and plan.window_v and rows.n > 0:
        return _backward_tiles_windowed(e, c, bias, rows, target_pos, targets, lse, coef_s, coef_t, coef_out, perm,
                                        softcap, filter_eps, variant, plan, tile_map, live, dc_dtype=dc_dtype)
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
            tiles = tile_ids(live, variant.group_b)
            _add_target_terms(c, e.reshape(-1, D), rows, targets, coef_out, tile_map.zt, softcap,
                              de.view(-1, D), dc, dbias)
        else:
            tiles = None
        _launch_tiles(e, c, bias, rows, target_pos, lse, coef_s, coef_t, perm, softcap, filter_eps, variant,
                      tiles, de, dc, dbias)
    if not native:
        de = de.to(e.dtype)
        dc = dc.to(dc_dtype)
    if dbias is not None:
        dbias = dbias.to(bias.dtype)
    return de, dc, dbias


def _launch_tiles(e, c, bias, rows: RowLayout, target_pos, lse, coef_s, coef_t, perm, softcap, filter_eps,
                  variant: BackwardVariant, tiles, de, dc, dbias, dc_lo: int | None = None,
                  c_window: torch.Tensor | None = None) -> None:
    """The tile kernel over every tile (``tiles`` None) or the listed ones; with ``dc_lo``, ``dc`` is
    the fp32 scratch of the vocabulary window starting at walked position ``dc_lo``, and
    ``c_window`` (if given) that window's rows of C converted to e's dtype, read instead of C."""
    n_rows, D = rows.n, e.shape[-1]
    V = c.shape[0]
    native = variant.accum == "native"
    if tiles is not None:
        grid = (tiles.numel(),)
    else:
        grid = (triton.cdiv(n_rows, variant.block_b) * triton.cdiv(V, variant.block_v),)
    if grid[0] == 0:
        return
    flags = _flags(e, c if c_window is None else c_window, bias, softcap, variant.block_d, rows,
                   tile_list=tiles is not None, dc_window=dc_lo is not None, c_local=c_window is not None)
    c_arg = c if c_window is None else c_window
    locks_e = torch.zeros(variant.num_locks if native else 1, dtype=torch.int32, device=e.device)
    locks_c = torch.zeros(variant.num_locks if native else 1, dtype=torch.int32, device=e.device)
    load_kernel(variant, flags)[grid](
        e, c_arg, bias if bias is not None else c, rows.offsets, target_pos, lse, coef_s, coef_t,
        perm if perm is not None else target_pos, tiles if tiles is not None else target_pos,
        de, rows.de_offsets, dc, dbias if dbias is not None else lse, locks_e, locks_c,
        n_rows, V, D, rows.stride, e.stride(-1), c_arg.stride(0), c_arg.stride(1), dc.stride(0),
        _softcap_arg(softcap),
        float(filter_eps) if filter_eps is not None else 0.0, dc_lo or 0,
        BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
        GROUP_B=variant.group_b, NUM_LOCKS=variant.num_locks,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )


def _backward_tiles_windowed(e, c, bias, rows: RowLayout, target_pos, targets, lse, coef_s, coef_t, coef_out, perm,
                             softcap, filter_eps, variant: BackwardVariant, plan: BackwardPlan, tile_map: TileMap,
                             live, dc_dtype=None) -> tuple:
    """The tile kernel over the live tiles, one vocabulary window of ``plan.window_v`` walked
    positions at a time, so that the fp32 dC scratch is window x D instead of V x D: each window's
    dC rows are rounded into dC once its tiles are done. dE keeps its fp32 scratch (n x D)."""
    D = e.shape[-1]
    V = c.shape[0]
    dev = e.device
    W = plan.window_v
    T = live.shape[1]
    per = W // variant.block_v
    de32 = torch.zeros(e.shape, dtype=torch.float32, device=dev)
    dc = torch.zeros(c.shape, dtype=dc_dtype or c.dtype, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    tiles = tile_ids(live, variant.group_b)
    window = (tiles % T) // per
    tiles = tiles[torch.argsort(window, stable=True)]
    counts = torch.bincount(window, minlength=-(-T // per)).tolist()  # the backward's one host copy
    scratch = torch.empty((W, D), dtype=torch.float32, device=dev)
    # A classifier wider than e: each window's rows converted to e's dtype once (see lse_forward).
    c_buf = torch.empty((W, D), dtype=e.dtype, device=dev) if c.dtype != e.dtype else None
    first = 0
    for k, count in enumerate(counts):
        if count == 0:
            continue  # no live tile: dC rows of the window stay zero (target terms come later)
        lo = k * W
        w = min(W, V - lo)
        scratch.zero_()
        window = _convert_rows(c, lo, w, perm, c_buf) if c_buf is not None else None
        _launch_tiles(e, c, bias, rows, target_pos, lse, coef_s, coef_t, perm, softcap, filter_eps, variant,
                      tiles[first:first + count], de32, scratch, dbias, dc_lo=lo, c_window=window)
        first += count
        dc.index_copy_(0, perm[lo:lo + w].long(), scratch[:w].to(dc.dtype))
    _add_target_terms(c, e.reshape(-1, D), rows, targets, coef_out, tile_map.zt, softcap, de32.view(-1, D), dc, dbias)
    if dbias is not None:
        dbias = dbias.to(bias.dtype)
    return de32.to(e.dtype), dc, dbias


def _target_weight(coef_t, zt, softcap) -> torch.Tensor:
    """Weight of a row's onehot term: coef_t times the softcap derivative at the target logit."""
    w = coef_t.float()
    if softcap is not None:
        w = w * (1.0 - (zt.float() / float(softcap)) ** 2)
    return w


def _backward_sparse(e, c, bias, rows: RowLayout, target_pos, targets, lse, coef_s, coef_t, coef_out, perm, softcap,
                     variant: BackwardVariant, tiles: torch.Tensor, tile_map: TileMap, dc_dtype=None):
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
    flags = _flags(e, c, bias, softcap, variant.block_d, rows)
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
    dc = torch.empty(c.shape, dtype=dc_dtype or c.dtype, device=dev)
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


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _mm_add_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_(torch.mm(a, b, out_dtype=torch.float32))


_FP32_WAYS = (_addmm_fp32, _mm_add_fp32)
_FP32_OUT_MM: list = []  # the way _add_matmul_fp32 found to work on its first CUDA call (None: neither)


def _add_matmul_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b, where 16-bit a, b are multiplied by cuBLAS into an fp32 result (no
    rounding of the partial product to 16 bits) where this PyTorch offers it (addmm/mm out_dtype).
    (Called once per block of the chunked strategy: no per-call closures.)"""
    if a.dtype != torch.float32 and a.is_cuda:
        if _FP32_OUT_MM:
            if _FP32_OUT_MM[0] is not None:
                _FP32_OUT_MM[0](acc, a, b)
                return
        else:  # first call: find the first way this PyTorch supports
            for way in _FP32_WAYS:
                try:
                    way(acc, a, b)
                except (RuntimeError, TypeError):
                    continue
                _FP32_OUT_MM.append(way)
                return
            _FP32_OUT_MM.append(None)
    elif a.dtype != acc.dtype:  # the CPU: the product of the upcast operands
        acc += a.float() @ b.float()
        return
    acc += a @ b


def _backward_chunked(e, c, bias, rows: RowLayout, target_pos, targets, lse, coef_s, coef_t, coef_out, perm, softcap,
                      variant: BackwardVariant, plan: BackwardPlan, tile_map: TileMap | None, live, chunks,
                      dc_dtype=None, deterministic: bool = False, dead_dir: torch.Tensor | None = None):
    """The ``strategy="chunked"`` backward: for each vocabulary chunk of ``plan.chunk_v`` columns, and
    each group of ``plan.row_group`` rows (all rows when 0), that holds a live tile (every block
    without a map), a kernel writes the gradient block g of the group's rows (dead tiles as zeros,
    not recomputed) to a buffer that lines up with the rows of E, and cuBLAS forms dE += g C[chunk],
    accumulated in fp32 when ``plan.de_fp32`` and else in dE itself (fp32 inside cuBLAS, one
    rounding per live chunk), and dC[chunk] = g^T E (one rounding; with row groups summed over the
    groups in an fp32 buffer first). ``chunks[k * groups + j]``: whether chunk k holds a live tile in
    row group j. No atomics (but the live mass of ``dead_dir``'s correction, see :func:`backward`);
    no V x D scratch."""
    n, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    e2 = e.reshape(-1, D)  # a view unless e's strides forbid it (the planner counts the copy)
    N = e2.shape[0]
    de = torch.zeros(e.shape, dtype=e.dtype, device=dev)
    de2 = de.view(N, D)
    acc = torch.zeros((N, D), dtype=torch.float32, device=dev) if plan.de_fp32 else de2
    dc = torch.empty(c.shape, dtype=dc_dtype or c.dtype, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    # Deterministic: the kernel's float atomics into dbias go to a scratch that is dropped; dbias is
    # summed from each chunk's g instead.
    dbias_k = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None and deterministic else dbias
    W = min(plan.chunk_v or variant.chunk_v, V)
    n_chunks = triton.cdiv(V, W)
    computed = [False] * n_chunks
    if n > 0:
        use_live = live is not None
        groups = _row_groups(e, rows, plan.row_group, variant.block_b, N)
        # A classifier wider than e: each chunk's rows converted to e's dtype once (see lse_forward),
        # read by the kernel and by cuBLAS.
        c_buf = torch.empty((W, D), dtype=e.dtype, device=dev) if c.dtype != e.dtype else None
        mass = torch.zeros(n, dtype=torch.float32, device=dev) if dead_dir is not None else None
        kernel = load_kernel(variant, _flags(e, c if c_buf is None else c_buf, bias, softcap, variant.block_d, rows,
                                             tile_live=use_live, c_local=c_buf is not None,
                                             live_mass=mass is not None))
        # Rows of E that no problem row reads (shift, ignored rows) keep a zero gradient row in g.
        g_rows = max(grp.span for grp in groups)
        g_buf = (torch.zeros if n < N else torch.empty)((g_rows, W), dtype=e.dtype, device=dev)
        # Row groups: dC[chunk] summed over the groups in fp32, one rounding when written.
        dc_part = torch.empty((W, D), dtype=torch.float32, device=dev) if len(groups) > 1 else None
        # Each group's rows of the per-row arguments, sliced once (views; launches dominate small blocks).
        args = [(rows.offsets[gr.lo:], target_pos[gr.lo:], lse[gr.lo:], coef_s[gr.lo:], coef_t[gr.lo:],
                 live[gr.lo // variant.block_b:] if use_live else lse, () if mass is None else (mass[gr.lo:],))
                for gr in groups]
        # ... and its rows of E, of the dE accumulator and of g, for the products.
        views = [(e2[gr.first : gr.first + gr.span], acc[gr.first : gr.first + gr.span], g_buf[: gr.span])
                 for gr in groups]
        for k in range(n_chunks):
            lo = k * W
            w = min(W, V - lo)
            todo = [j for j in range(len(groups)) if chunks is None or chunks[k * len(groups) + j]]
            if not todo:
                continue  # no live tile: every gradient of the chunk is negligible
            chunk = _convert_rows(c, lo, w, perm, c_buf) if c_buf is not None else None
            c_arg = c if chunk is None else chunk
            cols = perm[lo : lo + w].long() if perm is not None else None
            c_k = chunk if chunk is not None else (c[lo : lo + w] if cols is None else c[cols])
            if dc_part is not None:
                dc_part[:w].zero_()
            for j in todo:
                grp = groups[j]
                grid = (triton.cdiv(grp.n, variant.block_b) * triton.cdiv(w, variant.block_v),)
                offsets, tpos, lse_g, cs, ct, live_g, mass_g = args[j]
                kernel[grid](
                    grp.e, c_arg, bias if bias is not None else c, offsets, grp.g_offsets, tpos,
                    lse_g, cs, ct, perm if perm is not None else target_pos, live_g, g_buf,
                    dbias_k if dbias_k is not None else lse,
                    grp.n, V, D, rows.stride, e.stride(-1), c_arg.stride(0), c_arg.stride(1), g_buf.stride(0),
                    _softcap_arg(softcap), lo, w, *mass_g,
                    BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
                    GROUP_B=variant.group_b, num_warps=variant.num_warps, num_stages=variant.num_stages,
                )
                if grp.holes is not None:
                    g_buf.index_fill_(0, grp.holes, 0)  # rows another group wrote, not this group's
                e_rows, acc_g, g = views[j]
                if w != W:
                    g = g[:, :w]
                _add_matmul(acc_g, g, c_k)
                if dc_part is not None:
                    _add_matmul_fp32(dc_part[:w], g.T, e_rows)
                elif cols is None:
                    if dc.dtype == g.dtype:
                        torch.mm(g.T, e_rows, out=dc[lo : lo + w])
                    else:
                        _mm_fp32_out(g.T, e_rows, dc[lo : lo + w])
                else:
                    if dc.dtype == g.dtype:
                        dc[cols] = g.T @ e_rows
                    else:
                        part = torch.empty((w, D), dtype=dc.dtype, device=dev)
                        _mm_fp32_out(g.T, e_rows, part)
                        dc[cols] = part
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
                    dc[cols] = dc_part[:w].to(dc.dtype)
            computed[k] = True
    for k in range(n_chunks):
        if not computed[k]:
            lo = k * W
            if perm is None:
                dc[lo : lo + W].zero_()
            else:
                dc[perm[lo : lo + W].long()] = 0
    if coef_out is not None and n > 0:  # target terms of rows whose target tile is dead
        _add_target_terms(c, e2, rows, targets, coef_out, tile_map.zt, softcap, acc, dc, dbias)
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


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b: into an fp32 accumulator without rounding the product, or into a 16-bit one
    with cuBLAS's fp32 arithmetic and one rounding."""
    if acc.dtype == torch.float32:
        _add_matmul_fp32(acc, a, b)
    else:
        acc.addmm_(a, b)


def _add_target_terms(c, e2, rows: RowLayout, targets, coef_out, zt, softcap, acc, dc, dbias,
                      chunk: int = 1024) -> None:
    """The onehot terms of the rows whose target tile was not launched, weight w = coef_out times the
    softcap derivative at the target logit (0 for the other rows, which add nothing):
    acc[row i] -= w_i c[t_i], dc[t_i] -= w_i e_i and dbias[t_i] -= w_i. Products in fp32, pieces of
    ``chunk`` rows, each piece added to ``acc`` / ``dc`` once (acc, dc: fp32 or the input dtype).
    Deterministic, without a host sync: every index_add_ / assignment meets distinct indices (rows of
    a piece are distinct; equal targets are summed first, as segments of a sorted scan)."""
    D = e2.shape[1]
    w = _target_weight(coef_out, zt, softcap)
    row_idx = rows.row_index(D)
    for lo in range(0, targets.shape[0], chunk):
        sl = slice(lo, lo + chunk)
        t, wk, r = targets[sl], w[sl, None], row_idx[sl]
        acc.index_add_(0, r, (c[t].to(e2.dtype).float() * -wk).to(acc.dtype))
        order = torch.argsort(t, stable=True)
        ts = t[order]
        sums = _segment_sums(ts, e2[r[order]].float() * -wk[order])
        dc.index_add_(0, ts, sums.to(dc.dtype))  # (rows past a run's last one add exact zeros)
    if dbias is not None:
        order = torch.argsort(targets, stable=True)
        ts = targets[order]
        dbias.index_add_(0, ts, _segment_sums(ts, -w[order, None]).squeeze(1).to(dbias.dtype))


def _segment_sums(keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """For sorted ``keys`` (m,) and ``vals`` (m, k): at the last row of each run of equal keys, the
    run's sum of ``vals``; zeros elsewhere. A scan in fp64, not atomics: the same bits every run."""
    if keys.numel() == 0:
        return vals.clone()
    v = vals.double()
    cs = v.cumsum(0)
    pos = torch.arange(keys.shape[0], device=keys.device)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = keys[1:] != keys[:-1]
    last = torch.ones_like(first)
    last[:-1] = first[1:]
    start = torch.cummax(torch.where(first, pos, 0), dim=0).values  # first row of each row's run
    run_sum = cs - (cs[start] - v[start])  # the sum from the run's first row to this one
    return torch.where(last[:, None], run_sum, 0.0).to(vals.dtype)


_MM_FP32_OUT: list = []  # whether mm's out_dtype works here, found on the first CUDA call


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (fp32) = a @ b with no rounding of the product to a's 16-bit dtype where this PyTorch
    offers it (mm's out_dtype on CUDA); elsewhere the product of the upcast operands on the CPU, or
    the 16-bit product on a GPU without out_dtype."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif a.is_cuda:
        if not _MM_FP32_OUT:
            try:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
                _MM_FP32_OUT.append(True)
                return
            except (RuntimeError, TypeError):
                _MM_FP32_OUT.append(False)
        if _MM_FP32_OUT[0]:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        else:
            out.copy_(a @ b)
    else:
        torch.mm(a.float(), b.float(), out=out)


# Columns per step of the fused strategy's row kernel.
FUSED_BLOCK_V = 2048


def fused(e, c, bias, rows: RowLayout, targets, coef, softcap, variant: BackwardVariant, row_block: int,
          dc_dtype: torch.dtype | None = None):
    """The ``strategy="fused"`` forward: the loss's LSE and target logits, and the gradients for a
    loss whose gradient with respect to row i's logits is ``softmax * coef[i] - onehot * coef[i]``
    (times the softcap derivative): returns ``(lse, zt, dE, dC, dbias)`` (fp32 LSE and target logits
    of the rows taking part; dE, dC, dbias shaped and typed like e, c, bias; dbias None without a
    bias, dC in ``dc_dtype`` when given). Rows go in blocks of ``row_block``: cuBLAS forms the block's fp32 logits, the kernel its
    LSE, target logit and gradient g (input dtype), cuBLAS dE[block] = g C and dC += g^T E[block]."""
    n, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    e2 = e.reshape(-1, D)
    dense = rows.dense_stride is not None and e2.shape[0] == n
    row_idx = rows.row_index(D)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    zt = torch.empty(n, dtype=torch.float32, device=dev)
    de = torch.zeros(e.shape, dtype=e.dtype, device=dev)
    de2 = de.view(-1, D)
    dc = torch.zeros(c.shape, dtype=dc_dtype or c.dtype, device=dev)
    dbias = torch.zeros(V, dtype=torch.float32, device=dev) if bias is not None else None
    if n == 0:
        return lse, zt, de, dc, dbias.to(bias.dtype) if bias is not None else None
    R = max(1, min(row_block, n))
    z = torch.empty((R, V), dtype=torch.float32, device=dev)
    g = torch.empty((R, V), dtype=e.dtype, device=dev)
    kernel = load_kernel(variant.replace(strategy="fused"), _flags(e, c, bias, softcap, variant.block_d, rows))
    for r0 in range(0, n, R):
        r1 = min(n, r0 + R)
        m = r1 - r0
        e_blk = e2[r0:r1] if dense else e2[row_idx[r0:r1]]
        _mm_fp32_out(e_blk, c.T, z[:m])
        kernel[(m,)](
            z, bias if bias is not None else z, targets[r0:r1], coef[r0:r1], g, lse[r0:r1], zt[r0:r1],
            V, z.stride(0), g.stride(0), _softcap_arg(softcap),
            BLOCK_V=FUSED_BLOCK_V, num_warps=8,
        )
        g_blk = g[:m]
        if dense:
            torch.mm(g_blk, c, out=de2[r0:r1])
        else:
            de2[row_idx[r0:r1]] = g_blk @ c
        _add_matmul(dc, g_blk.T, e_blk)  # fp32 inside cuBLAS, one rounding per block of rows (none for fp32 dC)
        if dbias is not None:
            dbias += g_blk.sum(0, dtype=torch.float32)
    return lse, zt, de, dc, dbias.to(bias.dtype) if bias is not None else None

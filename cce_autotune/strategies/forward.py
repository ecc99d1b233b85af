"""The forward's kernels: the call's targets (which positions take part), the target logits (indexed
dot), the blockwise log-sum-exp with the tile map it records, and the classifier converted to e's dtype. Every strategy but the fused one runs
them (the fused one computes the forward with its gradients).
"""

from __future__ import annotations

from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import load_kernel, load_utility
from ..launch import cdiv
from ..tile_map import TileMap
from .common import RowLayout, convert_rows, flags, softcap_arg, tma_descriptors

__all__ = ["TARGETS_BLOCK", "prepare_targets", "indexed_dot", "lse_forward", "lse_splits", "merge_splits", "convert_width",
           "converted_classifier"]


TARGETS_BLOCK = 1024  # positions a program of the targets kernel takes


def prepare_targets(raw, token_weights, ignore_index: int, V: int) -> tuple:
    """``(valid, out_of_range, targets, weights, firsts)`` of a call's (n,) ``raw`` targets (any integer
    dtype, any stride) in one launch: ``valid`` (bool) the target is not ``ignore_index``;
    ``out_of_range`` (bool) valid and outside [0, V) (an error); ``targets`` (int64) the target where
    the position takes part (valid and in range), else 0; ``weights`` (fp32) its weight then (the
    (n,) ``token_weights``, selected: an ignored position's NaN never passes; 1 without them), else 0;
    ``firsts`` (blocks, 2) int64: each block of :data:`TARGETS_BLOCK` positions' first position out of
    range (n where none) and its target, for the range check's one copy."""
    n = raw.shape[0]
    dev = raw.device
    valid = torch.empty(n, dtype=torch.bool, device=dev)
    bad = torch.empty(n, dtype=torch.bool, device=dev)
    targets = torch.empty(n, dtype=torch.int64, device=dev)
    weights = torch.empty(n, dtype=torch.float32, device=dev)
    blocks = cdiv(n, TARGETS_BLOCK)
    firsts = torch.empty((blocks, 2), dtype=torch.int64, device=dev)
    if n:
        kernel = load_utility("targets.py.j2", "cce_targets_kernel")
        tw = token_weights if token_weights is not None else weights
        kernel[(blocks,)](raw, tw, valid, bad, targets, weights, firsts, n, V, ignore_index, raw.stride(0),
                          tw.stride(0), HAS_WEIGHTS=token_weights is not None, BLOCK=TARGETS_BLOCK, num_warps=4)
    return valid, bad, targets, weights, firsts


def indexed_dot(e, c, bias, rows: RowLayout, targets, softcap, variant) -> torch.Tensor:
    """z[i] = softcap(e_row(i) . c[targets[i]] + bias[targets[i]]) in fp32, shape (n_rows,)."""
    n_rows, D = rows.n, e.shape[-1]
    out = torch.empty(n_rows, dtype=torch.float32, device=e.device)
    if n_rows == 0:
        return out
    kernel = load_kernel(variant, flags(e, c, bias, softcap, variant.block_d, rows))
    grid = (cdiv(n_rows, variant.block_b),)
    kernel[grid](
        e, c, bias if bias is not None else c, rows.offsets, targets, out,
        n_rows, D, rows.stride, e.stride(-1), c.stride(0), c.stride(1), softcap_arg(softcap),
        BLOCK_B=variant.block_b, BLOCK_D=variant.block_d,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )
    return out


def lse_splits(n_vocab_tiles: int, num_splits: int) -> int:
    """Splits actually launched: no split is left empty (split s walks tiles s, s + splits, ...)."""
    return max(1, min(num_splits, n_vocab_tiles))


def lse_forward(e, c, bias, rows: RowLayout, softcap, variant,
                perm: torch.Tensor | None = None, zt: torch.Tensor | None = None, convert_chunk: int | None = None):
    """Per-row log-sum-exp of the (softcapped) logits, fp32 (n_rows,).

    Returns ``(lse, tile_map)``.  When ``perm`` is given the vocabulary is walked in that order;
    when the target logits ``zt`` are given too, the bounds of
    :class:`~cce_autotune.tile_map.TileMap` are recorded (else ``tile_map`` is None).

    With ``convert_chunk`` (required for a classifier wider than e: fp32 with 16-bit e) C is copied
    in e's dtype ``convert_chunk`` rows at a time (:func:`convert_width`; in the walked order) and
    each chunk reduced by its own launch, which reads the chunk by position: every row block reads C's
    tiles, so reading them in fp32 would double the traffic the kernel lives on, and gathering them
    through the order would take pointer loads where the chunk's tiles come through TMA (see
    ``planner.walk_copy``); the copy reads C once. Without it the kernel reads C itself.
    """
    n_rows, D = rows.n, e.shape[-1]
    V = c.shape[0]
    dev = e.device
    record = perm is not None and zt is not None
    n_tiles = cdiv(V, variant.block_v)
    tmap = None
    if record:
        tmap = TileMap(q=torch.empty((n_tiles, n_rows), dtype=torch.int8, device=dev), block_v=variant.block_v,
                       perm=perm, zt=zt)
    if n_rows == 0:
        return torch.empty(0, dtype=torch.float32, device=dev), tmap
    if c.dtype == e.dtype and not convert_chunk:
        return _lse_launch(e, c, bias, rows, softcap, variant, perm, zt, tmap.q if record else None), tmap
    if not convert_chunk:
        raise ValueError("convert_chunk: a classifier wider than e is converted in chunks: give their rows")
    W = convert_chunk
    buf = torch.empty((min(W, V), D), dtype=e.dtype, device=dev)
    # Every chunk's partial LSEs in one buffer, merged once (a chunk narrower than the widest, the last,
    # may launch fewer splits: its other rows stay -inf); with locks, every chunk merges into one result.
    splits = lse_splits(cdiv(min(W, V), variant.block_v), variant.num_splits)
    if variant.merge == "buffer":
        acc, locks = torch.full((cdiv(V, W) * splits, n_rows), float("-inf"), dtype=torch.float32, device=dev), None
    else:
        acc = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
        locks = torch.zeros(variant.num_locks, dtype=torch.int32, device=dev)
    for k, lo in enumerate(range(0, V, W)):
        w = min(W, V - lo)
        chunk = convert_rows(c, lo, w, perm, buf)
        # Walking an order: cols (bias, map) come from the chunk of the order, C's rows from the
        # chunk; else the chunk's columns are vocabulary entries lo.. (bias sliced to match).
        _lse_launch(e, chunk, bias if perm is not None or bias is None else bias[lo : lo + w], rows, softcap,
                    variant, perm[lo : lo + w] if perm is not None else None, zt,
                    tmap.q[lo // variant.block_v :] if record else None, c_local=True,
                    out=acc[k * splits : (k + 1) * splits] if locks is None else acc, locks=locks)
    return (merge_splits(acc) if locks is None else acc), tmap


def convert_width(V: int, D: int, block_v: int, elem: int, max_bytes: int) -> int:
    """Rows of the classifier converted at a time: a multiple of ``block_v`` within ``max_bytes``
    (at least one tile)."""
    rows = max(block_v, int(max_bytes) // max(1, D * elem) // block_v * block_v)
    return min(rows, cdiv(V, block_v) * block_v)


def converted_classifier(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole classifier converted to ``dtype`` (one launch)."""
    V, D = c.shape
    return convert_rows(c, 0, V, None, torch.empty((V, D), dtype=dtype, device=c.device))


def _lse_launch(e, c, bias, rows: RowLayout, softcap, variant, perm, zt, q, c_local=False, out=None, locks=None):
    """One launch of the LSE kernel over all of ``c``'s rows (walked in the order ``perm`` when
    given; with ``c_local``, C's row p holds the walked position p); records the map into ``q``
    when given. Returns the (n_rows,) fp32 LSE; or, given ``out`` (``merge="buffer"``: at least the
    launch's splits x n_rows partial LSEs, its first rows written; ``"lock"``: the (n_rows,) result
    merged into, with its ``locks``), None: the caller merges."""
    n_rows = rows.n
    V = perm.shape[0] if perm is not None else c.shape[0]
    dev = e.device
    n_tiles = cdiv(V, variant.block_v)
    num_splits = lse_splits(n_tiles, variant.num_splits)
    given = out is not None
    if variant.merge == "buffer":
        out = torch.empty((num_splits, n_rows), dtype=torch.float32, device=dev) if out is None else out
        locks = out  # unused
    elif out is None:
        out = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
        locks = torch.zeros(variant.num_locks, dtype=torch.int32, device=dev)
    record = q is not None
    # (C's rows are walked by position unless a walked order gathers them from the whole classifier)
    e_desc, c_desc = tma_descriptors(e, c, rows.n, rows.dense_stride, variant, c_by_position=perm is None or c_local)
    fl = flags(e, c, bias, softcap, variant.block_d, rows, walk_perm=perm is not None, tile_map=record,
               c_local=c_local, e_desc=e_desc is not None, c_desc=c_desc is not None)
    kernel = load_kernel(variant, fl)
    grid = (cdiv(n_rows, variant.block_b) * num_splits,)
    kernel[grid](
        e if e_desc is None else e_desc, c if c_desc is None else c_desc,
        bias if bias is not None else c, rows.offsets, out, locks,
        perm if perm is not None else rows.offsets,
        zt if record else out, q if record else out,
        n_rows, V, e.shape[-1], rows.stride, e.stride(-1), c.stride(0), c.stride(1), softcap_arg(softcap),
        num_splits,
        BLOCK_B=variant.block_b, BLOCK_V=variant.block_v, BLOCK_D=variant.block_d,
        GROUP_B=variant.group_b, NUM_LOCKS=variant.num_locks,
        num_warps=variant.num_warps, num_stages=variant.num_stages,
    )
    if given:
        return None
    if variant.merge == "lock":
        return out
    return out[0] if num_splits == 1 else merge_splits(out)


MERGE_BLOCK = 1024  # rows a program of the splits' merge takes


def merge_splits(parts: torch.Tensor) -> torch.Tensor:
    """Each row's LSE, fp32 (n,), from the (splits, n) fp32 partial LSEs of the LSE forward's splits
    (``merge="buffer"``): one launch of ``templates/lse_merge.py.j2`` (``torch.logsumexp`` takes about
    ten kernels: its max, the masking of infinite maxima, the shift, exp, sum, log and add)."""
    splits, n = parts.shape
    out = torch.empty(n, dtype=torch.float32, device=parts.device)
    if n:
        kernel = load_utility("lse_merge.py.j2", "cce_lse_merge_kernel")
        kernel[(cdiv(n, MERGE_BLOCK),)](parts, out, n, splits, BLOCK=MERGE_BLOCK, num_warps=4)
    return out

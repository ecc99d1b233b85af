"""What a filter costs in accuracy, measured on a sample of rows: the relative error that skipping a
backward's negligible tiles puts into dE.

The tile map's bound (:func:`cce_autotune.tile_map.dropped_share`) bounds the softmax *mass* a
filter drops, not what that mass does to dE: row i loses ``sum_j p_ij C_j`` over its dropped
columns j, and the rare rows of a trained classifier share a direction, so those terms add up
instead of cancelling. So the error is measured: :func:`check` takes rows spread over the call,
recomputes their logits against the whole vocabulary (fp32 results, a vocabulary chunk at a time,
chunks sized to the cost model's ``check_bytes``), marks the softmax terms in the tiles that the
live grid of the forward's tile map skips at each candidate filter (:func:`map_dead`: exactly what
every mapped strategy skips; no kernel filters by itself),
and compares ``||dE_dropped||`` with ``||dE||`` over
those rows (:func:`filter_errors`). The check costs two (rows x V x D) products per candidate
measured.

The check also measures a correction (:func:`filter_fit`): the dropped terms of a trained
classifier's rarely used rows point one way, so the chunked backward can add them back along one
fitted direction, scaled by each row's softmax mass in the skipped tiles (which its kernel sums).
A candidate passes on the corrected error when the call can take the correction.

How often it runs, and what is remembered of it, is the planner's business
(:mod:`cce_autotune.planning.planner`, :mod:`cce_autotune.memory`).
"""

from __future__ import annotations

import math

from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..tile_map import live_grid
from .filters import CONFIDENCE, GROUP, MAX_ERROR

__all__ = ["check", "filter_errors", "filter_fit", "map_dead", "column_tiles", "sample_rows", "chunk_columns"]


def chunk_columns(rows: int, candidates: int, V: int, max_bytes: int) -> int:
    """Vocabulary columns per chunk of :func:`filter_errors` for ``rows`` sampled rows and
    ``candidates`` filters: a power of two (256 .. 16,384, at most V rounded up) whose temporaries,
    about ``rows * columns * (18 + 11 * candidates)`` bytes (the fp32 logits, softmax and gradient,
    each candidate's masked copy and the 16-bit stack of all of them), stay within ``max_bytes``."""
    cap = max_bytes
    per_col = max(1, rows) * (18 + 11 * max(1, candidates))
    w = 256
    while w < 16384 and w < V and 2 * w * per_col <= cap:
        w *= 2
    return w


def sample_rows(n: int, rows: int) -> torch.Tensor:
    """int64 positions of at most ``rows`` rows evenly spread over ``n``."""
    return torch.linspace(0, max(0, n - 1), max(1, min(n, rows))).round().long().unique()


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with an fp32 (fp64) result, ``b`` in ``a``'s dtype first (a wider classifier is
    rounded as the kernels round it); 16-bit operands stay 16-bit (fp32 accumulation) on CUDA."""
    b = b.to(a.dtype)
    if a.dtype == torch.float32 or a.dtype == torch.float64:
        return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # an older PyTorch: no out_dtype
            pass
    return a.float() @ b.float()


def column_tiles(V: int, block_v: int, perm: torch.Tensor | None, device) -> torch.Tensor:
    """(V,) int64: the backward tile of each vocabulary entry when it walks ``perm`` (position p is
    entry perm[p]; None: the natural order)."""
    if perm is None:
        return torch.arange(V, device=device) // block_v
    tile = torch.empty(V, dtype=torch.long, device=device)
    tile[perm.long()] = torch.arange(V, device=device) // block_v
    return tile


def map_dead(tmap, lse: torch.Tensor, rows: torch.Tensor, eps_list, V: int, block_b: int, block_v: int) -> torch.Tensor:
    """(len(eps_list), len(rows), tiles) bool: the tiles of the backward's tiling that the live grid
    of the forward's tile map skips, for the rows at positions ``rows`` (any rows: the grid is per
    row block), per candidate filter. ``lse``: every row's (infinite where ignored)."""
    blocks = rows // block_b
    return torch.stack([~live_grid(tmap, lse, float(eps), V, block_b, block_v)[blocks] for eps in eps_list])


def _probs(e_rows, c, bias, softcap, lse_f, w, v0, v1):
    """Softmax values (rows x columns v0..v1, fp32 or fp64) and tanh(z / softcap) or None."""
    z = _mm32(e_rows, c[v0:v1].T)
    if bias is not None:
        z = z + bias[v0:v1].to(z.dtype)
    t = None
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    return torch.exp(z - lse_f[:, None]) * w[:, None], t


def _weights(lse: torch.Tensor):
    lse = lse.float() if lse.dtype != torch.float64 else lse
    w = torch.isfinite(lse).to(lse.dtype)  # rows with a gradient
    return torch.where(w > 0, lse, torch.zeros_like(lse)), w


def filter_errors(e_rows: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                  lse: torch.Tensor, softcap: float | None, col_tile: torch.Tensor, dead: torch.Tensor,
                  coef_s: torch.Tensor | None = None, coef_t: torch.Tensor | None = None,
                  chunk_v: int = 8192) -> torch.Tensor:
    """(m,) fp32 on the rows' device: for each of ``dead``'s m candidates, the relative L2 error that
    dropping the softmax terms of its dead tiles puts into the sampled rows' dE.

    ``e_rows`` (S, D), ``targets``, ``lse`` (S,): the sampled rows (an infinite LSE marks a row
    without gradient); ``col_tile`` (V,): each vocabulary entry's tile (:func:`column_tiles`);
    ``dead`` (m, S, tiles) bool: e.g. :func:`map_dead`; ``coef_s``, ``coef_t`` (S,): the rows'
    gradient coefficients, ``g = coef_s * softmax - coef_t * onehot`` (token weights, reduction,
    z-loss, label smoothing; default 1). A target's onehot term is never dropped (the kernels add it
    outside a skipped tile). ``chunk_v``: vocabulary columns per step (:func:`chunk_columns`)."""
    return filter_fit(e_rows, c, bias, targets, lse, softcap, col_tile, dead, coef_s, coef_t, chunk_v)[0]


def filter_fit(e_rows: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               lse: torch.Tensor, softcap: float | None, col_tile: torch.Tensor, dead: torch.Tensor,
               coef_s: torch.Tensor | None = None, coef_t: torch.Tensor | None = None,
               chunk_v: int = 8192, confidence: float = 0.0, shards=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(raw, corrected, direction)`` for the arguments of :func:`filter_errors`: ``raw`` (m,) its
    errors; ``corrected`` (m,) the errors left when the dropped terms of row i are replaced by
    ``a_i * direction``, ``a_i = coef_s[i] * (row i's softmax mass in the dead tiles)`` (what the
    chunked backward adds with ``dead_dir``); ``direction`` (m, D) fp32, fitted by least squares on
    all the sampled rows. ``corrected`` is measured out of sample: the rows at even sample positions
    are corrected with the direction fitted on the odd ones, and the reverse.

    ``confidence`` z > 0: ``raw`` and ``corrected`` are upper bounds for the whole call rather than
    the sample's values: each squared error is a ratio of sums over the sampled rows, ``Σ a_i / Σ w_i``
    (row i's dropped or left-over squared norm over its gradient's), raised by z of its standard
    error, ``sqrt(S / (S - 1) · Σ (a_i - r w_i)^2) / Σ w_i``. Where a few rows hold most of what a
    filter drops, as on LM-like data near a filter's edge, that error is large and a sample of a few
    hundred rows can miss those rows.

    ``shards``: ``c`` (and ``bias``, ``targets``' numbering, the tiles) is one vocabulary shard of a
    call's classifier (see :class:`~cce_autotune.planning.planner.Evidence`): each row's dE and
    dropped terms, and its dropped mass, are summed over the shards before the errors are taken, so
    every shard measures the whole vocabulary's error (a target's onehot term only on the shard that
    holds it: ``coef_t`` 0 elsewhere).

    Why one direction: a trained classifier's rarely used rows move together (every step pushes
    them along the mean hidden state), so the terms that a filter drops, ``sum_j p_ij C_j`` over
    those rows, point one way."""
    S, D = e_rows.shape
    V = c.shape[0]
    m = dead.shape[0]
    lse_f, w = _weights(lse)
    ws = w if coef_s is None else w * coef_s.to(w.dtype)
    wt = w if coef_t is None else w * coef_t.to(w.dtype)
    out = torch.zeros(((m + 1) * S, D), dtype=torch.float32, device=e_rows.device)
    mass = torch.zeros((m, S), dtype=torch.float32, device=e_rows.device)
    for v0 in range(0, V, chunk_v):
        v1 = min(V, v0 + chunk_v)
        p, t = _probs(e_rows, c, bias, softcap, lse_f, ws, v0, v1)
        d = dead.gather(2, col_tile[v0:v1].expand(m, S, -1))  # (m, S, columns)
        mass += torch.where(d, p[None], 0.0).sum(2, dtype=torch.float32)  # before the softcap derivative
        if t is not None:
            p = p * (1 - t * t)
        at = (targets - v0).clamp(0, v1 - v0 - 1).long()[:, None]
        hit = ((targets >= v0) & (targets < v1)).to(p.dtype) * wt
        if t is not None:
            hit = hit * (1 - t.gather(1, at).squeeze(1) ** 2)
        g = p.scatter_add(1, at, -hit[:, None])  # the whole gradient: softmax minus onehot
        stack = torch.cat([g[None], torch.where(d, p[None], 0.0)]).view((m + 1) * S, v1 - v0)
        out += _mm32(stack.to(e_rows.dtype), c[v0:v1])
        del p, g, d, stack
    if shards is not None:
        shards.sum_(out)
        shards.sum_(mass)
    out = out.view(m + 1, S, D)
    w_rows = out[0].pow(2).sum(1)  # (S,) each row's squared gradient norm
    drop = out[1:]
    raw = _bound(drop.pow(2).sum(2), w_rows, confidence)

    def fit(rows):  # least squares: argmin_u sum_i ||drop_i - a_i u||^2
        a = mass[:, rows]
        return (a[:, :, None] * drop[:, rows]).sum(1) / (a * a).sum(1).clamp_min(1e-30)[:, None]

    idx = torch.arange(S, device=e_rows.device)
    even, odd = idx[0::2], idx[1::2]
    left = torch.zeros((m, S), dtype=torch.float32, device=e_rows.device)
    for mine, other in ((even, odd), (odd, even)):
        u = fit(other)
        left[:, mine] = (drop[:, mine] - mass[:, mine, None] * u[:, None, :]).pow(2).sum(2)
    return raw, _bound(left, w_rows, confidence), fit(idx)


def _bound(a_rows: torch.Tensor, w_rows: torch.Tensor, z: float) -> torch.Tensor:
    """(m,) ``sqrt(Σ_i a[k, i] / Σ_i w[i])``, raised by ``z`` standard errors of the ratio inside (see
    :func:`filter_fit`)."""
    W = w_rows.sum().clamp_min(1e-30)
    r = a_rows.sum(1) / W
    if z > 0 and a_rows.shape[1] > 1:
        S = a_rows.shape[1]
        spread = (a_rows - r[:, None] * w_rows[None, :]).pow(2).sum(1)
        r = r + z * (spread * S / (S - 1)).sqrt() / W
    return r.sqrt()


def check(e: torch.Tensor, c: torch.Tensor, bias, rows: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
          softcap, tmap, block_b: int, block_v: int, candidates, *, sample: int, max_bytes: int,
          coef_s: torch.Tensor | None = None, coef_t: torch.Tensor | None = None, correctable: bool = False,
          admissible=None, max_error: float = MAX_ERROR, group: int = GROUP,
          confidence: float = CONFIDENCE, shards=None, weigh: bool = True) -> tuple:
    """``(index, measured, direction, plain)``: the position in ``candidates`` (filters, largest first)
    of the first whose measured dE error on this call stays within ``max_error``, or None (none does:
    run exact), for a backward that launches from the forward's tile map ``tmap``; ``measured``: the
    ``(candidate, error, corrected)`` triples measured. The candidates are measured lazily: the
    first alone, then ``group`` at a time, until one passes.

    ``correctable``: the backward can take the dead-tile correction (see :func:`filter_fit`). A
    candidate whose plain error passes runs plain; one whose plain error does not is taken with the
    correction where its corrected error passes, and ``direction`` (D,) fp32 is then the correction's
    direction (else None). The correction narrows the strategies that may run (not every one takes it),
    so when the chosen candidate needs it (and ``weigh`` asks for the alternative) the measuring goes
    on to the first candidate that passes plain: ``plain`` is its position (None: no such candidate,
    the chosen one is plain, or not ``weigh``), for the planner to weigh the two.
    ``admissible(filter_eps) -> bool``: whether a candidate may run at all (the planner's
    dropped-mass guard); one that may not is not measured and does not pass, so that the filter that
    runs drops what the check measured (and the direction was fitted to).

    A candidate's error is the upper bound of :func:`filter_fit` at ``confidence`` standard errors:
    what the whole call may drop, not what the sampled rows drop.

    ``e`` (any shape, rows of D), ``rows`` (n,): the row of e of each position; ``targets``,
    ``lse`` (n,): every position's (the LSE infinite where ignored); ``coef_s``, ``coef_t`` (n,):
    the gradient's coefficients (see :func:`filter_errors`); ``sample``: rows measured (spread over
    the call); ``max_bytes``: the check's transient memory. ``shards``: the call is one vocabulary
    shard of a larger one (see :func:`filter_fit`); the shards measure the same candidates, a
    candidate being admissible only where every shard admits it, so they choose alike."""
    cands = list(candidates)
    measured = []
    n, V = rows.shape[0], c.shape[0]
    idx = sample_rows(n, sample).to(rows.device)
    e_rows = e.reshape(-1, e.shape[-1])[rows[idx]]
    tile = column_tiles(V, block_v, tmap.perm, e.device)
    t_s, lse_s = targets[idx], lse[idx]
    cs = coef_s[idx] if coef_s is not None else None
    ct = coef_t[idx] if coef_t is not None else None

    def errors(eps_list):  # [(error, direction or None)] per candidate
        dead = map_dead(tmap, lse, idx, eps_list, V, block_b, block_v)
        width = chunk_columns(e_rows.shape[0], len(eps_list), V, max_bytes)
        raw, corr, dirs = filter_fit(e_rows, c, bias, t_s, lse_s, softcap, tile, dead, cs, ct, width, confidence, shards)
        out = []
        for k, (x, y) in enumerate(zip(raw.tolist(), corr.tolist())):
            fix = correctable and x > max_error and y < x
            out.append((y if fix else x, dirs[k] if fix else None))
            measured.append((eps_list[k], out[-1][0], fix))
        return out

    chosen = None  # (index, direction) of the first candidate that passes
    start = 0
    for size in (1, *(group,) * len(cands)):  # the first candidate, then ``group`` at a time
        part = cands[start:start + size]
        if not part:
            break
        res = [(math.inf, None)] * len(part)  # a candidate the guard would lower does not pass
        ok = [admissible is None or admissible(x) for x in part]
        if shards is not None:
            ok = [x > 0 for x in shards.min_([1.0 if y else 0.0 for y in ok])]
        allowed = [i for i, y in enumerate(ok) if y]
        for i, r in zip(allowed, errors([part[i] for i in allowed]) if allowed else ()):
            res[i] = r
        passed = [i for i, (x, _) in enumerate(res) if x <= max_error]
        if passed and chosen is None:
            chosen = start + passed[0], res[passed[0]][1]
            passed = passed[1:]
        if chosen is not None:
            if chosen[1] is None or not weigh:  # plain, or nothing to weigh it against
                return chosen[0], tuple(measured), chosen[1], None
            plain = next((i for i in passed if res[i][1] is None), None)
            if plain is not None:
                return chosen[0], tuple(measured), chosen[1], start + plain
        start += size
    if chosen is not None:
        return chosen[0], tuple(measured), chosen[1], None
    return None, tuple(measured), None, None

"""What a filter costs in accuracy, measured on a sample of rows: the relative error that skipping a
backward's negligible tiles puts into dE.

The tile map's bound (:func:`cce_autotune.tile_map.dropped_share`) bounds the softmax *mass* a
filter drops, not what that mass does to dE: row i loses ``sum_j p_ij C_j`` over its dropped
columns j, and the rare rows of a trained classifier share a direction, so those terms add up
instead of cancelling. On hidden states of a model trained on real text a filter that drops 5 % of
the mass gave dE errors of 1e-2 .. 4e-2 (H200, B = 8192), while on LM-like data 12 % gave 7e-3.

So the error is measured. :func:`choose_filter` takes :data:`ROWS` rows spread over the call,
recomputes their logits against the whole vocabulary (fp32 results, a vocabulary chunk at a time,
chunks sized to :data:`CHECK_BYTES`),
marks the softmax terms in the tiles that the live grid of the forward's tile map skips at each
candidate filter (:func:`map_dead`: exactly what the chunked strategy skips; the tile strategies'
own filter may skip a little more where the forward's tiles are wider than the backward's), and
compares ``||dE_dropped||`` with ``||dE||`` over those rows (:func:`filter_errors`). On the H200
(bf16, B = 8192, four heads, real and LM-like data) 256 rows estimated the whole call's error within
about 10 %, and all 8192 rows within 2 %.

The check costs two (ROWS x V x D) products per candidate measured: 4 to 10 ms at V = 128k .. 262k.
The backward runs it on the first mapped call of a classifier and then every :data:`CHECK_EVERY`
calls, and remembers which candidate passed (:func:`remembered`, :func:`remember`), keyed like
:mod:`cce_autotune.vocab_order` (a training step's in-place update keeps the key; the classifier
changes slowly between steps). When no candidate passes the call runs exact and the classifier is
paused for CHECK_EVERY calls, so the forward stops building maps until the next check.

The check also measures a correction (:func:`filter_fit`): the dropped terms of a trained
classifier's rarely used rows point one way, so the chunked backward can add them back along one
fitted direction, scaled by each row's softmax mass in the skipped tiles (which its kernel sums).
A candidate passes on the corrected error when the call can take the correction.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from .vocab_order import classifier_key as _key

__all__ = ["choose_filter", "filter_errors", "map_dead", "column_tiles", "sample_rows", "chunk_columns", "remembered",
           "remember", "clear", "filter_fit", "ROWS", "CHECK_EVERY", "MAX_ERROR", "CHECK_BYTES", "SCALES", "GROUP"]

# Rows sampled per check (spread evenly over the call's rows).
ROWS = 256
# Backward calls of a classifier between two checks.
CHECK_EVERY = 32
# The candidate filters, as factors of the call's filter_eps, largest first. The ladder is fine near
# the call's own filter: on real data the error fell 11x over four halvings of the filter (Llama 3.2
# 3B, training batch: 1.07e-2 at 2^-16, 9.8e-4 at 2^-20), while the live share, and so the cost of
# the backward, climbs fast (72-88 % at 2^-20: filtering no longer paid, the call ran exact).
SCALES = (1.0, 2.0**-1, 2.0**-2, 2.0**-3, 2.0**-4, 2.0**-6, 2.0**-8)
# Candidates measured together after the call's own filter failed (each group's logits recomputed).
GROUP = 3
# The largest estimated relative dE error a filter may cause. The gate the tuner applies to the
# whole dE is 1e-2; bf16 rounding adds about 2e-3 (exact mode), in quadrature, and the sample's
# noise was within 20 % on the H200 heads.
MAX_ERROR = 7e-3
# The check's transient memory, at most (its vocabulary chunks are sized to it: about 8,192 columns
# for 256 rows and one candidate). It runs before the backward allocates anything, so the call's peak
# is the larger of the two, not their sum.
CHECK_BYTES = 64 * 2**20


def chunk_columns(rows: int, candidates: int, V: int, max_bytes: int | None = None) -> int:
    """Vocabulary columns per chunk of :func:`filter_errors` for ``rows`` sampled rows and
    ``candidates`` filters: a power of two (256 .. 16,384, at most V rounded up) whose temporaries,
    about ``rows * columns * (18 + 11 * candidates)`` bytes (the fp32 logits, softmax and gradient,
    each candidate's masked copy and the 16-bit stack of all of them), stay within ``max_bytes``
    (default :data:`CHECK_BYTES`)."""
    cap = CHECK_BYTES if max_bytes is None else max_bytes
    per_col = max(1, rows) * (18 + 11 * max(1, candidates))
    w = 256
    while w < 16384 and w < V and 2 * w * per_col <= cap:
        w *= 2
    return w


def sample_rows(n: int, rows: int = ROWS) -> torch.Tensor:
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
    from .tile_map import live_grid

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
                  chunk_v: int | None = None) -> torch.Tensor:
    """(m,) fp32 on the rows' device: for each of ``dead``'s m candidates, the relative L2 error that
    dropping the softmax terms of its dead tiles puts into the sampled rows' dE.

    ``e_rows`` (S, D), ``targets``, ``lse`` (S,): the sampled rows (an infinite LSE marks a row
    without gradient); ``col_tile`` (V,): each vocabulary entry's tile (:func:`column_tiles`);
    ``dead`` (m, S, tiles) bool: e.g. :func:`map_dead`; ``coef_s``, ``coef_t`` (S,): the rows'
    gradient coefficients, ``g = coef_s * softmax - coef_t * onehot`` (token weights, reduction,
    z-loss, label smoothing; default 1). A target's onehot term is never dropped (the kernels add it
    outside a skipped tile)."""
    return filter_fit(e_rows, c, bias, targets, lse, softcap, col_tile, dead, coef_s, coef_t, chunk_v)[0]


def filter_fit(e_rows: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               lse: torch.Tensor, softcap: float | None, col_tile: torch.Tensor, dead: torch.Tensor,
               coef_s: torch.Tensor | None = None, coef_t: torch.Tensor | None = None,
               chunk_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(raw, corrected, direction)`` for the arguments of :func:`filter_errors`: ``raw`` (m,) its
    errors; ``corrected`` (m,) the errors left when the dropped terms of row i are replaced by
    ``a_i * direction``, ``a_i = coef_s[i] * (row i's softmax mass in the dead tiles)`` (what the
    chunked backward adds with ``dead_dir``); ``direction`` (m, D) fp32, fitted by least squares on
    all the sampled rows. ``corrected`` is measured out of sample: the rows at even sample positions
    are corrected with the direction fitted on the odd ones, and the reverse.

    Why one direction: a trained classifier's rarely used rows move together (every step pushes
    them along the mean hidden state), so the terms that a filter drops, ``sum_j p_ij C_j`` over
    those rows, point one way. On the H200 (bf16, B = 8192, real data) the correction removed 90-97 %
    of the error at filters 2^-12 .. 2^-19 (Gemma 3 4B at 2^-16: 1.1e-2 -> 4e-4)."""
    S, D = e_rows.shape
    V = c.shape[0]
    m = dead.shape[0]
    lse_f, w = _weights(lse)
    if chunk_v is None:
        chunk_v = chunk_columns(S, m, V)
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
    out = out.view(m + 1, S, D)
    whole = out[0].norm().clamp_min(1e-30)
    drop = out[1:]
    raw = drop.reshape(m, -1).norm(dim=1) / whole

    def fit(rows):  # least squares: argmin_u sum_i ||drop_i - a_i u||^2
        a = mass[:, rows]
        return (a[:, :, None] * drop[:, rows]).sum(1) / (a * a).sum(1).clamp_min(1e-30)[:, None]

    idx = torch.arange(S, device=e_rows.device)
    even, odd = idx[0::2], idx[1::2]
    left = torch.zeros(m, dtype=torch.float32, device=e_rows.device)
    for mine, other in ((even, odd), (odd, even)):
        u = fit(other)
        left += (drop[:, mine] - mass[:, mine, None] * u[:, None, :]).pow(2).sum((1, 2))
    return raw, left.sqrt() / whole, fit(idx)


def choose_filter(e: torch.Tensor, c: torch.Tensor, bias, rows: torch.Tensor, targets: torch.Tensor,
                  lse: torch.Tensor, softcap, tmap, block_b: int, block_v: int, filter_eps: float,
                  scales, coef_s: torch.Tensor | None = None, coef_t: torch.Tensor | None = None,
                  correctable: bool = False, admissible=None) -> tuple[float | None, tuple, torch.Tensor | None]:
    """``(filter_eps, measured, direction)``: the largest of ``filter_eps * scales`` whose measured dE
    error on this call stays within :data:`MAX_ERROR`, or None (none does: run exact), for a
    backward that launches from the forward's tile map ``tmap``; remembered per classifier and
    measured again every :data:`CHECK_EVERY` calls. ``measured``: the ``(candidate, error,
    corrected)`` triples this call measured (empty when the choice was remembered or the check is
    off).

    ``correctable``: the backward can take the dead-tile correction (a chunked plan; see
    :func:`filter_fit`). A candidate's error is then the corrected one where that is smaller, and
    ``direction`` (D,) fp32 is the correction's direction when the chosen candidate needs it (else
    None: the plain filter). ``admissible(filter_eps) -> bool``: whether a candidate may run at all
    (the planner's dropped-mass guard); one that may not is not measured and does not pass, so that
    the filter that runs drops what the check measured (and the direction was fitted to).

    ``e`` (any shape, rows of D), ``rows`` (n,): the row of e of each position; ``targets``,
    ``lse`` (n,): every position's (the LSE infinite where ignored); ``coef_s``, ``coef_t`` (n,):
    the gradient's coefficients (see :func:`filter_errors`). The candidates are measured lazily: the
    call's own filter first, then :data:`GROUP` at a time, until one passes."""
    if not MAX_ERROR < float("inf"):
        return filter_eps, (), None
    cands = [filter_eps * s for s in scales]
    hit = remembered(c, filter_eps, correctable)
    if hit is not None:
        return cands[hit[0]], (), hit[1]
    measured = []
    n, V = rows.shape[0], c.shape[0]
    idx = sample_rows(n).to(rows.device)
    e_rows = e.reshape(-1, e.shape[-1])[rows[idx]]
    tile = column_tiles(V, block_v, tmap.perm, e.device)
    t_s, lse_s = targets[idx], lse[idx]
    cs = coef_s[idx] if coef_s is not None else None
    ct = coef_t[idx] if coef_t is not None else None

    def errors(eps_list):  # [(error, direction or None)] per candidate
        dead = map_dead(tmap, lse, idx, eps_list, V, block_b, block_v)
        raw, corr, dirs = filter_fit(e_rows, c, bias, t_s, lse_s, softcap, tile, dead, cs, ct)
        out = []
        for k, (x, y) in enumerate(zip(raw.tolist(), corr.tolist())):
            fix = correctable and y < x
            out.append((y if fix else x, dirs[k] if fix else None))
            measured.append((eps_list[k], out[-1][0], fix))
        return out

    choice, start, direction = len(cands), 0, None
    for size in (1, *(GROUP,) * len(cands)):  # the call's own filter, then GROUP candidates at a time
        group = cands[start:start + size]
        if not group:
            break
        res = [(math.inf, None)] * len(group)  # a candidate the guard would lower does not pass
        allowed = [i for i, x in enumerate(group) if admissible is None or admissible(x)]
        for i, r in zip(allowed, errors([group[i] for i in allowed]) if allowed else ()):
            res[i] = r
        passed = [i for i, (x, _) in enumerate(res) if x <= MAX_ERROR]
        if passed:
            choice, direction = start + passed[0], res[passed[0]][1]
            break
        start += size
    if choice < len(cands):  # (an exact verdict is not remembered: the caller pauses the classifier)
        remember(c, filter_eps, choice, direction=direction)
    return (cands[choice] if choice < len(cands) else None), tuple(measured), direction


# ----------------------------------------------------------------------------------------------
# Which candidate passed, remembered per classifier

MAX_ENTRIES = 8
_lock = threading.Lock()
# key -> [filter_eps asked, choice, calls left, direction]
_memo: "OrderedDict[tuple, list]" = OrderedDict()


def remembered(c: torch.Tensor, filter_eps: float, correctable: bool = False) -> tuple | None:
    """``(candidate index, direction or None)`` last chosen for classifier ``c`` at ``filter_eps`` (one
    call fewer left), or None when a check is due (none remembered, another filter asked, a
    correction remembered that this call cannot take, or its calls used up). The direction of the
    dead-tile correction stays as the check fitted it: the classifier moves slowly between checks."""
    key = _key(c)
    with _lock:
        entry = _memo.get(key)
        if entry is None or entry[0] != filter_eps or entry[2] <= 0 or (entry[3] is not None and not correctable):
            return None
        entry[2] -= 1
        _memo.move_to_end(key)
        return entry[1], entry[3]


def remember(c: torch.Tensor, filter_eps: float, choice: int, calls: int | None = None,
             direction: torch.Tensor | None = None) -> None:
    """Keep ``choice`` (and the correction's ``direction``, if any) for the next ``calls`` (default
    :data:`CHECK_EVERY`) backward calls of classifier ``c`` at ``filter_eps``."""
    calls = CHECK_EVERY if calls is None else calls
    key = _key(c)
    with _lock:
        _memo[key] = [filter_eps, choice, calls, direction]
        _memo.move_to_end(key)
        while len(_memo) > MAX_ENTRIES:
            _memo.popitem(last=False)


def clear() -> None:
    """Forget every remembered choice (the next call of each classifier checks afresh)."""
    with _lock:
        _memo.clear()

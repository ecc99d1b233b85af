"""Launch helpers the strategies share: how the kernels address the rows of E, the structural
flags of a call, the arguments of a backward, the onehot terms added outside the kernels, and
products into fp32 accumulators.

The kernels address the rows of E through a :class:`RowLayout`: either densely (row i at
``i * stride``) or through int64 element offsets of each row that takes part, so that ignored rows,
``shift`` and non-contiguous batch layouts cost no copy of E.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from ..codegen import Flags, interpreting, load_utility
from ..launch import cdiv, next_power_of_2

__all__ = ["RowLayout", "BackwardArgs", "flags", "softcap_arg", "convert_rows", "scale_in_place", "target_weight",
           "add_target_terms", "add_matmul", "add_matmul_fp32", "mm_out", "tma_descriptors"]


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


@dataclass
class BackwardArgs:
    """The tensors and settings of one backward, as :func:`cce_autotune.runtime.execute.backward`
    hands them to a strategy (whose :class:`~cce_autotune.plans.BackwardPlan` says how to run).

    ``target_pos[i]`` is the column position of row i's target in the walked vocabulary order (its
    vocabulary index, or ``inv_perm[target]`` when ``perm`` is given); ``targets`` the vocabulary index.
    The gradient of row i's logits is ``softmax * coef_s[i] - onehot * coef_t[i]`` (times the softcap
    derivative). ``coef_out``: with a map, the onehot coefficient of rows whose target tile is not
    launched (0 for the others: their term is added inside a launched tile); None without a map.
    ``variant``: the call's BackwardVariant with the plan's strategy, filter and order in it.
    ``tile_map``, ``live``, ``blocks``: the forward's map, its live grid at the variant's tiling, and
    the strategy's live blocks (with a mapped plan; else None); ``columns``: the count of live tiles
    in each column of ``live``, on the host (None: the strategy counts them itself, with a copy). ``dc_dtype``: dC's dtype when it is
    not c's (``c`` a converted copy of a wider classifier). ``correction``: the (D,) fp32 direction of
    the dead-tile correction (strategies that take it), or None. ``costs``: the GPU's cost model (the
    launch constants chosen on it)."""

    e: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor | None
    rows: RowLayout
    target_pos: torch.Tensor
    targets: torch.Tensor
    lse: torch.Tensor
    coef_s: torch.Tensor
    coef_t: torch.Tensor
    coef_out: torch.Tensor | None
    perm: torch.Tensor | None
    softcap: float | None
    filter_eps: float | None
    variant: Any
    tile_map: Any = None
    live: torch.Tensor | None = None
    blocks: list | None = None
    columns: list | None = None
    dc_dtype: torch.dtype | None = None
    deterministic: bool = False
    correction: torch.Tensor | None = None
    costs: Any = None


def flags(e: torch.Tensor, c: torch.Tensor, bias, softcap, block_d: int, rows: RowLayout, **extra) -> Flags:
    """The structural switches of a launch (each an ``{% if %}`` in the templates)."""
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


_BOX = 256  # the most elements a TMA box holds along one dimension


def tma_descriptors(e, c, n_rows: int, row_stride: int | None, variant, c_by_position: bool) -> tuple:
    """``(E, C)``: each operand of a kernel's logit tiles as a TMA tensor descriptor where the hardware
    and the layout allow it, else None (the kernel loads it through pointers). E: ``variant``'s
    block_b x block_d tiles of rows from row 0, where rows are dense (``row_stride``: row i of the
    problem at ``i * row_stride`` of e; None: gathered). C: block_v x block_d tiles, where its rows are
    walked by position (``c_by_position``: the natural order, or a window converted in the walked
    order; a walked order reads gathered rows of C) and C is of e's dtype. Both: 16-bit e, contiguous
    along D, 16-byte aligned bases and row strides, tiles within a TMA box, a GPU of compute
    capability 9 or more (or Triton's interpreter). Rows, columns and D beyond the tensor read as zeros.
    Measured on the H200: exact calls' forward 13-15 % faster, forward and backward 4-7 %
    (benchmarks/NOTES.md row 110); E's alone in a walked order neither faster nor slower (row 114)."""
    desc_type = _descriptor_type()
    if desc_type is None or e.element_size() != 2 or n_rows == 0:
        return None, None
    if not (e.device.type == "cpu" and interpreting()) and not _tma_device(e.device):
        return None, None
    if max(variant.block_b, variant.block_v, variant.block_d) > _BOX or variant.block_d * 2 < 16:
        return None, None
    D = e.shape[-1]
    e_desc = c_desc = None
    if row_stride is not None and e.stride(-1) == 1 and (row_stride * 2) % 16 == 0 and e.data_ptr() % 16 == 0:
        e_desc = desc_type(e, [n_rows, D], [row_stride, 1], [variant.block_b, variant.block_d])
    if c_by_position and c.dtype == e.dtype and c.shape[0] > 0 and c.stride(1) == 1 \
            and (c.stride(0) * 2) % 16 == 0 and c.data_ptr() % 16 == 0:
        c_desc = desc_type(c, [c.shape[0], D], [c.stride(0), 1], [variant.block_v, variant.block_d])
    return e_desc, c_desc


_FOUND: dict = {}


def _descriptor_type():
    """Triton's host-side ``TensorDescriptor`` (None on a Triton without it)."""
    if "type" not in _FOUND:
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor
        except ImportError:
            TensorDescriptor = None
        _FOUND["type"] = TensorDescriptor
    return _FOUND["type"]


def _tma_device(device) -> bool:
    """Whether ``device`` is a CUDA GPU with TMA (compute capability 9.0 or more: Hopper, Blackwell)."""
    if device.type != "cuda":
        return False
    key = ("tma", device.index)
    if key not in _FOUND:
        _FOUND[key] = torch.cuda.get_device_capability(device)[0] >= 9
    return _FOUND[key]


def softcap_arg(softcap) -> float:
    """The softcap as the kernels take it (1.0 when there is none: the flag switches it off)."""
    return float(softcap) if softcap is not None else 1.0


def convert_rows(c: torch.Tensor, lo: int, w: int, perm: torch.Tensor | None, buf: torch.Tensor) -> torch.Tensor:
    """Rows lo..lo+w of the classifier (in the order ``perm`` when given), rounded to nearest in
    ``buf``'s dtype, into ``buf`` (one launch of ``templates/convert.py.j2``: no fp32 staging copy);
    returns the filled view."""
    out = buf[:w]
    D = c.shape[1]
    kernel = load_utility("convert.py.j2", "cce_convert_rows_kernel", GATHER=perm is not None)
    block_d = min(128, next_power_of_2(D))
    grid = (cdiv(w, 32), cdiv(D, block_d))
    kernel[grid](c, perm if perm is not None else c, out, lo, w, D, c.stride(0), c.stride(1), out.stride(0),
                 BLOCK_R=32, BLOCK_D=block_d, num_warps=4)
    return out


def scale_in_place(t: torch.Tensor, factor: torch.Tensor) -> None:
    """``t`` (contiguous) times ``factor`` (a 0-d fp32 tensor on its device), in fp32, rounded once to
    t's dtype, in place and without a host sync: one launch of ``templates/scale.py.j2``. (PyTorch
    multiplies a 16-bit tensor by a 0-d fp32 device tensor with its unvectorised broadcast kernel, and
    ``_foreach_mul_`` falls back to it: 0.68 ms for Mistral's dE and dC on the H200, about 5x their
    memory traffic.)"""
    if not t.is_contiguous():
        raise ValueError("t: scale_in_place needs a contiguous tensor")
    n = t.numel()
    if n == 0:
        return
    kernel = load_utility("scale.py.j2", "cce_scale_kernel")
    block = 4096
    kernel[(cdiv(n, block),)](t, factor, n, BLOCK=block, num_warps=4)


def target_weight(coef_t, zt, softcap) -> torch.Tensor:
    """Weight of a row's onehot term: coef_t times the softcap derivative at the target logit."""
    w = coef_t.float()
    if softcap is not None:
        w = w * (1.0 - (zt.float() / float(softcap)) ** 2)
    return w


def add_target_terms(c, e2, rows: RowLayout, targets, coef_out, zt, softcap, acc, dc, dbias) -> None:
    """The onehot terms of the rows whose target tile was not launched, weight w = coef_out times the
    softcap derivative at the target logit (0 for the other rows, which add nothing):
    acc[row i] -= w_i c[t_i], dc[t_i] -= w_i e_i and dbias[t_i] -= w_i (acc, dc: fp32 or the input
    dtype; products and sums in fp32, one rounding each). One stable sort of the targets and one
    launch of ``templates/target_terms.py.j2``: the rows of a target are summed by one program in a
    fixed order, so every run gives the same bits, and no host sync."""
    n, D = targets.shape[0], e2.shape[1]
    if n == 0:
        return
    w = target_weight(coef_out, zt, softcap).contiguous()
    tgt, order = torch.sort(targets, stable=True)
    end = torch.searchsorted(tgt, tgt, right=True)
    row_idx = rows.row_index(D)
    kernel = load_utility("target_terms.py.j2", "cce_target_terms_kernel")
    block_d = min(256, next_power_of_2(D))
    kernel[(n, cdiv(D, block_d))](
        c, e2, row_idx, order, tgt, end, w, acc, dc, dbias if dbias is not None else w, n, D,
        c.stride(0), c.stride(1), e2.stride(0), e2.stride(1), acc.stride(0), acc.stride(1),
        dc.stride(0), dc.stride(1),
        BLOCK_D=block_d, BLOCK_R=16, HAS_DBIAS=dbias is not None, num_warps=2)


_MM_FP32_OUT: list = []  # whether mm's out_dtype works here, found on the first CUDA call


def mm_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out = a @ b in out's dtype: of a's dtype as cuBLAS writes it (fp32 inside, one rounding), or
    fp32 from 16-bit a, b with no rounding of the product to 16 bits where this PyTorch offers it
    (mm's out_dtype on CUDA); elsewhere the product of the upcast operands on the CPU, or the 16-bit
    product on a GPU without out_dtype."""
    if a.dtype == out.dtype:
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


def add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b: into an fp32 accumulator without rounding the product, or into a 16-bit one
    with cuBLAS's fp32 arithmetic and one rounding."""
    if acc.dtype == torch.float32:
        add_matmul_fp32(acc, a, b)
    else:
        acc.addmm_(a, b)


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _mm_add_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    acc.add_(torch.mm(a, b, out_dtype=torch.float32))


_FP32_WAYS = (_addmm_fp32, _mm_add_fp32)
_FP32_OUT_MM: list = []  # the way add_matmul_fp32 found to work on its first CUDA call (None: neither)


def add_matmul_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
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

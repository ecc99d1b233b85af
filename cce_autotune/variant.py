"""Typed knobs of one kernel variant: validation, (de)serialisation, a stable hash.

A *variant* is everything that changes the generated source or the launch of one of the three
kernels (indexed dot, LSE forward, backward).  Variants are plain frozen dataclasses so that they can
be hashed, compared, stored in YAML (``to_dict`` / ``from_dict``) and printed.

Feature flags of a *call* (bias, softcap, dtype, ...) are not part of a variant: they are passed to
the code generator separately, because one tuned variant serves every call with the same key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from . import strategies

__all__ = [
    "VariantError",
    "IndexedDotVariant",
    "LSEForwardVariant",
    "BackwardVariant",
    "KernelVariants",
    "KERNELS",
    "variant_from_dict",
    "DEFAULT_SMEM_BYTES",
]

# Shared memory a block may use when the device is unknown (Hopper opt-in limit is 227 KiB; we keep
# a margin because Triton adds its own scratch on top of the operand buffers).
DEFAULT_SMEM_BYTES = 227 * 1024


class VariantError(ValueError):
    """A kernel variant's knobs are invalid (names the knob and the reason)."""


def _pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and (x & (x - 1)) == 0


def _check_pow2(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not _pow2(value) or not lo <= value <= hi:
        raise VariantError(f"{name}={value!r}: must be a power of two in [{lo}, {hi}]")


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise VariantError(f"{name}={value!r}: must be an integer in [{lo}, {hi}]")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise VariantError(f"{name}={value!r}: must be one of {list(choices)}")


@dataclass(frozen=True)
class _Variant:
    """Knobs shared by every kernel."""

    kernel: ClassVar[str] = ""
    # Knobs of earlier versions that no kernel reads any more: dropped when a variant is read.
    RETIRED: ClassVar[tuple] = ()
    num_warps: int = 4
    num_stages: int = 2

    def validate(self, elem_bytes: int = 2, smem_limit: int | None = DEFAULT_SMEM_BYTES) -> "_Variant":
        """Raise :class:`VariantError` if a knob is out of range or the variant cannot fit the device.

        ``elem_bytes`` is the size of one input element (2 for bf16/fp16, 4 for fp32) and
        ``smem_limit`` the shared memory one block may use on the target device (None: skip).
        Returns ``self`` so that ``v = Variant(...).validate()`` reads naturally.
        """
        _check_pow2("num_warps", self.num_warps, 1, 16)
        _check_int("num_stages", self.num_stages, 1, 8)
        self._validate_own()
        if smem_limit is not None:
            need = self.smem_bytes(elem_bytes)
            if need > smem_limit:
                raise VariantError(
                    f"{self.kernel}: needs about {need} bytes of shared memory, device allows {smem_limit}"
                )
        return self

    def _validate_own(self) -> None:  # pragma: no cover - overridden
        pass

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Estimate of the shared memory one block needs (operand pipeline buffers)."""
        return 0

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"kernel": self.kernel, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "_Variant":
        data = dict(data)
        kernel = data.pop("kernel", cls.kernel)
        if kernel != cls.kernel:
            raise VariantError(f"kernel={kernel!r}: expected {cls.kernel!r}")
        for name in cls.RETIRED:
            data.pop(name, None)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise VariantError(f"{cls.kernel}: unknown knob(s) {unknown}; known: {sorted(names)}")
        return cls(**data)

    def stable_hash(self) -> str:
        """A short hash that depends only on the knob values (stable across processes)."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def replace(self, **changes: Any) -> "_Variant":
        return dataclasses.replace(self, **changes)

    @property
    def template(self) -> str:
        """The Jinja2 template this variant renders."""
        return f"{self.kernel}.py.j2"

    @property
    def kernel_function(self) -> str:
        """Name of the @triton.jit function in the rendered module."""
        return f"cce_{self.kernel}_kernel"

    def template_knobs(self) -> dict:
        """The knobs as the templates see them (upper-case names)."""
        return {k.upper(): v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class IndexedDotVariant(_Variant):
    """Target-logit kernel: each program gathers BLOCK_B rows of C (one per target) and dots them."""

    kernel: ClassVar[str] = "indexed_dot"
    block_b: int = 32
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 2

    def _validate_own(self) -> None:
        _check_pow2("block_b", self.block_b, 1, 256)
        _check_pow2("block_d", self.block_d, 16, 1024)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return 0  # no tl.dot, nothing staged in shared memory by design


@dataclass(frozen=True)
class _TiledVariant(_Variant):
    """Knobs of the two kernels that tile the (tokens x vocabulary) logit matrix.

    ``flatten`` (the tile loop and the D loop as one ``tl.range(flatten=True)`` loop; kernels of one
    tile a program made persistent) was retired on 2026-12-05: slower than the plain loops at every
    head measured on the H200. Files of earlier versions that carry it still load (``RETIRED``)."""

    RETIRED: ClassVar[tuple] = ("flatten",)  # retired 2026-12-05: measured slower on the H200

    block_b: int = 128
    block_v: int = 128
    block_d: int = 64
    group_b: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def _validate_own(self) -> None:
        _check_pow2("block_b", self.block_b, 16, 256)
        _check_pow2("block_v", self.block_v, 16, 512)
        _check_pow2("block_d", self.block_d, 16, 256)
        _check_pow2("group_b", self.group_b, 1, 256)
        # One fp32 accumulator tile per program; beyond 128 KiB of registers (64K fp32 values per
        # 1024 threads... i.e. 256 values per thread) Triton spills heavily: rule those out.
        threads = 32 * self.num_warps
        per_thread = self.block_b * self.block_v // threads
        if per_thread > 256:
            raise VariantError(
                f"{self.kernel}: block_b*block_v/threads={per_thread} fp32 accumulators per thread "
                f"(> 256): too few warps ({self.num_warps}) for a {self.block_b}x{self.block_v} tile"
            )

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        # Software pipelining keeps up to num_stages copies of the E and C operand tiles.
        return (self.block_b + self.block_v) * self.block_d * elem_bytes * self.num_stages + 1024


@dataclass(frozen=True)
class LSEForwardVariant(_TiledVariant):
    """Blockwise log-sum-exp.

    The grid is (row blocks x ``num_splits``): each program walks a contiguous range of vocabulary
    tiles for one row block, keeping a running (max, sum) in registers.  ``merge`` says how the
    ``num_splits`` partial results of a row meet:

    - ``"buffer"``: each program writes its partial LSE to a (num_splits, B) buffer that a tiny
      reduction merges afterwards (no locks, deterministic);
    - ``"lock"``: programs merge into the (B,) result under a spin lock; row block ``b`` uses lock
      ``b % num_locks``.
    """

    kernel: ClassVar[str] = "lse_forward"
    num_splits: int = 16
    merge: str = "buffer"
    num_locks: int = 64

    def _validate_own(self) -> None:
        super()._validate_own()
        _check_int("num_splits", self.num_splits, 1, 4096)
        _check_choice("merge", self.merge, ("buffer", "lock"))
        _check_pow2("num_locks", self.num_locks, 1, 4096)


@dataclass(frozen=True)
class BackwardVariant(_TiledVariant):
    """The knobs of the gradients' kernels: tiles of (block_b tokens x block_v vocabulary) recomputed,
    (softmax - onehot) * dloss formed, negligible tiles skipped, dE and dC accumulated.

    - ``filter_eps``: skip a tile when every softmax value in it is below this (and it holds no
      target); ``None`` computes the exact gradient.
    - ``sort_vocab``: walk the vocabulary ordered by descending average logit so that the few live
      columns cluster into few tiles.
    - ``tile_map``: (filtered, sorted) the forward walks the vocabulary in the order the previous
      backward of the same classifier sorted it into and records, per row and tile, a bound on the
      largest logit (one byte each); the backward then computes only the tiles that bound leaves
      live instead of recomputing all of them, and adds the target (onehot) terms of dead tiles
      itself. The first call of a classifier has no order yet and runs as without the map. See
      :mod:`cce_autotune.tile_map`.
    - ``strategy``: how the gradients are computed: ``"auto"`` lets the planner choose per call from
      the live share the tile map measures, the cost model and the memory budget
      (:mod:`cce_autotune.planning.planner`); the name of a strategy of :mod:`cce_autotune.strategies`
      is honoured when it fits the budget.
    - The knobs that only some strategies read: ``chunk_v`` (the chunked strategy's widest chunk) and
      ``out_block_d`` (the D width of the sparse strategy's dE / dC passes and of the chunked
      strategy's products by live tile); each strategy's module lists its own (``Strategy.knobs``).

    ``accum`` and ``num_locks`` were the knobs of the tiles strategy, removed (it lost on the device
    wherever the planner chose it); files of earlier versions that carry them (or the tiled
    variants' retired ``flatten``) still load (``RETIRED``), the knobs dropped.
    """

    kernel: ClassVar[str] = "backward"
    RETIRED: ClassVar[tuple] = _TiledVariant.RETIRED + ("accum", "num_locks")
    filter_eps: float | None = 2.0**-16
    sort_vocab: bool = True
    strategy: str = "auto"
    chunk_v: int = 4096
    tile_map: bool = True
    out_block_d: int = 128

    @property
    def template(self) -> str:
        return strategies.get(self.strategy).template

    @property
    def kernel_function(self) -> str:
        return strategies.get(self.strategy).kernel_function

    def _validate_own(self) -> None:
        super()._validate_own()
        if self.filter_eps is not None:
            if isinstance(self.filter_eps, bool) or not isinstance(self.filter_eps, (int, float)):
                raise VariantError(f"filter_eps={self.filter_eps!r}: must be a float in (0, 1) or None")
            if not 0.0 < float(self.filter_eps) < 1.0:
                raise VariantError(f"filter_eps={self.filter_eps!r}: must be in (0, 1) or None (exact)")
        if not isinstance(self.sort_vocab, bool):
            raise VariantError(f"sort_vocab={self.sort_vocab!r}: must be true or false")
        _check_choice("strategy", self.strategy, ("auto", *strategies.names()))
        _check_pow2("out_block_d", self.out_block_d, 16, 256)
        _check_pow2("chunk_v", self.chunk_v, 16, 65536)
        if not isinstance(self.tile_map, bool):
            raise VariantError(f"tile_map={self.tile_map!r}: must be true or false")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        recompute = super().smem_bytes(elem_bytes)
        # Gradient phase (measured: Triton's OutOfResources figures on an H200 match this exactly):
        # the (block_b x block_v) gradient tile staged twice (as itself and transposed, for the dE
        # and dC dots) plus one E and one C chunk per stage.
        grad = (2 * self.block_b * self.block_v + (self.block_b + self.block_v) * self.block_d * self.num_stages) * elem_bytes
        # (The sparse strategy's dE / dC passes take as many of num_stages as fit: not counted.)
        return max(recompute, grad) + 1024


KERNELS: dict[str, type[_Variant]] = {
    cls.kernel: cls for cls in (IndexedDotVariant, LSEForwardVariant, BackwardVariant)
}


def variant_from_dict(data: Mapping[str, Any]) -> _Variant:
    """Build the variant named by ``data["kernel"]``."""
    kernel = data.get("kernel")
    if kernel not in KERNELS:
        raise VariantError(f"kernel={kernel!r}: must be one of {sorted(KERNELS)}")
    return KERNELS[kernel].from_dict(data)


@dataclass(frozen=True)
class KernelVariants:
    """One variant per kernel: what a single ``linear_cross_entropy`` call runs."""

    indexed_dot: IndexedDotVariant = field(default_factory=IndexedDotVariant)
    lse_forward: LSEForwardVariant = field(default_factory=LSEForwardVariant)
    backward: BackwardVariant = field(default_factory=BackwardVariant)

    def __post_init__(self):
        # The set as JSON text, made once: what linear_cross_entropy hands its operator (a plain
        # string, which torch.compile's tracer takes as a constant; it cannot rebuild the object).
        try:
            text = json.dumps(self.to_dict(), sort_keys=True)
        except (AttributeError, TypeError):  # not variants inside: validate() says what is wrong
            text = None
        object.__setattr__(self, "json_text", text)

    @classmethod
    def defaults(cls, elem_bytes: int = 2) -> "KernelVariants":
        """The built-in defaults: a portable middle-of-the-road tiling (128 x 128 x 64, 8 warps, 3
        stages) that fits the shared memory of every supported GPU (A100's 163 KiB included); fp32
        inputs, twice as wide, take 64-row backward tiles and 32-wide D steps to fit as well."""
        if elem_bytes <= 2:
            return cls()
        return cls(
            lse_forward=LSEForwardVariant(block_d=32),
            backward=BackwardVariant(block_b=64, block_d=32, num_stages=2),
        )

    def validate(self, elem_bytes: int = 2, smem_limit: int | None = DEFAULT_SMEM_BYTES) -> "KernelVariants":
        for v in (self.indexed_dot, self.lse_forward, self.backward):
            v.validate(elem_bytes, smem_limit)
        return self

    def to_dict(self) -> dict:
        return {k: getattr(self, k).to_dict() for k in KERNELS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "KernelVariants":
        unknown = sorted(set(data) - set(KERNELS))
        if unknown:
            raise VariantError(f"variants: unknown kernel(s) {unknown}; known: {sorted(KERNELS)}")
        return cls(**{k: KERNELS[k].from_dict(v) for k, v in data.items()})

    def replace(self, **changes: Any) -> "KernelVariants":
        return dataclasses.replace(self, **changes)

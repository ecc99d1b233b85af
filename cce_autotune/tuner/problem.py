"""What is tuned: the problem (shape, dtype, features), the correctness gate, and one study's spec."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from .. import codegen
from ..configdb.store import EntryKey
from ..variant import KERNELS, KernelVariants, _Variant
from .space import SpaceContext

KERNEL_NAMES = tuple(KERNELS)
GRADIENT_ERRORS = ("dE", "dC", "dbias")
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DATA_KINDS = ("lm", "real")  # what the GPU backend tunes on (cce_autotune.data.make_data)


# -- what is tuned ------------------------------------------------------------------------------
def _bucket(B: int) -> int:
    return 1 if B <= 1 else 1 << round(math.log2(B))


@dataclass(frozen=True)
class TuningProblem:
    """The shape and features one study tunes for (B is already a power-of-two bucket)."""

    B: int
    V: int
    D: int
    dtype: str = "bf16"
    has_bias: bool = False
    has_softcap: bool = False
    softcap: float = 30.0  # value used when has_softcap
    seed: int = 0  # of the data
    data: str = "lm"  # the tuner's data: "lm" (LM-like, synthetic), "real" (cce_autotune.data.real) or
    # the path of an activation file (cce_autotune.data.captured), whose content digest is ``data_id``
    data_id: str = ""

    def __post_init__(self):
        if self.dtype not in _BYTES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(_BYTES)}")
        if self.data not in DATA_KINDS and not self.data_id:
            raise ValueError(f"data: {self.data!r} is not one of {list(DATA_KINDS)} (an activation file needs "
                             "its data_id)")
        for n in ("B", "V", "D"):
            if getattr(self, n) <= 0:
                raise ValueError(f"{n}: must be positive, got {getattr(self, n)}")

    @property
    def elem_bytes(self) -> int:
        return _BYTES[self.dtype]

    def space_context(self, smem_limit: int | None) -> SpaceContext:
        return SpaceContext(self.B, self.V, self.D, self.elem_bytes, smem_limit)

    def describe(self) -> str:
        flags = "".join(f" +{f[4:]}" for f in ("has_bias", "has_softcap") if getattr(self, f))
        return f"{self.dtype} B={self.B} V={self.V} D={self.D}{flags}"


@dataclass(frozen=True)
class Gate:
    """Correctness gate: relative L2 errors against the exact result."""

    max_grad_error: float = 1e-2  # dE, dC, dbias
    max_value_error: float = 1e-3  # loss, lse, target logits

    def failure(self, errors: Mapping[str, float]) -> str | None:
        """Why ``errors`` fail the gate, or None."""
        bad = []
        for name, err in errors.items():
            limit = self.max_grad_error if name in GRADIENT_ERRORS else self.max_value_error
            if not (isinstance(err, (int, float)) and math.isfinite(err)) or err > limit:
                bad.append(f"{name} error {err:.3g} > {limit:g}")
        return "; ".join(bad) or None


@dataclass(frozen=True)
class StudySpec:
    """One study: a kernel of one GPU on one problem, with its trial budget and gate."""

    gpu: str
    kernel: str
    problem: TuningProblem
    n_trials: int = 50
    gate: Gate = Gate()

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel: {self.kernel!r} is not one of {list(KERNELS)}")

    @property
    def key(self) -> EntryKey:
        p = self.problem
        return EntryKey(self.kernel, p.dtype, p.B, p.V, p.D, p.has_bias, p.has_softcap)

    @property
    def name(self) -> str:
        """Study name: the key, the template it measures and the gate (a change of any is a new study)."""
        p = self.problem
        return (
            f"cce:{self.gpu}:{self.kernel}:{p.dtype}:B{p.B}:V{p.V}:D{p.D}:bias{int(p.has_bias)}:"
            f"softcap{int(p.has_softcap)}:tpl-{codegen.template_hash(self.kernel)[:10]}:"
            f"gate-{self.gate.max_grad_error:g}-{self.gate.max_value_error:g}"
            + ("" if p.data == "lm" else f":data-file-{p.data_id}" if p.data_id else f":data-{p.data}")
        )

    def label(self) -> str:
        return f"{self.gpu} {self.kernel} {self.problem.describe()}"

    def data_record(self) -> dict:
        """What the entry tuned by this study records about its data."""
        p = self.problem
        if p.data_id:
            return {"kind": "file", "name": p.data.rsplit("/", 1)[-1], "sha256": p.data_id}
        return {"kind": p.data}


def _defaults(problem: "TuningProblem") -> KernelVariants:
    return KernelVariants.defaults(4 if problem.dtype == "fp32" else 2)


def variants_for(kernel: str, variant: _Variant, problem: "TuningProblem") -> KernelVariants:
    """The built-in defaults (for the problem's dtype) with ``kernel`` replaced by ``variant``."""
    return _defaults(problem).replace(**{kernel: variant})

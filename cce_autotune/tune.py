"""The tuner: one seeded Optuna TPE study per (GPU, kernel, dtype, D, V, B bucket, feature flags).

A trial samples the knobs of one kernel from its search space (:mod:`cce_autotune.space`); the other
two kernels stay at their built-in defaults. Then:

1. rules: a combination the space's constraints (or ``variant.validate``) rule out is recorded as
   PRUNED with ``status=infeasible`` and costs nothing (it does not count towards ``--trials``);
   a combination already measured is recorded as FAIL with ``status=duplicate`` (free, not counted);
2. render -> compile -> correctness gate: ``backend.check`` returns relative errors against the exact
   result; an error above the :class:`Gate` loses (PRUNED, ``status=gate``), whatever its speed;
3. timing: ``backend.time`` returns median / p20 / p80 milliseconds; the median is the objective.

A compile error, ``OutOfResources``, CUDA OOM, a ``RuntimeError`` or the per-trial time limit is a
PRUNED trial with ``status`` and ``reason`` in its user attributes, never a crash of the study. An
interrupted trial is marked FAIL (``status=interrupted``) and does not count, so running the same
command again resumes where it stopped: studies live in Optuna RDB storage (by default the SQLite
file ``cache_dir()/studies.db``), loaded by name. Several processes (``--workers``, or machines
sharing ``--storage``) can work on one study; each claims a trial by number before measuring it, so
the budget is shared (with at most one extra trial per racing worker, in rare races).

Finally the best few distinct configurations are re-timed interleaved, together with the built-in
default, and the fastest becomes a :class:`cce_autotune.db.Entry`.

The measuring is done by a *backend*: :class:`GPUBackend` (the real kernels, ``triton.testing.do_bench``)
or :class:`FakeBackend` (an analytic cost model with injected failures, for tests on CPU).

This module knows Optuna but not the YAML layout of the database (it hands :class:`Entry` objects to
the caller, which saves them with :mod:`cce_autotune.db`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import random
import signal
import socket
import sqlite3
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from . import codegen
from .db import Entry, EntryKey
from .space import SearchSpace, SpaceContext, load_space
from .variant import KERNELS, KernelVariants, VariantError, _Variant

__all__ = [
    "KERNEL_NAMES",
    "Problem",
    "Gate",
    "StudySpec",
    "Plan",
    "Outcome",
    "StudyStats",
    "Backend",
    "GPUBackend",
    "FakeBackend",
    "NoGPUError",
    "TrialTimeout",
    "DeviceLost",
    "measure",
    "make_backend",
    "classify_failure",
    "default_hidden",
    "make_plan",
    "describe_plan",
    "default_storage_url",
    "make_storage",
    "open_study",
    "run_study",
    "finalize",
    "run_plan",
    "run_workers",
]

KERNEL_NAMES = tuple(KERNELS)
GRADIENT_ERRORS = ("dE", "dC", "dbias")
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DATA_KINDS = ("lm", "real")  # what the GPU backend tunes on (cce_autotune.data.make_data)

optuna.logging.set_verbosity(optuna.logging.WARNING)


# -- what is tuned ------------------------------------------------------------------------------
def _bucket(B: int) -> int:
    return 1 if B <= 1 else 1 << round(math.log2(B))


@dataclass(frozen=True)
class Problem:
    """The shape and features one study tunes for (B is already a power-of-two bucket)."""

    B: int
    V: int
    D: int
    dtype: str = "bf16"
    has_bias: bool = False
    has_softcap: bool = False
    softcap: float = 30.0  # value used when has_softcap
    seed: int = 0  # of the data
    data: str = "lm"  # the tuner's data: "lm" (LM-like, synthetic) or "real" (cce_autotune.realdata)

    def __post_init__(self):
        if self.dtype not in _BYTES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {sorted(_BYTES)}")
        if self.data not in DATA_KINDS:
            raise ValueError(f"data: {self.data!r} is not one of {list(DATA_KINDS)}")
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
    problem: Problem
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
            + ("" if p.data == "lm" else f":data-{p.data}")
        )

    def label(self) -> str:
        return f"{self.gpu} {self.kernel} {self.problem.describe()}"


def _defaults(problem: "Problem") -> KernelVariants:
    return KernelVariants.defaults(4 if problem.dtype == "fp32" else 2)


def variants_for(kernel: str, variant: _Variant, problem: "Problem") -> KernelVariants:
    """The built-in defaults (for the problem's dtype) with ``kernel`` replaced by ``variant``."""
    return _defaults(problem).replace(**{kernel: variant})


# -- backends -----------------------------------------------------------------------------------
class NoGPUError(RuntimeError):
    """The GPU backend was asked for on a machine without a CUDA GPU."""


class TrialTimeout(Exception):
    """A trial ran past its time limit."""


class DeviceLost(RuntimeError):
    """A trial broke the CUDA context (illegal address, launch failure): the process must restart.
    The trial is recorded as failed first, so running the same command again resumes past it."""


_FATAL_CUDA = ("illegal memory access", "illegal address", "unspecified launch failure",
               "device-side assert", "misaligned address", "an illegal instruction")


class Backend:
    """What the tuner needs from a machine.

    ``check`` runs ``variants`` on ``problem`` and returns relative errors against the exact result
    (names in :data:`GRADIENT_ERRORS` are gated by ``max_grad_error``, the others by
    ``max_value_error``); ``time`` returns ``{"median_ms", "p20_ms", "p80_ms"}``. Both may raise the
    exceptions :func:`classify_failure` knows; the tuner records those as failed trials.
    """

    name = "abstract"

    def device_name(self) -> str:
        raise NotImplementedError

    def smem_limit(self) -> int | None:
        raise NotImplementedError

    def setup_worker(self, index: int) -> None:
        """Called in worker process ``index`` before it starts (e.g. to pick its GPU)."""

    def check(self, kernel: str, variants: KernelVariants, problem: Problem) -> dict:
        raise NotImplementedError

    def time(self, kernel: str, variants: KernelVariants, problem: Problem) -> dict:
        raise NotImplementedError


def _rel_err(x, ref) -> float:
    import torch

    num = torch.linalg.vector_norm((x.double() - ref.double()).reshape(-1)).item()
    den = torch.linalg.vector_norm(ref.double().reshape(-1)).item()
    err = num / max(den, 1e-30)
    return err if math.isfinite(err) else float("inf")


class GPUBackend(Backend):
    """The real kernels on the current CUDA device.

    Data: the problem's ``data`` (:func:`cce_autotune.data.make_data`: LM-like, or hidden states of a
    small model trained on real text) generated on the device.
    Correctness: against the PyTorch path (``impl="torch"``, ``filter_eps=None``) on float32 copies of
    the same inputs. Timing: ``triton.testing.do_bench`` (warm-up, L2 flushed before every repetition,
    quantiles 0.5 / 0.2 / 0.8). indexed_dot and lse_forward time their kernel; backward times the
    forward + backward of the whole loss in the call sequence of training (the classifier updated
    between calls, so the planner measures and decides as in a training step).
    """

    name = "gpu"

    def __init__(self, warmup_ms: int = 25, rep_ms: int = 100):
        import torch

        if not torch.cuda.is_available():
            raise NoGPUError("no CUDA GPU is visible (torch.cuda.is_available() is False)")
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self._key = None
        self._data: dict = {}

    def setup_worker(self, index: int) -> None:
        import torch

        torch.cuda.set_device(index % torch.cuda.device_count())

    def device_name(self) -> str:
        import torch

        return torch.cuda.get_device_name()

    def smem_limit(self) -> int | None:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return getattr(props, "shared_memory_per_block_optin", None)

    # data and references, for one problem at a time
    def _inputs(self, problem: Problem) -> dict:
        import torch

        from . import kernels
        from .data import make_data

        key = (problem, torch.cuda.current_device())
        if self._key != key:
            self._data = {}
            self._key = None
            torch.cuda.empty_cache()
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[problem.dtype]
            e, c, t = make_data(problem.data, problem.B, problem.V, problem.D, dtype=dtype, device="cuda",
                                seed=problem.seed)
            g = torch.Generator(device="cuda").manual_seed(problem.seed + 1)
            bias = (torch.randn(problem.V, generator=g, device="cuda") * 0.1).to(dtype) if problem.has_bias else None
            self._data = dict(
                e=e, c=c, t=t, bias=bias, softcap=problem.softcap if problem.has_softcap else None,
                rows=kernels.RowLayout.dense(problem.B, problem.D, "cuda"),
            )
            self._key = key
        return self._data

    def _reference(self, name: str, problem: Problem):
        import torch

        from . import reference, vocab_order
        from .loss import linear_cross_entropy

        d = self._inputs(problem)
        if name in d:
            return d[name]
        f32 = lambda x: None if x is None else x.float()  # noqa: E731
        if name == "walk":  # the vocabulary by descending average logit (what a backward sorts by)
            d["walk"] = vocab_order.sort_order(d["e"], d["c"], d["bias"])
        elif name in ("ref_lse", "ref_zt"):
            lse, zt, _ = reference.forward(f32(d["e"]), f32(d["c"]), f32(d["bias"]), torch.arange(problem.B, device="cuda"), d["t"], d["softcap"])
            d["ref_lse"], d["ref_zt"] = lse, zt
        else:
            e = f32(d["e"]).requires_grad_()
            c = f32(d["c"]).requires_grad_()
            b = f32(d["bias"]).requires_grad_() if d["bias"] is not None else None
            loss = linear_cross_entropy(e, c, d["t"], b, softcap=d["softcap"], impl="torch", filter_eps=None)
            loss.backward()
            d["ref_grads"] = dict(loss=loss.detach(), dE=e.grad, dC=c.grad, dbias=b.grad if b is not None else None)
        return d[name]

    def _runner(self, kernel: str, variants: KernelVariants, problem: Problem, training: bool = False):
        """(function running the timed work, tensors whose .grad to reset). ``training``: the backward
        runs the call sequence of training (see below) on its own copy of the classifier."""
        import torch

        from . import kernels
        from .loss import linear_cross_entropy

        d = self._inputs(problem)
        if kernel == "indexed_dot":
            return (lambda: kernels.indexed_dot(d["e"], d["c"], d["bias"], d["rows"], d["t"], d["softcap"],
                                                variants.indexed_dot)), None
        if kernel == "lse_forward":
            bw = variants.backward
            walk = zt = None
            if bw.uses_tile_map(bw.filter_eps):
                # As in a training step: walk a sorted order and record the tile map.
                walk, zt = self._reference("walk", problem), self._reference("ref_zt", problem)
            return (lambda: kernels.lse_forward(d["e"], d["c"], d["bias"], d["rows"], d["softcap"],
                                                variants.lse_forward, perm=walk, zt=zt)), None
        c = d["c"]
        step = None
        if training:
            # The call sequence of training: the classifier moves a little before every call (by
            # +-1 % of its standard deviation, alternating so that it does not wander off), so each
            # call walks an order one step stale and the planner sees the live share a training step
            # sees. The update costs every variant the same.
            if "c_training" not in d:
                d["c_training"] = c.clone()
                d["drift"] = torch.randn_like(c) * (0.01 * float(c.float().std()))
            c, sign = d["c_training"], [1.0]

            def step():
                with torch.no_grad():
                    c.add_(d["drift"], alpha=sign[0])
                sign[0] = -sign[0]

        leaves = [d["e"].detach().requires_grad_(), c.detach().requires_grad_()]
        if d["bias"] is not None:
            leaves.append(d["bias"].detach().requires_grad_())
        bias = leaves[2] if len(leaves) == 3 else None

        def fwd_bwd():
            if step is not None:
                step()
            loss = linear_cross_entropy(leaves[0], leaves[1], d["t"], bias, softcap=d["softcap"], impl="triton",
                                        variants=variants)
            loss.backward()
            return loss

        return fwd_bwd, leaves

    def check(self, kernel: str, variants: KernelVariants, problem: Problem) -> dict:
        import torch

        fn, leaves = self._runner(kernel, variants, problem)
        out = fn()
        torch.cuda.synchronize()
        if kernel == "indexed_dot":
            return {"target_logit": _rel_err(out, self._reference("ref_zt", problem))}
        if kernel == "lse_forward":
            return {"lse": _rel_err(out[0], self._reference("ref_lse", problem))}
        ref = self._reference("ref_grads", problem)
        errors = {
            "loss": _rel_err(out.detach(), ref["loss"]),
            "dE": _rel_err(leaves[0].grad, ref["dE"]),
            "dC": _rel_err(leaves[1].grad, ref["dC"]),
        }
        if ref["dbias"] is not None:
            errors["dbias"] = _rel_err(leaves[2].grad, ref["dbias"])
        return errors

    def time(self, kernel: str, variants: KernelVariants, problem: Problem) -> dict:
        import triton.testing

        fn, leaves = self._runner(kernel, variants, problem, training=True)
        med, p20, p80 = triton.testing.do_bench(
            fn, warmup=self.warmup_ms, rep=self.rep_ms, grad_to_none=leaves, quantiles=[0.5, 0.2, 0.8]
        )
        return {"median_ms": float(med), "p20_ms": float(p20), "p80_ms": float(p80)}


def _compilation_error(message: str) -> Exception:
    """A Triton ``CompilationError`` (what a kernel that does not compile raises)."""
    import ast

    from triton.compiler.errors import CompilationError

    try:
        return CompilationError(None, ast.parse("pass").body[0], message)
    except Exception:  # pragma: no cover - another Triton version's constructor
        return RuntimeError(f"compilation failed: {message}")


def _matches(rules, variant: _Variant) -> bool:
    """True when ``variant`` matches one of ``rules`` (dicts of knob -> value, all must agree)."""
    if not rules:
        return False
    if isinstance(rules, Mapping):
        rules = [rules]
    d = variant.to_dict()
    return any(all(k in d and d[k] == v for k, v in rule.items()) for rule in rules)


class FakeBackend(Backend):
    """A deterministic analytic cost model of the knobs, with injected failures: tests on CPU.

    - time: roughly the work of the shape divided by a throughput, times penalties for small tiles,
      too many / too few values per thread, pipelining depth away from 3, swizzle groups away from 8;
      for the backward, the share of tiles the filter leaves alive (sorting packs them); plus a
      deterministic +-0.5% jitter from the variant's hash. ``noise`` adds seeded random noise.
    - check: errors grow with ``filter_eps`` (dE = 1e-3 + 30 eps): 2^-12 passes a 1e-2 gate, 2^-10
      (faster) does not.
    - failures: a variant of the tuned kernel matching ``fail_compile`` raises a Triton
      ``CompilationError`` at check; one matching ``fail_resources`` raises ``OutOfResources``; one
      matching ``slow`` sleeps ``slow_s`` seconds (for the per-trial time limit).
    - ``log_path``: every ``time`` call appends a JSON line (pid, kernel, knobs) there.
    """

    name = "fake"
    DEFAULT_FAIL_COMPILE = ({"num_warps": 2, "num_stages": 3},)
    DEFAULT_FAIL_RESOURCES = ({"num_warps": 8, "num_stages": 1},)

    def __init__(self, device_name: str = "NVIDIA H200", smem_limit: int | None = 232448,
                 fail_compile=DEFAULT_FAIL_COMPILE, fail_resources=DEFAULT_FAIL_RESOURCES,
                 slow=None, slow_s: float = 5.0, noise: float = 0.0, log_path: str | None = None, seed: int = 0):
        self._device_name = device_name
        self._smem = smem_limit
        self.fail_compile = fail_compile
        self.fail_resources = fail_resources
        self.slow = slow
        self.slow_s = slow_s
        self.noise = noise
        self.log_path = log_path
        self._rng = __import__("random").Random(seed)
        self.calls: list[tuple[str, str, dict]] = []  # (method, kernel, knobs)

    def device_name(self) -> str:
        return self._device_name

    def smem_limit(self) -> int | None:
        return self._smem

    def _enter(self, method: str, kernel: str, variants: KernelVariants) -> _Variant:
        v = getattr(variants, kernel)
        self.calls.append((method, kernel, v.to_dict()))
        if _matches(self.slow, v):
            time.sleep(self.slow_s)
        if _matches(self.fail_compile, v):
            raise _compilation_error(f"fake: {kernel} {v.to_dict()} does not compile")
        if _matches(self.fail_resources, v):
            from triton.runtime.errors import OutOfResources

            raise OutOfResources(300_000, self._smem or 232448, "shared memory")
        return v

    def check(self, kernel: str, variants: KernelVariants, problem: Problem) -> dict:
        v = self._enter("check", kernel, variants)
        if kernel == "indexed_dot":
            return {"target_logit": 1e-6}
        if kernel == "lse_forward":
            return {"lse": 1e-6}
        eps = v.filter_eps or 0.0
        errors = {"loss": 1e-6, "dE": 1e-3 + 30 * eps, "dC": 8e-4 + 20 * eps}
        if problem.has_bias:
            errors["dbias"] = 1e-3 + 10 * eps
        return errors

    def cost_ms(self, kernel: str, v: _Variant, p: Problem) -> float:
        """The model's time of ``v`` on ``p`` (no failures, no noise)."""
        if kernel == "indexed_dot":
            base = p.B * p.D * p.elem_bytes / 2e6  # bytes / (2 TB/s), in ms
            threads = 32 * v.num_warps
            eff = (1 + 8 / v.block_b) * (1 + 64 / v.block_d) * (1 + 0.15 * abs(math.log2(v.block_b * v.block_d / threads / 16)))
            eff *= 1 + 0.05 * abs(v.num_stages - 2)
        else:
            base = 2 * p.B * p.V * p.D / 7e11  # flops / (700 TFLOP/s), in ms
            per_thread = v.block_b * v.block_v / (32 * v.num_warps)
            eff = (1 + 24 / v.block_b + 24 / v.block_v) * (1 + 8 / v.block_d)
            eff *= 1 + 0.1 * abs(math.log2(per_thread / 64))
            eff *= 1 + 0.04 * abs(v.num_stages - 3)
            eff *= 1 + 0.02 * abs(math.log2(v.group_b / 8))
            if kernel == "lse_forward":
                programs = math.ceil(p.B / v.block_b) * v.num_splits
                eff *= 1 + 0.3 * max(0.0, math.log2(264 / programs))
                eff *= 1.03 if v.merge == "lock" else 1.0
            else:
                if v.filter_eps is None:
                    live = 1.0
                else:
                    live = min(1.0, 0.04 * (2.0**-12 / v.filter_eps) ** 0.5)
                    live = live * 0.3 if v.sort_vocab else live
                eff *= 1 + 2 * live + (0.05 if v.sort_vocab else 0.0)  # recompute + live dE/dC products
                eff *= 0.97 if v.accum == "native" else 1.0
        jitter = 1 + 0.01 * (int(v.stable_hash()[:4], 16) / 0xFFFF - 0.5)
        return base * eff * jitter

    def time(self, kernel: str, variants: KernelVariants, problem: Problem) -> dict:
        v = self._enter("time", kernel, variants)
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "kernel": kernel, "knobs": v.to_dict()}) + "\n")
        ms = self.cost_ms(kernel, v, problem)
        if self.noise:
            ms *= 1 + self.noise * self._rng.uniform(-1, 1)
        return {"median_ms": ms, "p20_ms": ms * 0.98, "p80_ms": ms * 1.03}


_BACKENDS: dict[str, Callable[..., Backend]] = {"gpu": GPUBackend, "fake": FakeBackend}


def make_backend(name: str = "gpu", **kwargs) -> Backend:
    """``"gpu"`` (raises :class:`NoGPUError` without one) or ``"fake"`` (the cost model)."""
    if name not in _BACKENDS:
        raise ValueError(f"backend: {name!r} is not one of {sorted(_BACKENDS)}")
    return _BACKENDS[name](**kwargs)


# -- failures and limits ------------------------------------------------------------------------
def classify_failure(exc: BaseException) -> str | None:
    """The trial status of a failed measurement, or None for an exception that must propagate."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.compiler.errors import TritonError as CompilerTritonError
        from triton.runtime.errors import OutOfResources
        from triton.runtime.errors import TritonError as RuntimeTritonError
    except ImportError:  # pragma: no cover
        CompilationError = OutOfResources = CompilerTritonError = RuntimeTritonError = ()  # noqa: N806
    import torch

    if isinstance(exc, TrialTimeout):
        return "timeout"
    if isinstance(exc, (OutOfResources, torch.cuda.OutOfMemoryError)):
        return "out_of_resources"
    if isinstance(exc, CompilationError):
        return "compile_error"
    if isinstance(exc, (CompilerTritonError, RuntimeTritonError)):
        # e.g. PTXASError "Insufficient registers": the variant cannot be built on this device
        return "out_of_resources" if "register" in str(exc).lower() else "compile_error"
    if isinstance(exc, VariantError):
        return "invalid"
    if isinstance(exc, RuntimeError):
        return "cuda_fatal" if any(m in str(exc).lower() for m in _FATAL_CUDA) else "runtime_error"
    return None


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """Raise :class:`TrialTimeout` in the block after ``seconds`` (main thread on POSIX; else the
    caller checks the elapsed time afterwards)."""
    usable = (
        seconds and seconds > 0 and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise TrialTimeout(f"exceeded the per-trial time limit of {seconds:g} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    """The result of measuring one variant."""

    status: str  # ok | gate | compile_error | out_of_resources | runtime_error | timeout | invalid
    reason: str = ""
    errors: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def measure(backend: Backend, spec: StudySpec, variant: _Variant, time_limit: float | None = None) -> Outcome:
    """check -> gate -> time one variant of ``spec.kernel``; failures become an :class:`Outcome`."""
    kv = variants_for(spec.kernel, variant, spec.problem)
    t0 = time.monotonic()
    try:
        with _time_limit(time_limit):
            errors = backend.check(spec.kernel, kv, spec.problem)
            why = spec.gate.failure(errors)
            if why:
                return Outcome("gate", why, errors=errors, wall_s=time.monotonic() - t0)
            timing = backend.time(spec.kernel, kv, spec.problem)
    except Exception as exc:  # noqa: BLE001 - classified below, the rest re-raised
        status = classify_failure(exc)
        if status is None:
            raise
        return Outcome(status, f"{type(exc).__name__}: {exc}"[:1000], wall_s=time.monotonic() - t0)
    wall = time.monotonic() - t0
    if time_limit and wall > time_limit:
        return Outcome("timeout", f"took {wall:.1f} s, over the per-trial time limit of {time_limit:g} s", errors, wall_s=wall)
    return Outcome("ok", errors=errors, timing=timing, wall_s=wall)


# -- storage and studies ------------------------------------------------------------------------
def default_storage_url() -> str:
    from .paths import cache_dir

    return f"sqlite:///{cache_dir() / 'studies.db'}"


# Attempts at creating a storage whose tables another process creates at the same moment.
STORAGE_ATTEMPTS = 6


def make_storage(url: str | None = None) -> optuna.storages.BaseStorage:
    """Optuna RDB storage for ``url`` (default: the SQLite file in the user cache).

    Several processes may open one fresh database at once (``--workers``, or machines sharing a
    ``--storage``): the one that loses the race to create Optuna's tables gets an IntegrityError
    (or "table ... already exists", "database is locked"); it waits a moment and opens the now
    existing database again."""
    url = url or default_storage_url()
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            return _open_storage(url)
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError) as exc:
            racing = isinstance(exc, sqlalchemy.exc.IntegrityError) or any(
                m in str(exc).lower() for m in ("locked", "already exists"))
            if attempt == STORAGE_ATTEMPTS - 1 or not racing:
                raise
            time.sleep(0.2 * (attempt + 1) * (1 + random.random()))
    raise AssertionError("unreachable")  # pragma: no cover


def _open_storage(url: str) -> optuna.storages.BaseStorage:
    if not url.startswith("sqlite:///"):
        return optuna.storages.RDBStorage(url)
    # SQLite: wait for other workers' locks instead of failing, and use write-ahead logging with
    # synchronous=NORMAL (no fsync per commit: ~10x faster trials; a crash of the process loses nothing).
    path = url[len("sqlite:///"):]
    if path and path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        con = sqlite3.connect(path, timeout=120)
        try:
            con.execute("PRAGMA journal_mode=WAL")
        finally:
            con.close()
    storage = optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 120}})

    def on_connect(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")

    sqlalchemy.event.listen(storage.engine, "connect", on_connect)
    storage.engine.dispose()  # connections opened while creating the tables reconnect with the pragma
    return storage


def _storage(storage) -> optuna.storages.BaseStorage:
    return storage if isinstance(storage, optuna.storages.BaseStorage) else make_storage(storage)


def _distributions(space: SearchSpace) -> dict:
    return {name: CategoricalDistribution(list(values)) for name, values in space.knobs.items()}


def open_study(spec: StudySpec, storage, seed: int = 0, worker: int = 0) -> optuna.Study:
    """Create or load (same name) the study of ``spec``; the sampler is seeded from ``seed``, the
    worker index and the number of trials already stored (so a resumed run does not replay)."""
    storage = _storage(storage)
    probe = optuna.create_study(study_name=spec.name, storage=storage, direction="minimize", load_if_exists=True)
    n_existing = len(probe.get_trials(deepcopy=False))
    sampler = optuna.samplers.TPESampler(
        seed=(seed * 1_000_003 + worker * 7_919 + n_existing) % 2**32,
        n_startup_trials=max(5, min(10, spec.n_trials // 4)),
    )
    study = optuna.load_study(study_name=spec.name, storage=storage, sampler=sampler)
    if not study.user_attrs:
        study.set_user_attr("key", spec.key.to_dict())
        study.set_user_attr("gpu", spec.gpu)
        study.set_user_attr("gate", dataclasses.asdict(spec.gate))
        study.set_user_attr("template_hash", codegen.template_hash(spec.kernel))
    return study


def _worker_dead(worker) -> bool:
    """True when ``worker`` ("host:pid:wN", a trial's claimant) ran on this host and its process is
    gone (kill -9, an OOM kill, a Ctrl-C'd worker child): its RUNNING trial will never finish. A
    worker on another host is judged by the trial's age instead."""
    try:
        host, pid, _ = str(worker).rsplit(":", 2)
        pid = int(pid)
    except ValueError:
        return False
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def _measured(t) -> bool:
    return bool(t.user_attrs.get("measured"))


@dataclass
class StudyStats:
    """What one worker's run of a study did, and the study's state afterwards."""

    name: str
    measured: int = 0  # trials this run measured
    total_measured: int = 0  # in the study, all runs and workers
    complete: int = 0
    failed: dict = field(default_factory=dict)  # status -> count (in the study)
    infeasible: int = 0
    duplicates: int = 0
    best_ms: float | None = None
    stopped: str = ""


def _summary(study: optuna.Study, stats: StudyStats) -> StudyStats:
    trials = study.get_trials(deepcopy=False)
    stats.total_measured = sum(1 for t in trials if _measured(t) and t.state in (TrialState.COMPLETE, TrialState.PRUNED))
    complete = [t for t in trials if t.state == TrialState.COMPLETE and _measured(t)]
    stats.complete = len(complete)
    stats.best_ms = min((t.value for t in complete), default=None)
    failed: dict = {}
    for t in trials:
        if t.state == TrialState.PRUNED and _measured(t):
            s = t.user_attrs.get("status", "?")
            failed[s] = failed.get(s, 0) + 1
    stats.failed = failed
    stats.infeasible = sum(1 for t in trials if t.user_attrs.get("status") == "infeasible")
    stats.duplicates = sum(1 for t in trials if t.user_attrs.get("status") == "duplicate")
    return stats


class _Progress:
    """One stderr line: trials done / budget, best so far, failures (rewritten in place on a tty)."""

    def __init__(self, label: str, total: int, stream=None):
        self.label = label
        self.total = total
        self.stream = stream
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.last_printed = -1

    def update(self, stats: StudyStats, final: bool = False) -> None:
        if self.stream is None:
            return
        best = f"{stats.best_ms:.4g} ms" if stats.best_ms is not None else "-"
        failed = sum(stats.failed.values())
        line = (f"[{self.label}] {stats.total_measured}/{self.total} trials, best {best}, {failed} failed, "
                f"{stats.infeasible} ruled out, {time.monotonic() - self.t0:.0f} s")
        if final and stats.stopped:
            line += f" ({stats.stopped})"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        elif final or stats.measured % 10 == 0:
            if not (final and stats.measured == self.last_printed):
                self.stream.write(line + "\n")
            self.last_printed = stats.measured
        self.stream.flush()


def _ask_fixed(study: optuna.Study, dists: dict, params: Mapping[str, Any]) -> optuna.Trial:
    """A new trial whose knobs are ``params`` (recorded in the study like any sampled trial)."""
    base = study.sampler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.sampler = optuna.samplers.PartialFixedSampler(dict(params), base)
    try:
        return study.ask(dists)
    finally:
        study.sampler = base


def _params_key(space: SearchSpace, params: Mapping[str, Any]) -> tuple:
    return tuple(params.get(k) for k in space.knobs)


def _alternative(space: SearchSpace, params: Mapping[str, Any], ctx: SpaceContext, taken: set,
                 rng: random.Random, tries: int = 200) -> dict | None:
    """A feasible point not in ``taken``: a one-step neighbour of ``params`` if one is free, else a
    random point; None when ``tries`` random points found nothing (the space is about exhausted)."""
    moves = []
    for name, values in space.knobs.items():
        i = values.index(params[name])
        moves += [(name, values[j]) for j in (i - 1, i + 1) if 0 <= j < len(values)]
    rng.shuffle(moves)
    candidates = ({**params, name: value} for name, value in moves)
    randoms = ({k: rng.choice(v) for k, v in space.knobs.items()} for _ in range(tries))
    for cand in (*candidates, *randoms):
        if _params_key(space, cand) not in taken and space.reject_reason(cand, ctx) is None:
            return cand
    return None


def run_study(spec: StudySpec, backend: Backend, storage=None, *, seed: int = 0, worker: int = 0,
              timeout_s: float | None = None, trial_time_limit: float | None = 120.0,
              max_idle: int = 300, progress=None) -> StudyStats:
    """Run trials of ``spec`` until the study holds ``spec.n_trials`` measured trials (shared with any
    other worker on the same storage), ``timeout_s`` passes, or ``max_idle`` samples in a row were
    ruled out or already measured (the feasible space is exhausted)."""
    storage = _storage(storage)
    study = open_study(spec, storage, seed, worker)
    space = load_space(spec.kernel)
    ctx = spec.problem.space_context(backend.smem_limit())
    dists = _distributions(space)
    stale_after = 3 * (trial_time_limit or 600) + 300
    me = f"{socket.gethostname()}:{os.getpid()}:w{worker}"

    # Points this worker measures next with fixed knobs (not Optuna's enqueue_trial: with SQLite two
    # workers can pop the same waiting trial). Worker 0 starts a fresh study with the default.
    pending: list[tuple[dict, str]] = []
    default = getattr(_defaults(spec.problem), spec.kernel)
    if (worker == 0 and not any(t.user_attrs.get("proposed") == "baseline" for t in study.get_trials(deepcopy=False))
            and space.contains(default) and space.reject_reason(space.params_of(default), ctx) is None):
        pending.append((space.params_of(default), "baseline"))
    # Then the space's seeds (known-good points, merged over the default), once per study.
    if worker == 0 and not any(str(t.user_attrs.get("proposed", "")).startswith("seed") for t in study.get_trials(deepcopy=False)):
        for i, partial in enumerate(space.seeds):
            params = {**space.params_of(default), **partial} if space.contains(default) else None
            if params is not None and space.reject_reason(params, ctx) is None:
                pending.append((params, f"seed {i}"))

    stats = StudyStats(spec.name)
    bar = _Progress(spec.label(), spec.n_trials, progress)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    rng = random.Random(f"{seed}:{worker}:{spec.name}")
    idle = 0
    while True:
        if deadline is not None and time.monotonic() > deadline:
            stats.stopped = "time budget reached"
            break
        trials = study.get_trials(deepcopy=False)
        now = datetime.datetime.now()
        for t in trials:  # trials of a worker that died: failed, so their slot is free again
            if t.state == TrialState.RUNNING and t.user_attrs.get("worker") != me and (
                    _worker_dead(t.user_attrs.get("worker"))
                    or (t.datetime_start and (now - t.datetime_start).total_seconds() > stale_after)):
                study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        claimed = sum(1 for t in trials if _measured(t) and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING))
        if claimed >= spec.n_trials:
            stats.stopped = "trial budget reached"
            break
        if idle >= max_idle:
            stats.stopped = f"{max_idle} samples in a row ruled out or already measured: space exhausted"
            break
        if pending:
            fixed, why = pending.pop(0)
            trial = _ask_fixed(study, dists, fixed)
            trial.set_user_attr("proposed", why)
        else:
            trial = study.ask(dists)
        params = dict(trial.params)
        trial.set_user_attr("worker", me)
        reason = space.reject_reason(params, ctx)
        if reason:
            trial.set_user_attr("status", "infeasible")
            trial.set_user_attr("reason", reason)
            study.tell(trial, state=TrialState.PRUNED)
            idle += 1
            continue
        # Claim the point: mark it measured, then look at the study again. Another claim of the same
        # knobs (running or done) makes this one a duplicate; of two racing claims at least one sees
        # the other, so a point is never measured twice. Claims with a lower number than this one
        # come first for the trial budget.
        trial.set_user_attr("measured", True)
        fresh = study.get_trials(deepcopy=False)
        live = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
        twin = next((t for t in fresh if t.number != trial.number and _measured(t) and t.state in live
                     and t.params == params), None)
        if twin is not None:
            # TPE re-proposes points it likes once a small space is mostly explored: record the
            # repeat for free and queue an unmeasured neighbour instead (one knob one step away).
            trial.set_user_attr("measured", False)
            trial.set_user_attr("status", "duplicate")
            trial.set_user_attr("reason", f"same knobs as trial {twin.number}")
            study.tell(trial, state=TrialState.FAIL)
            taken = {_params_key(space, t.params) for t in fresh if _measured(t)}
            alt = _alternative(space, params, ctx, taken, rng)
            if alt is not None:
                pending.append((alt, f"neighbour of trial {twin.number}"))
            idle += 1 if alt is None else 0
            continue
        ahead = sum(1 for t in fresh if t.number < trial.number and _measured(t) and t.state in live)
        if ahead >= spec.n_trials:
            trial.set_user_attr("measured", False)
            trial.set_user_attr("status", "over_budget")
            study.tell(trial, state=TrialState.FAIL)
            stats.stopped = "trial budget reached"
            break
        idle = 0
        variant = space.variant(params)
        try:
            outcome = measure(backend, spec, variant, trial_time_limit)
        except BaseException as exc:  # interrupted (Ctrl-C) or an unexpected error: free the slot, re-raise
            trial.set_user_attr("measured", False)
            trial.set_user_attr("status", "interrupted")
            trial.set_user_attr("reason", f"{type(exc).__name__}: {exc}"[:1000])
            study.tell(trial, state=TrialState.FAIL)
            raise
        trial.set_user_attr("status", outcome.status)
        trial.set_user_attr("wall_s", round(outcome.wall_s, 3))
        if outcome.errors:
            trial.set_user_attr("errors", {k: float(v) for k, v in outcome.errors.items()})
        if outcome.ok:
            trial.set_user_attr("p20_ms", outcome.timing["p20_ms"])
            trial.set_user_attr("p80_ms", outcome.timing["p80_ms"])
            study.tell(trial, outcome.timing["median_ms"])
        else:
            trial.set_user_attr("reason", outcome.reason)
            study.tell(trial, state=TrialState.PRUNED)
            if outcome.status == "cuda_fatal":
                raise DeviceLost(f"trial {trial.number} of {spec.label()} broke the CUDA context "
                                 f"({outcome.reason}); it is recorded as failed: run the same command again to resume")
        stats.measured += 1
        if progress is not None:
            bar.update(_summary(study, stats))
    _summary(study, stats)
    bar.update(stats, final=True)
    return stats


def _retime(backend: Backend, spec: StudySpec, pool: list, rounds: int, time_limit: float | None) -> dict:
    """Interleaved re-timing: every round times each variant once, starting one later each round."""
    runs: dict = {v: [] for v in pool}
    dead: set = set()
    for r in range(rounds):
        order = pool[r % len(pool):] + pool[: r % len(pool)]
        for v in order:
            if v in dead:
                continue
            try:
                with _time_limit(time_limit):
                    runs[v].append(backend.time(spec.kernel, variants_for(spec.kernel, v, spec.problem), spec.problem))
            except Exception as exc:  # noqa: BLE001
                if classify_failure(exc) is None:
                    raise
                dead.add(v)
    return {
        v: {k: statistics.median(t[f"{k}_ms"] for t in ts) for k in ("median", "p20", "p80")}
        for v, ts in runs.items() if ts and v not in dead
    }


def finalize(spec: StudySpec, backend: Backend, storage=None, *, top_k: int = 3, rounds: int = 3,
             time_limit: float | None = 120.0, log: Callable[[str], Any] | None = None) -> Entry | None:
    """Re-time the ``top_k`` best distinct variants of the study interleaved with the built-in default
    and return the winner as a database entry (None when no trial passed). ``log`` gets a line when
    the default itself fails the gate (then the winner may well be slower than the default)."""
    import torch
    import triton

    from . import __version__

    study = optuna.load_study(study_name=spec.name, storage=_storage(storage))
    trials = study.get_trials(deepcopy=False)
    done = sorted((t for t in trials if t.state == TrialState.COMPLETE and _measured(t)), key=lambda t: t.value)
    space = load_space(spec.kernel)
    candidates: list = []
    for t in done:
        v = space.variant(t.params)
        if v not in candidates:
            candidates.append(v)
        if len(candidates) == top_k:
            break
    if not candidates:
        return None
    default = getattr(_defaults(spec.problem), spec.kernel)
    if default not in candidates:
        # The default competes too (it may lie outside the space, e.g. a swizzle group the rules
        # fold away): a tuned entry is never slower than what users get without one.
        baseline = measure(backend, spec, default, time_limit)
        if baseline.ok:
            candidates.append(default)
        elif log is not None:
            log(f"[{spec.label()}] the built-in default is not a candidate: {baseline.status} ({baseline.reason})")
    pool = candidates + ([default] if default not in candidates else [])
    timings = _retime(backend, spec, pool, rounds, time_limit)
    ranked = sorted((v for v in candidates if v in timings), key=lambda v: timings[v]["median"])
    if not ranked:
        return None
    winner = ranked[0]
    return Entry(
        key=spec.key,
        variant=winner,
        timing_ms=timings[winner],
        default_ms=timings.get(default),
        template_hash=codegen.template_hash(spec.kernel),
        tuned_on=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions={"torch": str(torch.__version__), "triton": str(triton.__version__), "cce_autotune": str(__version__)},
        device_name=backend.device_name(),
        trials=sum(1 for t in trials if _measured(t) and t.state in (TrialState.COMPLETE, TrialState.PRUNED)),
    )


# -- plans ------------------------------------------------------------------------------------
# Hidden sizes of well-known models, by vocabulary size (used when --hidden is not given).
KNOWN_HIDDEN = {
    256128: ([2304, 3584], "Gemma-2 2B / 9B"),
    256000: ([2048, 3072], "Gemma 2B / 7B"),
    262144: ([2560, 3840], "Gemma-3 4B / 12B"),
    151936: ([2048, 3584], "Qwen2.5 3B / 7B"),
    152064: ([3584, 5120], "Qwen2.5 7B / 14B"),
    128256: ([4096], "Llama-3 8B"),
    32768: ([4096], "Mistral-7B v0.3"),
    32000: ([4096], "Llama-2 7B / Mistral-7B v0.1"),
    50304: ([2048], "GPT-NeoX / Pythia"),
}
GENERIC_HIDDEN = [2048, 4096]


def default_hidden(V: int) -> tuple[list[int], str]:
    """Hidden sizes to tune for vocabulary ``V`` when none are given, and a note saying why."""
    if V in KNOWN_HIDDEN:
        sizes, models = KNOWN_HIDDEN[V]
        return list(sizes), f"--hidden not given: V={V} is {models}, tuning D={', '.join(map(str, sizes))}"
    return list(GENERIC_HIDDEN), (f"--hidden not given: V={V} is not a known model's vocabulary, tuning the "
                                  f"common D={', '.join(map(str, GENERIC_HIDDEN))}")


@dataclass
class Plan:
    gpu: str
    studies: list  # of StudySpec
    notes: list = field(default_factory=list)
    budget_minutes: float | None = None


def make_plan(gpu: str, vocabs: Sequence[int], hiddens: Sequence[int] | None = None,
              tokens: Sequence[int] = (4096, 8192, 16384), dtypes: Sequence[str] = ("bf16",),
              kernels: Sequence[str] = KERNEL_NAMES, flag_sets: Sequence[tuple] = ((False, False),),
              trials: int = 50, gate: Gate = Gate(), budget_minutes: float | None = None,
              data: str = "lm") -> Plan:
    """Every (kernel, dtype, V, D, B bucket, flags) study to run, timed on ``data`` ("lm" or "real")."""
    notes = []
    buckets = []
    for B in tokens:
        b = _bucket(B)
        if b != B:
            notes.append(f"--tokens {B}: tuned as the power-of-two bucket B={b}")
        if b not in buckets:
            buckets.append(b)
    studies = []
    for V in vocabs:
        Ds = list(hiddens) if hiddens else None
        if not Ds:
            Ds, note = default_hidden(V)
            notes.append(note)
        for dtype in dtypes:
            for D in Ds:
                for B in buckets:
                    for has_bias, has_softcap in flag_sets:
                        problem = Problem(B, V, D, dtype, has_bias, has_softcap, data=data)
                        studies.extend(StudySpec(gpu, k, problem, trials, gate) for k in kernels)
    return Plan(gpu, studies, notes, budget_minutes)


# Rough wall time of one trial (compile + check + timing) and of the final re-timing, in seconds.
_TRIAL_S = {"indexed_dot": 3.0, "lse_forward": 5.0, "backward": 8.0}


def describe_plan(plan: Plan, smem_limit: int | None, workers: int = 1) -> str:
    """The plan as text: each study's space size after the rules, trials, and an estimated time."""
    lines = [f"cce-tune plan for GPU {plan.gpu} "
             f"(shared memory per block {'unlimited' if smem_limit is None else f'{smem_limit} bytes'}):"]
    lines += [f"  note: {n}" for n in plan.notes]
    spaces = {k: load_space(k) for k in {s.kernel for s in plan.studies}}
    est = 0.0
    trials = 0
    for s in plan.studies:
        total, feasible = spaces[s.kernel].count(s.problem.space_context(smem_limit))
        n = min(s.n_trials, feasible)
        trials += n
        est += n * _TRIAL_S[s.kernel] + 12 * _TRIAL_S[s.kernel] / 2
        lines.append(f"  {s.kernel:<12} {s.problem.describe():<40} space {total} -> {feasible} after rules, "
                     f"{s.n_trials} trials")
    est /= max(1, workers)
    budget = ""
    if plan.budget_minutes:
        budget = f", capped by --budget-minutes {plan.budget_minutes:g}"
        est = min(est, plan.budget_minutes * 60)
    kernels = sorted({s.kernel for s in plan.studies}, key=KERNEL_NAMES.index)
    lines.append(f"{len(plan.studies)} studies ({', '.join(kernels)}), {trials} trials, "
                 f"{workers} worker(s): about {est / 60:.0f} min{budget}")
    return "\n".join(lines)


# -- running a plan ---------------------------------------------------------------------------
def _study_timeout(deadline: float | None, remaining: int) -> float | None:
    if deadline is None:
        return None
    return max(1.0, (deadline - time.time()) / max(1, remaining))


def _worker_main(index: int, backend_name: str, backend_kwargs: dict, storage_url: str, specs: list,
                 seed: int, deadline: float | None, trial_time_limit: float | None) -> None:
    backend = make_backend(backend_name, **backend_kwargs)
    backend.setup_worker(index)
    for i, spec in enumerate(specs):
        run_study(spec, backend, storage_url, seed=seed, worker=index,
                  timeout_s=_study_timeout(deadline, len(specs) - i), trial_time_limit=trial_time_limit)


def run_workers(n: int, backend_name: str, backend_kwargs: dict, storage_url: str, specs: list, *,
                seed: int = 0, deadline: float | None = None, trial_time_limit: float | None = 120.0) -> None:
    """Run ``n`` worker processes (worker i on GPU i) over ``specs``, sharing each study through the
    storage at ``storage_url``; returns when all have finished. Raises if a worker failed."""
    ctx = multiprocessing.get_context("spawn")
    # Create the studies once first, so workers never race to create them.
    storage = make_storage(storage_url)
    for spec in specs:
        open_study(spec, storage, seed)
    procs = [
        ctx.Process(target=_worker_main, name=f"cce-tune-worker-{i}",
                    args=(i, backend_name, backend_kwargs, storage_url, specs, seed, deadline, trial_time_limit))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        raise
    bad = [f"{p.name} (exit {p.exitcode})" for p in procs if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"worker process(es) failed: {', '.join(bad)}")


def run_plan(plan: Plan, backend: Backend, storage_url: str | None = None, *, backend_name: str | None = None,
             backend_kwargs: dict | None = None, workers: int = 1, seed: int = 0,
             trial_time_limit: float | None = 120.0, top_k: int = 3, rounds: int = 3,
             on_result: Callable[[Entry], None] | None = None, progress=sys.stderr) -> list:
    """Run every study of ``plan`` and return the winning entries (``on_result`` is called with each
    as soon as its study is final, so an interruption loses nothing already won)."""
    storage_url = storage_url or default_storage_url()
    deadline = time.time() + plan.budget_minutes * 60 if plan.budget_minutes else None
    results = []
    if workers > 1:
        run_workers(workers, backend_name or backend.name, backend_kwargs or {}, storage_url, plan.studies,
                    seed=seed, deadline=deadline, trial_time_limit=trial_time_limit)
    storage = make_storage(storage_url)
    for i, spec in enumerate(plan.studies):
        if workers <= 1:
            run_study(spec, backend, storage, seed=seed, trial_time_limit=trial_time_limit,
                      timeout_s=_study_timeout(deadline, len(plan.studies) - i), progress=progress)
        log = (lambda line: progress.write(line + "\n")) if progress is not None else None
        entry = finalize(spec, backend, storage, top_k=top_k, rounds=rounds, time_limit=trial_time_limit, log=log)
        if progress is not None:
            if entry is None:
                progress.write(f"[{spec.label()}] no variant passed; nothing saved\n")
            else:
                speed = f"{entry.speedup:.2f}x the default" if entry.default_ms else "the default failed to run"
                progress.write(f"[{spec.label()}] winner {entry.median_ms:.4g} ms, {speed}\n")
            progress.flush()
        if entry is not None:
            results.append(entry)
            if on_result is not None:
                on_result(entry)
    return results

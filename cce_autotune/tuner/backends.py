"""Backends: what measures a variant (the real kernels on the GPU, or an analytic cost model for
tests on CPU), and which failures of a measurement become failed trials."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable, Mapping

from ..planning import costs as cost_models
from ..variant import KernelVariants, VariantError, _Variant
from .problem import TuningProblem


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

    def prepare(self, problem: TuningProblem) -> None:
        """Make ``problem``'s data before a study's clock starts (generating or training it can take
        longer than a trial)."""

    def check(self, kernel: str, variants: KernelVariants, problem: TuningProblem) -> dict:
        raise NotImplementedError

    def time(self, kernel: str, variants: KernelVariants, problem: TuningProblem) -> dict:
        raise NotImplementedError

    def calibrate(self, problem: TuningProblem, log=None):
        """The planner's cost measurements on ``problem``'s head (:class:`cce_autotune.tuner.calibrate.Measurement`)."""
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
    the same inputs; the backward's worst of a first call and the steady-state call after it. Timing: ``triton.testing.do_bench`` (warm-up, L2 flushed before every repetition,
    quantiles 0.5 / 0.2 / 0.8). indexed_dot and lse_forward time their kernel (lse_forward the sum of
    the vocabulary by position and, where the backward records a map, a walked order); backward times the
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

    def prepare(self, problem: TuningProblem) -> None:
        self._inputs(problem)

    # data and references, for one problem at a time
    def _inputs(self, problem: TuningProblem) -> dict:
        import torch

        # The GPU backend's imports are lazy: PyTorch and the kernels, which the fake backend and
        # `cce-tune --dry-run` run without.
        from ..data import TORCH_DTYPES, make_data  # (lazy)
        from ..strategies.common import RowLayout

        key = (problem, torch.cuda.current_device())
        if self._key != key:
            self._data = {}
            self._key = None
            torch.cuda.empty_cache()
            dtype = TORCH_DTYPES[problem.dtype]
            e, c, t = make_data(problem.data, problem.B, problem.V, problem.D, dtype=dtype, device="cuda",
                                seed=problem.seed)
            g = torch.Generator(device="cuda").manual_seed(problem.seed + 1)
            bias = (torch.randn(problem.V, generator=g, device="cuda") * 0.1).to(dtype) if problem.has_bias else None
            if problem.data_id and problem.has_bias:  # an activation file's own bias, where it has one
                from ..data import load_file  # (lazy: see above)

                saved = load_file(problem.data).bias
                bias = bias if saved is None else saved.to(device="cuda", dtype=dtype)
            self._data = dict(
                e=e, c=c, t=t, bias=bias, softcap=problem.softcap if problem.has_softcap else None,
                rows=RowLayout.dense(problem.B, problem.D, "cuda"),
            )
            self._key = key
        return self._data

    def _reference(self, name: str, problem: TuningProblem):
        import torch

        from ..api import linear_cross_entropy  # (lazy: see _inputs)
        from ..runtime import reference
        from ..tile_map import sort_order

        d = self._inputs(problem)
        if name in d:
            return d[name]
        f32 = lambda x: None if x is None else x.float()  # noqa: E731
        if name == "walk":  # the vocabulary by descending average logit (what a backward sorts by)
            d["walk"] = sort_order(d["e"], d["c"], d["bias"])
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

    def _runner(self, kernel: str, variants: KernelVariants, problem: TuningProblem, training: bool = False):
        """(function running the timed work, tensors whose .grad to reset). ``training``: the backward
        runs the call sequence of training (see below) on its own copy of the classifier."""
        import torch

        from ..api import linear_cross_entropy  # (lazy: see _inputs)
        from ..planning.planner import records_map
        from ..strategies import forward

        d = self._inputs(problem)
        if kernel == "indexed_dot":
            return (lambda: forward.indexed_dot(d["e"], d["c"], d["bias"], d["rows"], d["t"], d["softcap"],
                                                variants.indexed_dot)), None
        if kernel == "lse_forward":
            # The forward as calls run it: the vocabulary by position (exact calls, a classifier's first
            # call and paused ones; E and C through TMA descriptors where the GPU has them) and, where
            # the backward records a tile map, as a filtered training step walks it (a sorted order, C's
            # rows gathered, the map recorded). One variant serves both: timed as their sum.
            bw = variants.backward
            paths = [(None, None)]
            if records_map(bw, bw.filter_eps):
                paths.append((self._reference("walk", problem), self._reference("ref_zt", problem)))
            return (lambda: [forward.lse_forward(d["e"], d["c"], d["bias"], d["rows"], d["softcap"],
                                                 variants.lse_forward, perm=walk, zt=zt) for walk, zt in paths]), None
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

    def calibrate(self, problem: TuningProblem, log=None):
        import torch

        from .calibrate import measure  # (lazy: see _inputs)

        self._data, self._key = {}, None  # the calibration makes its own data
        torch.cuda.empty_cache()
        try:
            return measure(problem.B, problem.V, problem.D, data=problem.data, dtype=problem.dtype,
                           seed=problem.seed, log=log)
        finally:
            torch.cuda.empty_cache()

    def check(self, kernel: str, variants: KernelVariants, problem: TuningProblem) -> dict:
        import torch

        fn, leaves = self._runner(kernel, variants, problem)
        out = fn()
        torch.cuda.synchronize()
        if kernel == "indexed_dot":
            return {"target_logit": _rel_err(out, self._reference("ref_zt", problem))}
        if kernel == "lse_forward":  # the worst of the paths timed
            return {"lse": max(_rel_err(lse, self._reference("ref_lse", problem)) for lse, _ in out)}
        ref = self._reference("ref_grads", problem)
        worst: dict = {}
        # The worst of two calls: a classifier's first call has no tile map yet; the next one launches
        # from the map and filters as every later call of training does (its error is the one that
        # matters, and it can be several times the first's on real data).
        for call in range(2):
            if call:
                for x in leaves:
                    x.grad = None
                out = fn()
                torch.cuda.synchronize()
            errors = {
                "loss": _rel_err(out.detach(), ref["loss"]),
                "dE": _rel_err(leaves[0].grad, ref["dE"]),
                "dC": _rel_err(leaves[1].grad, ref["dC"]),
            }
            if ref["dbias"] is not None:
                errors["dbias"] = _rel_err(leaves[2].grad, ref["dbias"])
            worst = {k: max(worst.get(k, 0.0), v) for k, v in errors.items()}
        return worst

    def time(self, kernel: str, variants: KernelVariants, problem: TuningProblem) -> dict:
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

    # The coefficients this fake GPU follows (cce-tune measures them before tuning).
    TRUE_COSTS = dict(forward=1.4, sparse_per_live=10.0, recompute=1.1, products=2.2)

    def calibrate(self, problem: TuningProblem, log=None):
        from .calibrate import synthetic  # (lazy: the planner brings PyTorch)

        self.calls.append(("calibrate", "", {"B": problem.B, "V": problem.V, "D": problem.D}))
        return synthetic(cost_models.CostModel(**self.TRUE_COSTS), problem.B, problem.V, problem.D, data=problem.data)

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

    def check(self, kernel: str, variants: KernelVariants, problem: TuningProblem) -> dict:
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

    def cost_ms(self, kernel: str, v: _Variant, p: TuningProblem) -> float:
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
        jitter = 1 + 0.01 * (int(v.stable_hash()[:4], 16) / 0xFFFF - 0.5)
        return base * eff * jitter

    def time(self, kernel: str, variants: KernelVariants, problem: TuningProblem) -> dict:
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


# -- failures -----------------------------------------------------------------------------------
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

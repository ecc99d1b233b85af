"""Side-by-side benchmark: the matmul floor, PyTorch, this project, and the peers when installed.

``python -m cce_autotune.bench`` (console script ``cce-bench``) runs, in one process on one GPU and
for each shape: one cuBLAS E·Cᵀ (the floor; rows padded to 16 bytes), PyTorch (logits + F.cross_entropy), cce_autotune as
dispatched (steady state: the same classifier every call, as in training, so the remembered vocabulary
order and the tile map are used), as dispatched but with every call a first call (``cce_autotune_cold``),
with the built-in default variants, in exact mode, without a memory budget (``cce_autotune_unlimited``),
with its loops replayed as CUDA graphs (``cce_autotune_replayed``: :mod:`cce_autotune.replay`, off by
default), and - when importable - Apple's
``cut-cross-entropy`` (CCE and exact) and ``liger-kernel``'s fused linear cross-entropy. For each it
records forward and forward+backward median times (triton.testing.do_bench, which flushes L2 between
repetitions; the forward with gradients required, as a training step runs it: a plan that forms the
gradients in the forward - Liger's, our fused strategy's, which a classifier whose tiles were found
mostly live takes for its next calls - does that work in the "fw" row too), the device's busy time per call (``device_ms``, torch.profiler: the rest of a call's
time is the host's — launches, Python, syncs), the peak extra memory, and loss/gradient errors
against a float32 reference, and
prints a table, writes a CSV and (with matplotlib) a PNG chart.

Data: ``lm`` (``cce_autotune.data.lm_like``: Zipfian tokens, peaked softmax with 4 nats of mean
entropy) is the main case; ``random`` (N(0,1)/D^¼ inputs, uniform targets) the second; ``real``
(``cce_autotune.data.real``: hidden states and classifier of a small GPT trained for ``--train-steps``
steps on the Python standard library's source, on held-out text) runs on its own heads ``gpt768``,
``gpt2048``, ``gpt4096`` unless ``--shapes`` says otherwise. An activation file saved from a real run
(``--data acts.pt``; :mod:`cce_autotune.data.captured`) runs on its own head with all its rows (or the
B of a ``--shapes`` B:V:D triple); every method times the plain loss (the file's bias and softcap are
not applied). ``--softcap S`` applies a logit softcap ``S * tanh(z / S)`` (Gemma 2's 30) in every
method, the peers' included, and in the reference; the shape's name then ends in ``+softcapS``.

``--grid`` runs the heads of :data:`GRID` (the vocabulary and hidden sizes of known models, B = 8192,
Gemma 2's with its softcap; Llama 3 8B's also at 2,048 and 32,768 tokens) on LM-like data of both
generators and real data with
every mode: PyTorch, ours by default, exact, deterministic, without a memory budget, with the fp32
classifier of a mixed-precision loop under autocast (``cce_autotune_fp32_classifier``), and the peers;
``--shapes`` picks some of its heads. Every row also has ``host_ms``: the median minus the device's
busy time, the host's share of a call. (The profile that measures the busy time detaches CUPTI when
it ends: ``$TEARDOWN_CUPTI`` is set to 1 unless given. Left attached, CUPTI added 15-25 % of host
time to every later launch-heavy call of the process: 14.20 -> 16.24 ms a call at 128256 x 2048.)

``--train`` times the training call sequence instead: for each real head and each loss method, the
same pretrained small GPT takes ``--loop-steps`` further AdamW steps (bf16 autocast, fp32 master
weights), the classifier changing between calls as in training.  Rows have ``pass`` = ``train_step``:
the median (p20, p80) time of a whole step, the peak memory of a step above what the model and the
optimiser hold, and in ``err_loss`` the relative difference of the mean loss of the last steps from
the ``torch`` method's on the same batches (both are printed). ``--train --graph`` runs each loop a
second time with each step's forward and backward replayed from a CUDA graph captured once (rows
``train_step_graph``): where the host sets the pace of a small model's loop, what it costs without it. ``--train --hf llama,gemma2,qwen3`` times
Hugging Face models of those families instead, unpatched, patched and with Liger's patch
(:mod:`cce_autotune.bench_hf`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import yaml

from . import memory, replay
from .api import linear_cross_entropy
from .bench_hf import HF_METHODS, resolve_hf, run_hf_train
from .configdb import dispatch
from .data import DATA_KINDS, TORCH_DTYPES, is_file_kind, load_file, make_data
from .data import real as realdata
from .runtime import reference
from .train_steps import TRAIN_WARMUP_STEPS, time_graphed_steps, time_train_steps
from .variant import KERNELS, KernelVariants, VariantError

__all__ = ["SHAPES", "DEFAULT_SHAPES", "GRID", "resolve_shapes", "resolve_grid", "parse_data", "time_ms", "run_shape",
           "check_train_shape", "run_train", "main"]

SHAPES = {
    "gemma2": (8192, 256000, 2304),  # Gemma 2 2B (its softcap 30: --softcap 30)
    "llama3": (8192, 128256, 4096),
    "mistral": (8192, 32768, 4096),
    # Heads of the small GPTs trained on the standard library (cce_autotune.data.real).
    "gpt768": (8192, 50000, 768),
    "gpt2048": (8192, 50000, 2048),
    "gpt4096": (8192, 50000, 4096),
}
DEFAULT_SHAPES = {"lm": "gemma2,llama3,mistral", "sampled": "gemma2,llama3,mistral", "random": "gemma2,llama3,mistral",
                  "real": "gpt768,gpt2048,gpt4096"}
# --grid: the heads of known models at B = 8192 (Gemma 2's with its softcap 30), and Llama 3 8B's head at
# 2,048 and 32,768 tokens: name -> (B, V, D, softcap).
GRID = {
    "32000x4096": (8192, 32000, 4096, None),
    "50257x768": (8192, 50257, 768, None),
    "50000x2048": (8192, 50000, 2048, None),
    "128256x2048": (8192, 128256, 2048, None),
    "128256x4096": (8192, 128256, 4096, None),
    "128256x8192": (8192, 128256, 8192, None),
    "151936x896": (8192, 151936, 896, None),
    "152064x3584": (8192, 152064, 3584, None),
    "256000x2304": (8192, 256000, 2304, 30.0),
    "262208x2560": (8192, 262208, 2560, None),
    "128256x4096_B2048": (2048, 128256, 4096, None),
    "128256x4096_B32768": (32768, 128256, 4096, None),
}
GRID_DATA = "lm,sampled,real"
GRID_METHODS = ("torch", "cce_autotune", "cce_autotune_exact", "cce_autotune_fp32_classifier", "cce_autotune_deterministic",
                "cce_autotune_unlimited", "apple_cce", "liger_flce")
ERROR_CALLS = 3  # steady-state calls whose worst errors are reported
MEMORY_CALLS = 20  # calls whose peak memory is reported (more than one cycle of the planner's pauses)
COLUMNS = ["gpu", "torch", "triton", "data", "shape", "B", "V", "D", "dtype", "method", "pass", "median_ms",
           "p20_ms", "p80_ms", "ratio_to_matmul", "peak_extra_mib", "err_loss", "err_de", "err_dc", "device_ms", "host_ms"]
DEVICE_CALLS = 5  # calls profiled for the device time of a call


def parse_data(spec: str) -> list[str]:
    """The data kinds of a ``--data`` comma list; ValueError naming ``--data`` on an unknown one."""
    kinds = [k for k in spec.split(",") if k]
    for k in kinds:
        if is_file_kind(k):
            if not Path(k).is_file():
                raise ValueError(f"--data: {k}: no such activation file")
        elif k not in DATA_KINDS:
            raise ValueError(f"--data: {k!r} is not one of {list(DATA_KINDS)} nor an activation file "
                             "(cce_autotune.data.captured.save_activations)")
    if not kinds:
        raise ValueError("--data: empty list")
    return kinds


def resolve_shapes(spec: str | None, data: str) -> list[tuple[str, int, int, int]]:
    """(name, B, V, D) of each entry of a ``--shapes`` comma list (names of SHAPES or B:V:D triples);
    ``None`` means the default shapes of data kind ``data``.  ValueError naming ``--shapes``."""
    shapes = []
    if is_file_kind(data):  # an activation file: its own head, all its rows unless --shapes says B:V:D
        acts = load_file(data)
        if spec is None:
            return [(Path(data).stem, acts.n, acts.V, acts.D)]
    for s in (DEFAULT_SHAPES[data] if spec is None else spec).split(","):
        if s in SHAPES:
            shapes.append((s, *SHAPES[s]))
            continue
        try:
            B, V, D = (int(x) for x in s.split(":"))
        except ValueError:
            raise ValueError(f"--shapes: {s!r} is neither one of {sorted(SHAPES)} nor a B:V:D triple of ints") from None
        if min(B, V, D) < 1:
            raise ValueError(f"--shapes: {s!r} has a size below 1")
        shapes.append((s.replace(":", "x"), B, V, D))
    return shapes


def resolve_grid(spec: str | None) -> list[tuple[str, int, int, int, float | None]]:
    """(name, B, V, D, softcap) of the --grid heads: all of :data:`GRID`, or those a ``--shapes`` comma
    list names. ValueError naming ``--shapes``."""
    names = list(GRID) if spec is None else [s for s in spec.split(",") if s]
    unknown = [n for n in names if n not in GRID]
    if unknown or not names:
        raise ValueError(f"--shapes: with --grid, a comma list of {list(GRID)} (got {unknown or spec!r})")
    return [(n, *GRID[n]) for n in names]


def time_ms(fn: Callable[[], object], grad_to_none=None, warmup: int = 25, rep: int = 200) -> tuple[float, float, float]:
    """(p20, median, p80) in ms of ``fn`` on the current CUDA device, L2 flushed between runs."""
    import triton.testing

    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.2, 0.5, 0.8])
    return float(q[0]), float(q[1]), float(q[2])


def peak_extra_mib(fn: Callable[[], object], calls: int = 1) -> float:
    """Peak device memory allocated while ``fn`` runs ``calls`` times in a row, above what was
    allocated before, in MiB."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(calls):
        out = fn()
        del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return (peak - base) / 2**20


def device_ms(fn: Callable[[], object], grad_to_none=None, calls: int = DEVICE_CALLS) -> float:
    """The GPU's busy time per call of ``fn``, ms: the kernels' durations summed by torch.profiler,
    over ``calls`` calls. A call's median time above it is spent waiting for the host (launches,
    Python, host syncs): the fixed cost per call that small heads feel."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto leaves CUPTI attached after a profile unless $TEARDOWN_CUPTI is 1 (pytorch/pytorch#144455),
    # and CUPTI then adds host time to every later launch: the wall times measured after this call,
    # of a method with many launches most, would carry it.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
                for t in grad_to_none or []:
                    t.grad = None
            torch.cuda.synchronize()
    except RuntimeError as exc:  # a profiler that cannot start here must not stop the benchmark
        print(f"# device time unavailable: {exc!r}", file=sys.stderr)
        return math.nan
    total = 0.0
    for ev in prof.key_averages():
        total += getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
    return total / 1000.0 / calls


@dataclass
class Method:
    name: str
    loss: Callable  # (e, c, targets) -> scalar loss
    fused_backward: bool = False  # computes gradients inside the forward (liger)
    classifier_dtype: torch.dtype | None = None  # its classifier leaf's dtype, if not the run's
    setting: Callable = contextlib.nullcontext  # the context (a factory) its calls run in, forward and backward


def _mixed_methods(methods: list[Method], dtype: torch.dtype, softcap: float | None = None) -> list[Method]:
    """``--classifier fp32`` (a mixed-precision loop's fp32 master classifier with 16-bit e): PyTorch
    under autocast; ours on the fp32 classifier (no copy), after casting it first (the workaround a
    same-dtype loss needs), and on a 16-bit classifier leaf (the all-16-bit call, for comparison);
    the peers, which need one dtype, on the cast classifier."""
    out = [Method("torch", lambda e, c, t: _autocast_ce(e, c, t, dtype, softcap))]
    for m in methods:
        if m.name in ("torch", "cce_autotune_fp32_classifier"):  # (the latter: what every call of this run is)
            continue
        if m.name.startswith("cce_autotune"):
            out.append(m)
            if m.name == "cce_autotune":
                out.append(Method("cce_autotune_cast",
                                  lambda e, c, t: linear_cross_entropy(e, c.to(e.dtype), t, softcap=softcap)))
                out.append(Method("cce_autotune_all16", m.loss, classifier_dtype=dtype))
        else:
            out.append(Method(m.name, lambda e, c, t, f=m.loss: f(e, c.to(e.dtype), t), m.fused_backward))
    return out


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """fp32 logits, softcapped as a model's head does (``softcap * tanh(z / softcap)``) when asked."""
    z = logits.float()
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _autocast_ce(e, c, t, dtype, softcap=None):
    with torch.autocast("cuda", dtype=dtype):
        logits = torch.nn.functional.linear(e, c)
    return torch.nn.functional.cross_entropy(_capped(logits, softcap), t)


def _autocast_ours(e, c, t, softcap=None):
    """Ours as a mixed-precision loop calls it: inside autocast to e's dtype (16-bit), with c as given.
    An fp32 e is left to the autocast state around the call (a disabled block here would turn a
    training step's autocast off and run the loss in fp32)."""
    if e.dtype not in (torch.float16, torch.bfloat16):
        return linear_cross_entropy(e, c, t, softcap=softcap)
    with torch.autocast(e.device.type, dtype=e.dtype):
        return linear_cross_entropy(e, c, t, softcap=softcap)


def parse_knobs(spec: str) -> dict:
    """``{kernel: {knob: value}}`` of a ``--knobs`` comma list of ``kernel.knob=value`` (values read as
    YAML scalars: true, 4, 0.5, buffer); ValueError naming ``--knobs`` on an unknown kernel or knob or a
    value the knob refuses."""
    knobs: dict = {}
    for item in (x for x in spec.split(",") if x):
        name, eq, value = item.partition("=")
        kernel, dot, knob = name.partition(".")
        if not (eq and dot):
            raise ValueError(f"--knobs: {item!r} is not kernel.knob=value")
        if kernel not in KERNELS:
            raise ValueError(f"--knobs: {item!r}: no kernel {kernel!r} (kernels: {', '.join(KERNELS)})")
        names = {f.name for f in fields(KERNELS[kernel])}
        if knob not in names:
            raise ValueError(f"--knobs: {item!r}: {kernel} has no knob {knob!r} (knobs: {', '.join(sorted(names))})")
        knobs.setdefault(kernel, {})[knob] = yaml.safe_load(value)
    for kernel, changes in knobs.items():
        try:
            KERNELS[kernel]().replace(**changes)._validate_own()
        except VariantError as exc:
            raise ValueError(f"--knobs: {exc}") from exc
    return knobs


def _knob_methods(knobs: dict, softcap: float | None) -> list[Method]:
    """Ours as dispatched and in exact mode, twice each: with the variants this GPU's configs give,
    passed explicitly (``..._dispatched``), and with ``knobs`` changed in them (``..._knobs``): an A/B of
    the knobs in one run, both sides paying the same host cost of explicit variants."""
    @functools.lru_cache(maxsize=None)  # (made once per dispatched set: not a new set, re-encoded, each call)
    def with_knobs(kv):
        return kv.replace(**{k: getattr(kv, k).replace(**v) for k, v in knobs.items()})

    def variants(e, c, changed: bool):
        kv = dispatch.select_variants(e, c, has_softcap=softcap is not None)
        return with_knobs(kv) if changed else kv

    def method(name, changed, **kw):
        return Method(name, lambda e, c, t: linear_cross_entropy(e, c, t, softcap=softcap,
                                                                 variants=variants(e, c, changed), **kw))

    return [method("cce_autotune_dispatched", False), method("cce_autotune_knobs", True),
            method("cce_autotune_exact_dispatched", False, filter_eps=None),
            method("cce_autotune_exact_knobs", True, filter_eps=None)]


@contextlib.contextmanager
def _replays_on():
    """Loops replayed as CUDA graphs within (see :mod:`cce_autotune.replay`), as before after."""
    was = replay.replays()
    replay.replays(True)
    try:
        yield
    finally:
        replay.replays(was)


def _methods(include_peers: bool, softcap: float | None = None) -> list[Method]:
    """The methods of a run, each computing the loss with ``softcap`` (None: plain logits)."""
    sc = softcap
    ms = [
        Method("torch", lambda e, c, t: torch.nn.functional.cross_entropy(_capped(e @ c.T, sc), t)),
        Method("cce_autotune", lambda e, c, t: linear_cross_entropy(e, c, t, softcap=sc)),
        # Every call as the first call of its classifier: no remembered vocabulary order, no tile map.
        Method("cce_autotune_cold", lambda e, c, t: (memory.clear(), linear_cross_entropy(e, c, t, softcap=sc))[1]),
        Method("cce_autotune_default",
               lambda e, c, t: linear_cross_entropy(e, c, t, softcap=sc, variants=KernelVariants.defaults(e.element_size()))),
        Method("cce_autotune_exact", lambda e, c, t: linear_cross_entropy(e, c, t, softcap=sc, filter_eps=None)),
        # The same gradient bits every run (chunked or fused backward, no float atomics).
        Method("cce_autotune_deterministic", lambda e, c, t: linear_cross_entropy(e, c, t, softcap=sc, deterministic=True)),
        # No memory budget: the planner may take the sparse strategy's buffer of live tiles, or large
        # logit blocks for the fused strategy (the speed that memory buys).
        Method("cce_autotune_unlimited", lambda e, c, t: linear_cross_entropy(e, c, t, softcap=sc, max_extra_memory=None)),
        # A mixed-precision loop's call: the fp32 master classifier, under autocast (16-bit e).
        Method("cce_autotune_fp32_classifier", lambda e, c, t: _autocast_ours(e, c, t, sc), classifier_dtype=torch.float32),
        # The default call with loops replayed as CUDA graphs (cce_autotune.replay; off by default).
        Method("cce_autotune_replayed", lambda e, c, t: linear_cross_entropy(e, c, t, softcap=sc), setting=_replays_on),
    ]
    if not include_peers:
        return ms
    try:
        from cut_cross_entropy import linear_cross_entropy as apple

        ms.append(Method("apple_cce", lambda e, c, t: apple(e, c, t, softcap=sc)))
        ms.append(Method("apple_cce_exact", lambda e, c, t: apple(e, c, t, softcap=sc, impl="cce_exact")))
    except Exception as exc:  # not installed, or fails to import on this stack
        print(f"# apple cut-cross-entropy unavailable: {exc!r}", file=sys.stderr)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(softcap=sc)  # (its default softcap is None)
        ms.append(Method("liger_flce", lambda e, c, t: liger(c, e, t), fused_backward=True))
    except Exception as exc:
        print(f"# liger-kernel unavailable: {exc!r}", file=sys.stderr)
    return ms


def _reference(e, c, t, softcap=None):
    """fp32 loss and gradients (chunked PyTorch path, fp32 matmuls without tf32)."""
    rows = torch.arange(e.shape[0], device=e.device)
    e32, c32 = e.float(), c.float()
    lse, zt, _ = reference.forward(e32, c32, None, rows, t, softcap)
    n = e.shape[0]
    coef = torch.full((n,), 1.0 / n, device=e.device)
    de, dc, _ = reference.backward(e32, c32, None, rows, t, lse, coef, coef, softcap)
    return (lse - zt).mean(), de, dc


def _rel(x, ref) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def run_shape(name, B, V, D, data, dtype, methods, reps, meta, log=print, data_options=None,
              classifier_dtype=None, softcap=None) -> list[dict]:
    """Rows of the matmul floor and of each method's fw and fw+bw on one shape; ``data_options`` go to
    :func:`cce_autotune.data.make_data` (``steps`` for real data); ``classifier_dtype``: the
    classifier's dtype when it is not e's (fp32 for a mixed-precision loop's master weight);
    ``softcap``: the logit softcap the methods were made with (:func:`_methods`), for the reference."""
    dev = "cuda"
    e, c, t = make_data(data, B, V, D, dtype=dtype, device=dev, seed=0, **(data_options or {}))
    if classifier_dtype is not None:
        c = c.to(classifier_dtype)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss, ref_de, ref_dc = _reference(e, c, t, softcap)
    torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    rows = []
    dname = str(dtype).replace("torch.", "")
    if classifier_dtype is not None:
        dname += "+" + str(classifier_dtype).replace("torch.", "") + "_classifier"
    base = dict(meta, data=data, shape=name, B=B, V=V, D=D, dtype=dname)
    # The floor: one 16-bit matmul of the shape, its output rows padded to 16 bytes (an odd V, GPT-2's
    # 50257, leaves cuBLAS unaligned rows: 6.7 ms instead of about 0.7 at 8192 x 50257 x 768).
    V16 = -(-V // 8) * 8
    c16 = torch.zeros((V16, D), dtype=dtype, device=dev)
    c16[:V] = c
    p20, med, p80 = time_ms(lambda: e @ c16.T, rep=reps)
    floor = med
    rows.append(dict(base, method="matmul", **{"pass": "fw"}, median_ms=med, p20_ms=p20, p80_ms=p80,
                     ratio_to_matmul=1.0, peak_extra_mib=peak_extra_mib(lambda: e @ c16.T)))
    del c16
    log(f"{name} {data}: matmul {med:.2f} ms")
    for m in methods:
        with m.setting():
            try:
                ee = e.detach().clone().requires_grad_()
                cc = c.detach().to(m.classifier_dtype or c.dtype).clone().requires_grad_()
                m.loss(ee, cc, t).backward()  # a first step (what a training loop's later steps reuse)
                ee.grad = cc.grad = None
                # Errors of the steady state: the worst of the next ERROR_CALLS calls (the planner's
                # plan may change from one call to the next, e.g. a mapped probe, then fused calls).
                err = dict(err_loss=0.0, err_de=0.0, err_dc=0.0)
                for _ in range(ERROR_CALLS):
                    loss = m.loss(ee, cc, t)
                    loss.backward()
                    now = dict(err_loss=abs(float(loss.detach()) - float(ref_loss)) / abs(float(ref_loss)),
                               err_de=_rel(ee.grad, ref_de), err_dc=_rel(cc.grad, ref_dc))
                    err = {k: max(err[k], now[k]) for k in err}
                    ee.grad = cc.grad = None

                def fw():
                    return m.loss(ee, cc, t)

                def fwbw():
                    m.loss(ee, cc, t).backward()

                for pas, fn in (("fw", fw), ("fw+bw", fwbw)):
                    p20, med, p80 = time_ms(fn, grad_to_none=[ee, cc], rep=reps)
                    # (gradients dropped after each call, as an optimiser step's zero_grad(set_to_none) does)
                    mem = peak_extra_mib(lambda: (fn(), setattr(ee, "grad", None), setattr(cc, "grad", None)),
                                         calls=MEMORY_CALLS)
                    ee.grad = cc.grad = None
                    dev = device_ms(fn, grad_to_none=[ee, cc])
                    host = max(0.0, med - dev) if math.isfinite(dev) else math.nan
                    rows.append(dict(base, method=m.name, **{"pass": pas}, median_ms=med, p20_ms=p20, p80_ms=p80,
                                     ratio_to_matmul=med / floor, peak_extra_mib=mem, device_ms=dev, host_ms=host,
                                     **err))
                    log(f"{name} {data}: {m.name:22s} {pas:6s} {med:8.2f} ms  {med / floor:5.2f}x  {mem:9.1f} MiB  "
                        f"loss {err['err_loss']:.1e} dE {err['err_de']:.1e} dC {err['err_dc']:.1e}  "
                        f"device {dev:.2f} ms ({host:.2f} ms not on the device)")
                del ee, cc, loss
            except Exception as exc:  # a peer failing must not stop the others
                log(f"{name} {data}: {m.name} FAILED: {exc!r}")
        gc.collect()
        torch.cuda.empty_cache()
    del e, c, t, ref_de, ref_dc
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def check_train_shape(name: str, B: int, seq: int = realdata.DEFAULT_SEQ) -> None:
    """--train feeds whole windows of ``seq`` tokens: B must be a multiple of it."""
    if B % seq:
        raise ValueError(f"--shapes: {name} has B={B} tokens per step, not a multiple of the sequence length {seq}")


def run_train(name, B, V, D, methods, meta, *, pretrain_steps=300, loop_steps=40, warmup=TRAIN_WARMUP_STEPS,
              device="cuda", layers=None, seq=realdata.DEFAULT_SEQ, graph=False, log=print) -> list[dict]:
    """Rows (``pass`` = ``train_step``) timing whole training steps of the real-data GPT of head
    (V, D) with each loss method.

    The model is pretrained once (``pretrain_steps`` steps of B tokens, the recipe of
    :mod:`cce_autotune.data.real`); then each method starts from those same weights with a fresh AdamW
    at the learning rate the pretraining schedule ended at, and takes ``warmup`` untimed and
    ``loop_steps`` timed steps on the same batches of B tokens (a batch the pretraining has not
    drawn).  A step is timed from the host, synchronised before and after: forward, loss, backward,
    clipping and the optimiser.  Peak memory (CUDA only, else nan) is the most a timed step holds
    above what the weights and the optimiser state hold before it. ``graph``: each method's loop is run
    a second time from the same weights with each step's forward and backward replayed from a CUDA
    graph captured once (:func:`~cce_autotune.train_steps.time_graphed_steps`; rows ``train_step_graph``)."""
    check_train_shape(name, B, seq)
    device = torch.device(device)
    cfg = realdata.GPTConfig.for_width(V, D, layers=layers, seq=seq)
    train_ids = realdata.load_corpus().split(V)[0].to(device)
    t0 = time.perf_counter()
    model = realdata.GPT.create(cfg, seed=0, device=device)
    pre_loss = realdata.pretrain(model, train_ids, steps=pretrain_steps, tokens_per_step=B, seed=0)
    log(f"{name} real: pretrained {pretrain_steps} steps of {B} tokens ({cfg.layers} layers), loss {pre_loss:.3f}, "
        f"{time.perf_counter() - t0:.1f} s")
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dt = realdata.compute_dtype(device)
    lr = realdata.default_lr(D) * realdata.FINAL_LR_FRACTION
    base = dict(meta, data="real", shape=name, B=B, V=V, D=D, dtype=str(dt).replace("torch.", ""))
    modes = [("train_step", time_train_steps)] + ([("train_step_graph", time_graphed_steps)] if graph else [])
    rows, refs = [], {}  # refs: the torch method's mean loss, per pass
    for m in methods:

        def loss_fn(model, x, y, m=m):
            h = model.hidden(x).flatten(0, 1)  # under autocast the final LayerNorm's output is fp32
            if m.name.startswith("cce_autotune") and m.name != "cce_autotune_cast":
                # As a user's loop calls it: the fp32 hidden states and the fp32 master weight; the
                # loss casts e as autocast would and reads the classifier without a copy.
                return m.loss(h, model.lm_head.weight, y.flatten())
            # The others get e and c in the compute dtype, as autocast would hand them to lm_head:
            # a cast copy of c every step (for cce_autotune_cast, the workaround a loss that needs
            # c.dtype == e.dtype leaves).
            return m.loss(h.to(dt), model.lm_head.weight.to(dt), y.flatten())

        for pass_name, timed in modes:
            with m.setting():
                try:
                    model.load_state_dict(init)
                    model.zero_grad(set_to_none=True)
                    memory.clear()
                    opt = realdata.make_optimizer(model, lr)
                    row, loss = timed(model, opt, realdata.batches(train_ids, B // seq, seq, seed=1), loss_fn,
                                      warmup, loop_steps, device, refs.get(pass_name))
                    if m.name == "torch":
                        refs[pass_name], row["err_loss"] = loss, 0.0
                    rows.append(dict(base, method=m.name, **row))
                    med, mem = row["median_ms"], row["peak_extra_mib"]
                    ref = f"{refs[pass_name]:.4f}" if pass_name in refs else "n/a"
                    log(f"{name} real: {m.name:22s} {pass_name} {med:8.2f} ms  {mem:9.1f} MiB  loss {loss:.4f} "
                        f"(torch {ref})")
                    del opt
                except Exception as exc:  # a peer failing (or one that cannot be captured) must not stop the others
                    log(f"{name} real: {m.name} {pass_name} FAILED: {exc!r}")
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    rows = [r for r in rows if r["pass"] in ("fw", "fw+bw")]
    if not rows:
        return False
    keys = sorted({(r["shape"], r["data"]) for r in rows})
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "matmul"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, pas in zip(axes, ("fw", "fw+bw")):
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ys = [next((r["ratio_to_matmul"] for r in rows if (r["shape"], r["data"]) == k and r["method"] == m
                        and r["pass"] == pas), 0.0) for k in keys]
            ax.bar([j + i * width for j in range(len(keys))], ys, width, label=m)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], [f"{s}\n{d}" for s, d in keys])
        ax.set_title(f"{pas}: time / one bf16 matmul (lower is better)")
    axes[0].set_ylabel("× matmul floor")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def print_table(rows: list[dict]) -> None:
    wp = max([6] + [len(r["pass"]) for r in rows])  # (train_step_graph)
    print(f"{'shape':8s} {'data':6s} {'method':22s} {'pass':{wp}s} {'ms':>8s} {'x mm':>6s} {'MiB':>9s} "
          f"{'err_loss':>8s} {'err_dE':>8s} {'err_dC':>8s}")
    for r in rows:
        print(f"{r['shape']:8s} {r['data']:6s} {r['method']:22s} {r['pass']:{wp}s} {r['median_ms']:8.2f} "
              f"{r['ratio_to_matmul']:6.2f} {r['peak_extra_mib']:9.1f} {r.get('err_loss', float('nan')):8.1e} "
              f"{r.get('err_de', float('nan')):8.1e} {r.get('err_dc', float('nan')):8.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cce-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None,
                    help=f"comma list of {sorted(SHAPES)} or B:V:D triples (default per data kind: {DEFAULT_SHAPES})")
    ap.add_argument("--data", default=None,
                    help=f"comma list of {', '.join(DATA_KINDS)} or activation files (.pt, written by "
                         "cce_autotune.data.captured.save_activations / capture: their own head, all their rows)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--classifier", default="same", choices=["same", "fp32"],
                    help="fp32: a mixed-precision loop's fp32 classifier with --dtype e (PyTorch under autocast, "
                         "ours without a copy, ours after casting, ours all-16-bit)")
    ap.add_argument("--no-peers", action="store_true", help="skip Apple's and Liger's kernels")
    ap.add_argument("--softcap", type=float, default=None, metavar="S",
                    help="logit softcap S * tanh(z / S) in every method and the reference (Gemma 2: 30); "
                         "not with --train")
    ap.add_argument("--methods", default="", help="comma list to keep (default: all available)")
    ap.add_argument("--reps", type=int, default=200, help="do_bench repetition time per measurement, ms")
    ap.add_argument("--train-steps", type=int, default=300,
                    help="training steps of the real-data models (--data real, --train); trained once, then cached")
    ap.add_argument("--train", action="store_true",
                    help="time whole training steps of the real-data GPTs per loss method instead of the loss alone "
                         "(real data only; each GPT is first trained in-process for --train-steps steps)")
    ap.add_argument("--hf", default=None, metavar="FAMILIES",
                    help="--train: Hugging Face models of these families instead of the GPTs (comma list of "
                         "llama, gemma2, qwen3, or all; a few decoder layers of the released model's widths, built "
                         "from configs, unpatched, patch(model) and Liger's patch; --shapes adds the GPTs back)")
    ap.add_argument("--graph", action="store_true",
                    help="--train: each method's loop again, from the same weights, with each step's forward and "
                         "backward replayed from a CUDA graph captured once (clipping and the optimiser outside it): "
                         "the loop without its host time; the GPTs only")
    ap.add_argument("--loop-steps", type=int, default=40,
                    help=f"--train: timed steps per method, after {TRAIN_WARMUP_STEPS} untimed ones")
    ap.add_argument("--grid", action="store_true",
                    help=f"the grid: every head of {list(GRID)} (or those --shapes names), on --data (default "
                         f"{GRID_DATA}), with {', '.join(GRID_METHODS)} (those that import); Gemma 2's head with its "
                         "softcap 30")
    ap.add_argument("--knobs", default=None, metavar="KERNEL.KNOB=VALUE,...",
                    help="an A/B of kernel knobs in one run: adds cce_autotune_dispatched and cce_autotune_knobs "
                         "(and their _exact counterparts): ours with the variants this GPU's configs give, and "
                         "with these knobs changed in them (e.g. lse_forward.num_splits=8,backward.chunk_v=2048)")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the CSV and PNG")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    args = ap.parse_args(argv)
    try:
        knobs = parse_knobs(args.knobs) if args.knobs is not None else {}
    except ValueError as exc:
        ap.error(str(exc))
    if args.knobs is not None and not knobs:
        ap.error("--knobs: no kernel.knob=value given")
    hf_families = []
    if args.hf is not None:
        if not args.train:
            ap.error("--hf: times whole training steps; give --train too")
        try:
            hf_families = resolve_hf(args.hf)
        except ValueError as exc:
            ap.error(str(exc))
    if args.graph and (not args.train or args.hf is not None):
        ap.error("--graph: times the GPTs' training steps replayed from a CUDA graph; give --train (without --hf)")
    if args.grid and (args.train or args.softcap is not None or args.classifier != "same"):
        ap.error("--grid: times the heads alone, with their own softcaps and every mode (the fp32 classifier "
                 "included); not with --train, --softcap or --classifier")
    try:
        kinds = ["real"] if args.train else parse_data(args.data or (GRID_DATA if args.grid else "lm,random"))
        if args.grid:
            plan = [(data, shape) for data in kinds for shape in resolve_grid(args.shapes)]
        elif hf_families and args.shapes is None:
            plan = []  # (only the Hugging Face models)
        else:
            plan = [(data, (*shape, args.softcap)) for data in kinds for shape in resolve_shapes(args.shapes, data)]
        if args.train:
            for _, (name, B, _, _, _) in plan:
                check_train_shape(name, B)
    except ValueError as exc:
        ap.error(str(exc))
    if args.train_steps < 0:
        ap.error(f"--train-steps: expected >= 0, got {args.train_steps}")
    if args.loop_steps < 1:
        ap.error(f"--loop-steps: expected >= 1, got {args.loop_steps}")
    if args.train and args.dtype != "bf16":
        ap.error(f"--dtype: --train trains under bf16 autocast, got {args.dtype}")
    if args.softcap is not None and not (math.isfinite(args.softcap) and args.softcap > 0):
        ap.error(f"--softcap: expected a positive number, got {args.softcap}")
    if args.softcap is not None and args.train:
        ap.error("--softcap: --train trains the real-data GPTs, whose head has no softcap")
    dtype = TORCH_DTYPES[args.dtype]
    classifier_dtype = None
    if args.classifier == "fp32":
        if dtype == torch.float32:
            ap.error("--classifier fp32: needs a 16-bit --dtype")
        classifier_dtype = torch.float32
    keep = set(args.methods.split(",")) if args.methods else set(GRID_METHODS) if args.grid else None
    if knobs and keep is not None and not args.methods:
        keep |= {m.name for m in _knob_methods(knobs, None)}

    @functools.cache  # (one list of methods per softcap of the run's heads)
    def offered(softcap):
        methods = _methods(not args.no_peers, softcap) + (_knob_methods(knobs, softcap) if knobs else [])
        if args.train:  # ours after casting the master weight to the compute dtype (see run_train); every
            # cce_autotune method of a training step already takes the fp32 master weight under autocast
            methods = [m for m in methods if m.name != "cce_autotune_fp32_classifier"]
            methods.append(Method("cce_autotune_cast", lambda e, c, t: linear_cross_entropy(e, c, t)))
        if classifier_dtype is not None:
            methods = _mixed_methods(methods, dtype, softcap)
        return methods

    def methods_for(softcap):
        return [m for m in offered(softcap) if keep is None or m.name in keep]

    if args.methods:  # (a name no part of the run offers would be skipped without a word)
        names = set(HF_METHODS) if hf_families else set()
        for softcap in {shape[-1] for _, shape in plan}:
            names |= {m.name for m in offered(softcap)}
        unknown = sorted(keep - names)
        if unknown:
            ap.error(f"--methods: {', '.join(unknown)} not among this run's methods ({', '.join(sorted(names))}; "
                     "a peer is offered where it imports)")
    if not torch.cuda.is_available():
        print("cce-bench: no CUDA GPU found; the benchmark times GPU kernels", file=sys.stderr)
        return 2
    import triton

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}", flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    rows = []
    out = Path(args.out)
    stem = f"{'train' if args.train else 'grid' if args.grid else 'bench'}_{meta['gpu'].replace(' ', '_')}{('_' + args.tag) if args.tag else ''}"
    for data, (name, B, V, D, softcap) in plan:
        methods = methods_for(softcap)
        if args.train:
            rows += run_train(name, B, V, D, methods, meta, pretrain_steps=args.train_steps,
                              loop_steps=args.loop_steps, graph=args.graph, log=log)
        else:
            options = {"steps": args.train_steps} if data == "real" else {}
            if softcap is not None:
                name = f"{name}+softcap{softcap:g}"
            rows += run_shape(name, B, V, D, data, dtype, methods, args.reps, meta, log=log, data_options=options,
                              classifier_dtype=classifier_dtype, softcap=softcap)
        write_csv(rows, out / f"{stem}.csv")  # (after each head: a run cut short keeps what it measured)
    if hf_families:
        for family in hf_families:
            rows += run_hf_train(family, meta, methods=[m for m in HF_METHODS if keep is None or m in keep],
                                 loop_steps=args.loop_steps, log=log)
    write_csv(rows, out / f"{stem}.csv")
    drew = plot(rows, out / f"{stem}.png")
    print_table(rows)
    print(f"# wrote {out / (stem + '.csv')}" + (f" and {stem}.png" if drew else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

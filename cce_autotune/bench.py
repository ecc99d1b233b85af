"""Side-by-side benchmark: the matmul floor, PyTorch, this project, and the peers when installed.

``python -m cce_autotune.bench`` (console script ``cce-bench``) runs, in one process on one GPU and
for each shape: one cuBLAS E·Cᵀ (the floor), PyTorch (logits + F.cross_entropy), cce_autotune as
dispatched (steady state: the same classifier every call, as in training, so the remembered vocabulary
order and the tile map are used), as dispatched but with every call a first call (``cce_autotune_cold``),
with the built-in default variants and in exact mode, and - when importable - Apple's
``cut-cross-entropy`` (CCE and exact) and ``liger-kernel``'s fused linear cross-entropy. For each it
records forward and forward+backward median times (triton.testing.do_bench, which flushes L2 between
repetitions), the peak extra memory, and loss/gradient errors against a float32 reference, and
prints a table, writes a CSV and (with matplotlib) a PNG chart.

Data: ``lm`` (``cce_autotune.data.lm_like``: Zipfian tokens, peaked softmax with 4 nats of mean
entropy) is the main case; ``random`` (N(0,1)/D^¼ inputs, uniform targets) the second.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import reference, vocab_order
from .data import make_data
from .dispatch import default_variants
from .loss import linear_cross_entropy

__all__ = ["SHAPES", "time_ms", "main"]

SHAPES = {
    "gemma2": (8192, 256128, 2304),
    "llama3": (8192, 128256, 4096),
    "mistral": (8192, 32768, 4096),
}
COLUMNS = ["gpu", "torch", "triton", "data", "shape", "B", "V", "D", "dtype", "method", "pass", "median_ms",
           "p20_ms", "p80_ms", "ratio_to_matmul", "peak_extra_mib", "err_loss", "err_de", "err_dc"]


def time_ms(fn: Callable[[], object], grad_to_none=None, warmup: int = 25, rep: int = 200) -> tuple[float, float, float]:
    """(p20, median, p80) in ms of ``fn`` on the current CUDA device, L2 flushed between runs."""
    import triton.testing

    q = triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.2, 0.5, 0.8])
    return float(q[0]), float(q[1]), float(q[2])


def peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak device memory allocated while ``fn`` runs, above what was allocated before, in MiB."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2**20


@dataclass
class Method:
    name: str
    loss: Callable  # (e, c, targets) -> scalar loss
    fused_backward: bool = False  # computes gradients inside the forward (liger)


def _methods(include_peers: bool) -> list[Method]:
    ms = [
        Method("torch", lambda e, c, t: torch.nn.functional.cross_entropy((e @ c.T).float(), t)),
        Method("cce_autotune", lambda e, c, t: linear_cross_entropy(e, c, t)),
        # Every call as the first call of its classifier: no remembered vocabulary order, no tile map.
        Method("cce_autotune_cold", lambda e, c, t: (vocab_order.clear(), linear_cross_entropy(e, c, t))[1]),
        Method("cce_autotune_default", lambda e, c, t: linear_cross_entropy(e, c, t, variants=default_variants(e.element_size()))),
        Method("cce_autotune_exact", lambda e, c, t: linear_cross_entropy(e, c, t, filter_eps=None)),
    ]
    if not include_peers:
        return ms
    try:
        from cut_cross_entropy import linear_cross_entropy as apple

        ms.append(Method("apple_cce", lambda e, c, t: apple(e, c, t)))
        ms.append(Method("apple_cce_exact", lambda e, c, t: apple(e, c, t, impl="cce_exact")))
    except Exception as exc:  # not installed, or fails to import on this stack
        print(f"# apple cut-cross-entropy unavailable: {exc!r}", file=sys.stderr)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        ms.append(Method("liger_flce", lambda e, c, t: liger(c, e, t), fused_backward=True))
    except Exception as exc:
        print(f"# liger-kernel unavailable: {exc!r}", file=sys.stderr)
    return ms


def _reference(e, c, t):
    """fp32 loss and gradients (chunked PyTorch path, fp32 matmuls without tf32)."""
    rows = torch.arange(e.shape[0], device=e.device)
    e32, c32 = e.float(), c.float()
    lse, zt = reference.forward(e32, c32, None, rows, t)
    n = e.shape[0]
    coef = torch.full((n,), 1.0 / n, device=e.device)
    de, dc, _ = reference.backward(e32, c32, None, rows, t, lse, coef, coef)
    return (lse - zt).mean(), de, dc


def _rel(x, ref) -> float:
    return float((x.float() - ref).norm() / ref.norm())


def run_shape(name, B, V, D, data, dtype, methods, reps, meta, log=print) -> list[dict]:
    dev = "cuda"
    e, c, t = make_data(data, B, V, D, dtype=dtype, device=dev, seed=0)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss, ref_de, ref_dc = _reference(e, c, t)
    torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    rows = []
    base = dict(meta, data=data, shape=name, B=B, V=V, D=D, dtype=str(dtype).replace("torch.", ""))
    p20, med, p80 = time_ms(lambda: e @ c.T, rep=reps)
    floor = med
    rows.append(dict(base, method="matmul", **{"pass": "fw"}, median_ms=med, p20_ms=p20, p80_ms=p80,
                     ratio_to_matmul=1.0, peak_extra_mib=peak_extra_mib(lambda: e @ c.T)))
    log(f"{name} {data}: matmul {med:.2f} ms")
    for m in methods:
        try:
            ee = e.detach().clone().requires_grad_()
            cc = c.detach().clone().requires_grad_()
            m.loss(ee, cc, t).backward()  # a first step (what a training loop's later steps reuse)
            ee.grad = cc.grad = None
            loss = m.loss(ee, cc, t)  # errors of a steady-state step
            loss.backward()
            err = dict(err_loss=abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                       err_de=_rel(ee.grad, ref_de), err_dc=_rel(cc.grad, ref_dc))
            ee.grad = cc.grad = None

            def fw():
                return m.loss(ee, cc, t)

            def fwbw():
                m.loss(ee, cc, t).backward()

            for pas, fn in (("fw", fw), ("fw+bw", fwbw)):
                p20, med, p80 = time_ms(fn, grad_to_none=[ee, cc], rep=reps)
                mem = peak_extra_mib(fn)
                ee.grad = cc.grad = None
                rows.append(dict(base, method=m.name, **{"pass": pas}, median_ms=med, p20_ms=p20, p80_ms=p80,
                                 ratio_to_matmul=med / floor, peak_extra_mib=mem, **err))
                log(f"{name} {data}: {m.name:22s} {pas:6s} {med:8.2f} ms  {med / floor:5.2f}x  {mem:9.1f} MiB  "
                    f"loss {err['err_loss']:.1e} dE {err['err_de']:.1e} dC {err['err_dc']:.1e}")
            del ee, cc, loss
        except Exception as exc:  # a peer failing must not stop the others
            log(f"{name} {data}: {m.name} FAILED: {exc!r}")
        gc.collect()
        torch.cuda.empty_cache()
    del e, c, t, ref_de, ref_dc
    gc.collect()
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
    print(f"{'shape':8s} {'data':6s} {'method':22s} {'pass':6s} {'ms':>8s} {'x mm':>6s} {'MiB':>9s} "
          f"{'err_loss':>8s} {'err_dE':>8s} {'err_dC':>8s}")
    for r in rows:
        print(f"{r['shape']:8s} {r['data']:6s} {r['method']:22s} {r['pass']:6s} {r['median_ms']:8.2f} "
              f"{r['ratio_to_matmul']:6.2f} {r['peak_extra_mib']:9.1f} {r.get('err_loss', float('nan')):8.1e} "
              f"{r.get('err_de', float('nan')):8.1e} {r.get('err_dc', float('nan')):8.1e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="cce-bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="gemma2,llama3,mistral",
                    help=f"comma list of {sorted(SHAPES)} or B:V:D triples")
    ap.add_argument("--data", default="lm,random", help="comma list of lm, random")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--no-peers", action="store_true", help="skip Apple's and Liger's kernels")
    ap.add_argument("--methods", default="", help="comma list to keep (default: all available)")
    ap.add_argument("--reps", type=int, default=200, help="do_bench repetition time per measurement, ms")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the CSV and PNG")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cce-bench: no CUDA GPU found; the benchmark times GPU kernels", file=sys.stderr)
        return 2
    import triton

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    shapes = []
    for s in args.shapes.split(","):
        if s in SHAPES:
            shapes.append((s, *SHAPES[s]))
        else:
            B, V, D = (int(x) for x in s.split(":"))
            shapes.append((s.replace(":", "x"), B, V, D))
    methods = _methods(not args.no_peers)
    if args.methods:
        keep = set(args.methods.split(","))
        methods = [m for m in methods if m.name in keep]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    print(f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}", flush=True)
    rows = []
    for data in args.data.split(","):
        for name, B, V, D in shapes:
            rows += run_shape(name, B, V, D, data, dtype, methods, args.reps, meta,
                              log=lambda s: print(s, flush=True))
    out = Path(args.out)
    stem = f"bench_{meta['gpu'].replace(' ', '_')}{('_' + args.tag) if args.tag else ''}"
    write_csv(rows, out / f"{stem}.csv")
    drew = plot(rows, out / f"{stem}.png")
    print_table(rows)
    print(f"# wrote {out / (stem + '.csv')}" + (f" and {stem}.png" if drew else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

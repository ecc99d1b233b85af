"""Host time of a call, A/B: the wall time and the process's CPU time (every thread: autograd runs a
CUDA backward in a thread of its own) of forward + backward in the training call sequence (the
classifier moves a little before every call), per call, median over runs.

    PYTHONPATH=<tree> python benchmarks/host_ab.py --tag old --shape 8192:50000:768 --calls 200

Prints one line per shape: the wall median, the CPU time median (the host's work: Python, launches,
syncs), both in ms. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cce_autotune import linear_cross_entropy
from cce_autotune.data import make_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--shape", action="append", required=True, help="B:V:D (repeatable)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--data", default="lm")
    args = ap.parse_args()
    for spec in args.shape:
        B, V, D = (int(x) for x in spec.split(":"))
        e, c, t = make_data(args.data, B, V, D, dtype=torch.bfloat16, device="cuda", seed=0)
        e = e.detach().requires_grad_()
        c = c.detach().clone().requires_grad_()
        drift = torch.randn_like(c) * (0.01 * float(c.float().std()))
        walls, cpus = [], []
        for k in range(args.calls + 20):
            with torch.no_grad():
                c.add_(drift, alpha=1.0 if k % 2 else -1.0)
            e.grad = c.grad = None
            torch.cuda.synchronize()
            w0, c0 = time.perf_counter(), time.process_time()
            linear_cross_entropy(e, c, t).backward()
            c1 = time.process_time()
            torch.cuda.synchronize()
            w1 = time.perf_counter()
            if k >= 20:
                walls.append((w1 - w0) * 1e3)
                cpus.append((c1 - c0) * 1e3)
        print(f"{args.tag} {spec}: wall {statistics.median(walls):.3f} ms, host cpu {statistics.median(cpus):.3f} ms "
              f"(p20 {statistics.quantiles(cpus, n=5)[0]:.3f}, p80 {statistics.quantiles(cpus, n=5)[3]:.3f})", flush=True)


if __name__ == "__main__":
    main()

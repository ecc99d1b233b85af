"""Two losses on one classifier in a step (an auxiliary or distillation head on one lm_head), issue 21
item 1: the dE error of loss A against an exact call, with and without loss B's calls in between,
median over steps. The classifier moves a little before every step (an optimiser's update in place).

    PYTHONPATH=<tree> python benchmarks/two_losses.py --tag new --shape 8192:128256:2048 --steps 40

Prints one line per setting: the median and max relative dE error of loss A, and of loss B. Needs a
CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from cce_autotune import linear_cross_entropy
from cce_autotune.data import make_data


def rel(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--shape", default="8192:128256:2048", help="B:V:D")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--data", default="lm")
    args = ap.parse_args()
    B, V, D = (int(x) for x in args.shape.split(":"))
    e, c, t = make_data(args.data, B, V, D, dtype=torch.bfloat16, device="cuda", seed=0)
    e_b, _, t_b = make_data(args.data, B, V, D, dtype=torch.bfloat16, device="cuda", seed=1)
    t_b = t_b[torch.randperm(B, device="cuda")]  # another loss's targets: not this generator's own
    c = c.detach().clone()
    drift = torch.randn_like(c) * (0.002 * float(c.float().std()))

    def grad_e(rows, targets, **kw):
        x = rows.detach().requires_grad_()
        linear_cross_entropy(x, c, targets, **kw).backward()
        return x.grad

    for setting in ("alone", "with_b"):
        from cce_autotune import memory

        memory.clear()
        errs_a, errs_b = [], []
        for step in range(args.steps):
            c.add_(drift, alpha=1.0 if step % 2 else -1.0)
            ga = grad_e(e, t)
            errs_a.append(rel(ga, grad_e(e, t, filter_eps=None)))
            if setting == "with_b":
                gb = grad_e(e_b, t_b)
                errs_b.append(rel(gb, grad_e(e_b, t_b, filter_eps=None)))
        line = (f"{args.tag} {args.shape} {setting}: loss A dE err median {statistics.median(errs_a):.2e} "
                f"max {max(errs_a):.2e}")
        if errs_b:
            line += f"; loss B median {statistics.median(errs_b):.2e} max {max(errs_b):.2e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()

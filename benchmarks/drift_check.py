"""Device check: fw+bw of the dispatched path when the classifier drifts between calls, as in
training (each call first adds noise of ``rel`` x std(C) to C in place, like an optimiser step), against
a fixed classifier (steady state) and a first call every time (no remembered order).

    python benchmarks/drift_check.py gemma2 0.01
"""

import sys

import torch

from cce_autotune import linear_cross_entropy, vocab_order
from cce_autotune.bench import SHAPES, time_ms
from cce_autotune.data import make_data


def main(name="gemma2", rel=0.01, reps=60):
    B, V, D = SHAPES[name]
    e, c, t = make_data("lm", B, V, D, dtype=torch.bfloat16, device="cuda")
    e.requires_grad_()
    c.requires_grad_()
    noise = torch.randn_like(c) * (rel * float(c.float().std()))
    floor = time_ms(lambda: e @ c.T, rep=reps)[1]

    def step(drift=False, cold=False):
        if drift:
            with torch.no_grad():
                c.add_(noise.roll(int(torch.randint(0, V, ()).item()), 0))
        if cold:
            vocab_order.clear()
        linear_cross_entropy(e, c, t).backward()

    for label, kw in (("fixed C", {}), (f"C drifts {rel:g} std per call", dict(drift=True)),
                      ("first call every time", dict(cold=True))):
        step(**kw)
        ms = time_ms(lambda: step(**kw), grad_to_none=[e, c], rep=reps)[1]
        print(f"{name} fw+bw {label:32s} {ms:7.2f} ms  {ms / floor:.2f}x mm ({floor:.2f} ms)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemma2", float(sys.argv[2]) if len(sys.argv) > 2 else 0.01)

"""Device check: fw+bw of the dispatched path when the classifier changes between calls, as in
training (each call first adds +-noise of ``rel`` x std(C) to C in place, alternating the sign so
that C does not wander off; the order remembered from the previous call is then always one step
stale), against a fixed classifier (steady state) and a first call every time (no remembered
order). The in-place update itself is timed separately and subtracted.

    python benchmarks/drift_check.py gemma2 0.01
"""

import sys

import torch

from cce_autotune import linear_cross_entropy, memory
from cce_autotune.bench import SHAPES, time_ms
from cce_autotune.data import make_data


def main(name="gemma2", rel=0.01, reps=60):
    B, V, D = SHAPES[name]
    e, c, t = make_data("lm", B, V, D, dtype=torch.bfloat16, device="cuda")
    e.requires_grad_()
    c.requires_grad_()
    noise = torch.randn_like(c) * (rel * float(c.float().std()))
    floor = time_ms(lambda: e @ c.T, rep=reps)[1]

    sign = [1.0]

    def update():
        with torch.no_grad():
            c.add_(noise, alpha=sign[0])
        sign[0] = -sign[0]

    def step(drift=False, cold=False):
        if drift:
            update()
        if cold:
            memory.clear()
        linear_cross_entropy(e, c, t).backward()

    upd = time_ms(update, rep=reps)[1]
    print(f"{name} in-place update of C alone: {upd:.2f} ms (subtracted below)", flush=True)
    for label, kw in (("fixed C", {}), (f"C drifts {rel:g} std per call", dict(drift=True)),
                      ("first call every time", dict(cold=True))):
        step(**kw)
        ms = time_ms(lambda: step(**kw), grad_to_none=[e, c], rep=reps)[1] - (upd if kw.get("drift") else 0.0)
        print(f"{name} fw+bw {label:32s} {ms:7.2f} ms  {ms / floor:.2f}x mm ({floor:.2f} ms)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gemma2", float(sys.argv[2]) if len(sys.argv) > 2 else 0.01)

"""Quick GPU sweep of LSE-forward and backward variants on the benchmark shapes (LM-like data).

Prints, per shape and variant: median ms, ratio to one cuBLAS matmul of the shape, and the error of
the result (forward: LSE against fp32; fw+bw: dE/dC against fp32). A hand-run precursor of cce-tune
for choosing the built-in defaults; its output goes into the issue notes, never into tests.
"""

import argparse
import sys

import torch

from cce_autotune import BackwardVariant, KernelVariants, LSEForwardVariant, linear_cross_entropy
from cce_autotune.bench import SHAPES, _reference, _rel, time_ms
from cce_autotune.data import lm_like
from cce_autotune.loss import _prepare
from cce_autotune import kernels, reference

FW = [
    dict(block_b=128, block_v=128, block_d=64, num_warps=8, num_stages=3),
    dict(block_b=128, block_v=256, block_d=64, num_warps=8, num_stages=3),
    dict(block_b=128, block_v=256, block_d=64, num_warps=8, num_stages=4),
    dict(block_b=256, block_v=128, block_d=64, num_warps=8, num_stages=3),
    dict(block_b=128, block_v=128, block_d=64, num_warps=4, num_stages=4),
    dict(block_b=64, block_v=256, block_d=64, num_warps=4, num_stages=4),
    dict(block_b=128, block_v=256, block_d=32, num_warps=8, num_stages=5),
    dict(block_b=128, block_v=256, block_d=64, num_warps=8, num_stages=3, num_splits=64),
    dict(block_b=128, block_v=256, block_d=64, num_warps=8, num_stages=3, num_splits=4),
]
BW = [
    dict(block_b=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="tiles"),
    dict(block_b=256, block_v=128, block_d=32, num_warps=8, num_stages=2, strategy="tiles"),
    dict(block_b=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked", chunk_v=1024),
    dict(block_b=128, block_v=256, block_d=64, num_warps=8, num_stages=3, strategy="chunked", chunk_v=4096),
    dict(block_b=128, block_v=128, block_d=64, num_warps=8, num_stages=3, strategy="chunked", chunk_v=1024, filter_eps=None),
    dict(block_b=128, block_v=256, block_d=64, num_warps=8, num_stages=3, strategy="chunked", chunk_v=4096, filter_eps=None),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="gemma2,llama3,mistral")
    ap.add_argument("--which", default="fw,bw")
    args = ap.parse_args()
    for name in args.shapes.split(","):
        B, V, D = SHAPES[name]
        e, c, t = lm_like(B, V, D, dtype=torch.bfloat16, device="cuda")
        floor = time_ms(lambda: e @ c.T, rep=100)[1]
        ref_loss, ref_de, ref_dc = _reference(e, c, t)
        ref_lse = reference.forward(e.float(), c.float(), None, torch.arange(B, device="cuda"), t)[0]
        print(f"== {name} B={B} V={V} D={D}: matmul {floor:.2f} ms", flush=True)
        p = _prepare(e, c, t, None, -100, None, "mean", 0, False, "auto", "triton", KernelVariants())
        if "fw" in args.which:
            for kw in FW:
                v = LSEForwardVariant(**kw)
                try:
                    lse, _ = kernels.lse_forward(e, c, None, p.layout, None, v)
                    err = _rel(lse, ref_lse)
                    ms = time_ms(lambda: kernels.lse_forward(e, c, None, p.layout, None, v), rep=100)[1]
                    print(f"fw {name} {kw}: {ms:.2f} ms {ms / floor:.2f}x err_lse {err:.1e}", flush=True)
                except Exception as exc:
                    print(f"fw {name} {kw}: FAILED {exc!r}"[:300], flush=True)
        if "bw" in args.which:
            for kw in BW:
                kv = KernelVariants(backward=BackwardVariant(**kw))
                try:
                    ee = e.detach().clone().requires_grad_()
                    cc = c.detach().clone().requires_grad_()
                    linear_cross_entropy(ee, cc, t, variants=kv).backward()
                    errs = f"dE {_rel(ee.grad, ref_de):.1e} dC {_rel(cc.grad, ref_dc):.1e}"
                    ms = time_ms(lambda: linear_cross_entropy(ee, cc, t, variants=kv).backward(),
                                 grad_to_none=[ee, cc], rep=100)[1]
                    print(f"fwbw {name} {kw}: {ms:.2f} ms {ms / floor:.2f}x {errs}", flush=True)
                except Exception as exc:
                    print(f"fwbw {name} {kw}: FAILED {exc!r}"[:300], flush=True)
        del e, c, t, ref_de, ref_dc, ref_lse
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())

"""Development probe for the tile map (not the benchmark): per shape, time the pieces of a
forward + backward with the dispatched variants with and without ``backward.tile_map``, count the
tiles the map launches, and check gradient errors against the fp32 reference.

    python benchmarks/probe_tilemap.py gemma2 llama3 mistral
"""

import sys
import time

import torch

from cce_autotune import kernels, linear_cross_entropy, tile_map, vocab_order
from cce_autotune.bench import SHAPES, _reference, _rel, peak_extra_mib, time_ms
from cce_autotune.data import make_data
from cce_autotune.dispatch import select_variants


def main(names, reps=60):
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    counts = []
    real_live = tile_map.live_tiles

    def counting(tmap, lse, eps, V, bb, bv, gb, swizzle=True):
        ids, grid = real_live(tmap, lse, eps, V, bb, bv, gb, swizzle=swizzle)
        counts.append((ids.numel(), -(-lse.numel() // bb) * -(-V // bv)))
        return ids, grid

    kernels.live_tiles = counting
    for name in names:
        B, V, D = SHAPES[name]
        e, c, t = make_data("lm", B, V, D, dtype=torch.bfloat16, device="cuda")
        ref_loss, ref_de, ref_dc = _reference(e, c, t)
        kv0 = select_variants(e, c)
        floor = time_ms(lambda: e @ c.T, rep=reps)[1]
        print(f"{name}: matmul {floor:.2f} ms; variants {kv0.backward.to_dict()}", flush=True)
        bw = kv0.backward
        for label, kv in (("tiles", kv0.replace(backward=bw.replace(strategy="tiles"))),
                          ("sparse", kv0.replace(backward=bw.replace(strategy="sparse"))),
                          ("sparse64", kv0.replace(backward=bw.replace(strategy="sparse", out_block_d=64))),
                          ("sparse_s2", kv0.replace(backward=bw.replace(strategy="sparse", num_stages=2)))):
            vocab_order.clear()
            ee = e.detach().clone().requires_grad_()
            cc = c.detach().clone().requires_grad_()
            f = lambda: linear_cross_entropy(ee, cc, t, variants=kv)
            for _ in range(2):  # the second call walks the remembered order
                counts.clear()
                ee.grad = cc.grad = None
                loss = f()
                loss.backward()
            err = f"loss {abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)):.1e} dE {_rel(ee.grad, ref_de):.2e} dC {_rel(cc.grad, ref_dc):.2e}"
            live = f"live {counts[-1][0]}/{counts[-1][1]} = {counts[-1][0] / counts[-1][1]:.3f}" if counts else "live n/a"
            ee.grad = cc.grad = None
            with torch.no_grad():
                t_fw = time_ms(f, rep=reps)[1]
            t_fwg = time_ms(f, rep=reps)[1]  # forward that records what the backward needs
            mem_fw = peak_extra_mib(f)
            t_fb = time_ms(lambda: f().backward(), grad_to_none=[ee, cc], rep=reps)[1]
            mem_fb = peak_extra_mib(lambda: f().backward())
            print(f"{name} {label:9s}: fw {t_fw:.2f} ({t_fw / floor:.2f}x)  fw(grad) {t_fwg:.2f} ({t_fwg / floor:.2f}x) "
                  f"{mem_fw:.1f} MiB  fw+bw {t_fb:.2f} ({t_fb / floor:.2f}x) {mem_fb:.0f} MiB  {live}  {err}", flush=True)
            del ee, cc, loss
            torch.cuda.empty_cache()
        del e, c, t, ref_de, ref_dc
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:] or ["gemma2", "llama3", "mistral"])

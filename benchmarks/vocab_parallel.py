"""The vocabulary-parallel loss on GPUs (issue 23): NCCL, one rank per GPU.

    torchrun --nproc-per-node N benchmarks/vocab_parallel.py [--out DIR]   (or plain python: one rank)

For each head (Llama 3 70B's 128256 x 8192 and Gemma 2's 256000 x 2304 with softcap 30, B = 16384
tokens, LM-like bf16 data generated alike on every rank), in one run:
- checks: the sharded call's loss, dE and dC against the one-GPU exact call on the whole classifier
  (rank 0), exact (eager and compiled, ``fullgraph=True``) and default (the shards filter together);
- time: fw+bw median of the sharded call over all ranks, against one GPU's call in the same mode;
- memory: peak allocated above the inputs, per GPU;
- communication: the call's collectives (an all_gather of (2 + 5 / n) floats per row, an all_reduce of
  dE) timed alone at the same sizes, as a share of the call.
Writes ``vocab_parallel.csv`` under ``--out`` and prints it.
"""

import argparse
import csv
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

HEADS = {"llama3-70b": (16384, 128256, 8192, None), "gemma2": (16384, 256000, 2304, 30.0)}
MODES = (("exact", {"filter_eps": None}), ("default", {}))


def timed(fn, reps, together=True):
    """Median ms of ``fn`` after 3 warm-up calls; ``together``: every rank calls it, in step."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if together:
            dist.barrier()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--heads", default=",".join(HEADS))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from cce_autotune import linear_cross_entropy
    from cce_autotune.data import make_data

    mesh = init_device_mesh("cuda", (world,))
    say = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    say(f"# {torch.cuda.get_device_name()} x {world}, torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    rows = []
    for name in args.heads.split(","):
        B, V, D, softcap = HEADS[name]
        e, c, t = make_data("lm", B, V, D, dtype=torch.bfloat16, device="cuda", seed=0)
        kw = {"softcap": softcap} if softcap else {}
        c_local = distribute_tensor(c, mesh, [Shard(0)]).to_local()  # (c on every rank: its shard)

        def run(cc, fn, mode):
            ee = e.detach().clone().requires_grad_()
            cc = cc.detach().requires_grad_()

            def step():
                ee.grad = cc.grad = None
                loss = fn(ee, cc, t, **kw, **mode)
                loss.backward()
                return loss
            return ee, cc, step

        def sharded(fn, mode):
            return run(DTensor.from_local(c_local, mesh, [Shard(0)], shape=(V, D), stride=(D, 1)), fn, mode)

        # One GPU on the whole classifier (rank 0; the others wait): the reference and the times.
        one = {}
        if rank == 0:
            for mode, opts in MODES:
                ee1, cc1, step1 = run(c, linear_cross_entropy, opts)
                base1 = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                for _ in range(2):  # (as the sharded call below: the second call may filter)
                    l1 = step1()
                p1 = (torch.cuda.max_memory_allocated() - base1) / 2**20
                one[mode] = (float(l1), ee1.grad.clone(), cc1.grad.clone(), p1, timed(step1, args.reps, together=False))
                del ee1, cc1, step1
            torch.cuda.empty_cache()
        dist.barrier()
        # The sharded call in each mode, its memory, and (exact) compiled.
        for mode, opts in MODES:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ee, cc, step = sharded(linear_cross_entropy, opts)
            for _ in range(2):  # (the second call walks the order the first left, and may filter)
                loss = step()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            got = (float(loss), ee.grad.clone(), cc.grad.full_tensor())
            ms = timed(step, args.reps)
            compiled = ("", "", "")
            if mode == "exact":
                ee2, cc2, step2 = sharded(torch.compile(linear_cross_entropy, fullgraph=True), opts)
                loss2 = step2()
                compiled = (abs(float(loss2) - got[0]), f"{rel(ee2.grad, got[1]):.2e}",
                            f"{rel(cc2.grad.full_tensor(), got[2]):.2e}")
                del ee2, cc2, step2
            if mode == "exact":  # the collectives alone, at the call's sizes
                parts = torch.zeros(2 * B + 5, device="cuda")
                everyone = parts.new_empty(world * parts.numel())
                de = torch.zeros(B, D, dtype=torch.bfloat16, device="cuda")
                comm = timed(lambda: (dist.all_gather_into_tensor(everyone, parts), dist.all_reduce(de)), args.reps)
                del de
            if rank == 0:
                ref = one["exact"]
                row = dict(head=name, B=B, V=V, D=D, softcap=softcap or "", world=world, mode=mode,
                           sharded_ms=round(ms, 3), one_gpu_ms=round(one[mode][4], 3),
                           ratio_to_one_gpu=round(ms / one[mode][4], 3), peak_mib_per_gpu=round(peak),
                           one_gpu_peak_mib=round(one[mode][3]), comm_ms=round(comm, 3),
                           comm_share=round(comm / ms, 4), loss=got[0], loss_diff=abs(got[0] - ref[0]),
                           de_rel_err=f"{rel(got[1], ref[1]):.2e}", dc_rel_err=f"{rel(got[2], ref[2]):.2e}",
                           one_gpu_de_rel_err=f"{rel(one[mode][1], ref[1]):.2e}",
                           one_gpu_dc_rel_err=f"{rel(one[mode][2], ref[2]):.2e}",
                           compiled_loss_diff=compiled[0], compiled_de_rel_diff=compiled[1],
                           compiled_dc_rel_diff=compiled[2])
                rows.append(row)
                say(" ".join(f"{k}={v}" for k, v in row.items()))
            del ee, cc, step, got
            torch.cuda.empty_cache()
        one.clear()
        del e, c, t, c_local
        torch.cuda.empty_cache()
    if rank == 0 and rows:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "vocab_parallel.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

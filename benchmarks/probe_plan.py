"""Device probe (issue 8): the planner's choices against forced strategies, LM-like and random data.

    python benchmarks/probe_plan.py lm:gemma2,real:gpt768
"""

import os
import sys

import torch

from cce_autotune import linear_cross_entropy
from cce_autotune.bench import SHAPES, Method, _methods, print_table, run_shape, write_csv
from cce_autotune.dispatch import select_variants


def forced(strategy, budget="auto", eps="auto"):
    def loss(e, c, t):
        kv = select_variants(e, c)
        kv = kv.replace(backward=kv.backward.replace(strategy=strategy))
        return linear_cross_entropy(e, c, t, variants=kv, max_extra_memory=budget, filter_eps=eps)
    return loss


def main(shapes="lm:gemma2,lm:llama3,lm:mistral,real:gpt768,real:gpt2048,real:gpt4096", reps=40):
    methods = [
        Method("torch", lambda e, c, t: torch.nn.functional.cross_entropy((e @ c.T).float(), t)),
        Method("planned", lambda e, c, t: linear_cross_entropy(e, c, t)),
        Method("planned_unlimited", lambda e, c, t: linear_cross_entropy(e, c, t, max_extra_memory=None)),
        Method("chunked", forced("chunked")),
        Method("tiles_unlimited", forced("tiles", None)),
        Method("exact", lambda e, c, t: linear_cross_entropy(e, c, t, filter_eps=None)),
    ] + [m for m in _methods(True) if m.name in ("apple_cce", "liger_flce")]
    rows = []
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__)
    for item in shapes.split(","):
        data, name = item.split(":")
        rows += run_shape(name, *SHAPES[name], data, torch.bfloat16, methods, reps, meta,
                          log=lambda s: print(s, flush=True))
    out = os.environ.get("OUT", "/tmp")
    write_csv(rows, __import__("pathlib").Path(out) / "probe_plan.csv")
    print_table(rows)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Device probe: where one forward+backward of the dispatched loss spends its time (torch.profiler),
for a mapped (filtered) call and an exact call, at one head.

    python benchmarks/profile_call.py real gpt768
"""

import sys

import torch

from cce_autotune import linear_cross_entropy
from cce_autotune.bench import SHAPES
from cce_autotune.data import make_data


def main(data="real", name="gpt768"):
    B, V, D = SHAPES[name]
    e, c, t = make_data(data, B, V, D, dtype=torch.bfloat16, device="cuda")
    e.requires_grad_()
    c.requires_grad_()
    for label, kw in (("mapped", {}), ("exact", dict(filter_eps=None))):
        for _ in range(3):
            linear_cross_entropy(e, c, t, **kw).backward()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            linear_cross_entropy(e, c, t, **kw).backward()
            torch.cuda.synchronize()
        print(f"== {name} {data} {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=48))


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Timing whole training steps (``cce-bench --train``, the GPTs of :mod:`cce_autotune.bench` and the
Hugging Face models of :mod:`cce_autotune.bench_hf`): the step of :func:`cce_autotune.data.real.train_step`,
timed from the host and synchronised before and after, with its peak memory and its losses; with
``--graph`` (:func:`time_graphed_steps`), the step's forward and backward captured once in a CUDA graph
and replayed, as a loop whose host would otherwise set the pace can run it.
"""

from __future__ import annotations

import math
import time

import torch

from .data import real as realdata

__all__ = ["TRAIN_WARMUP_STEPS", "TRAIN_LOSS_STEPS", "time_train_steps", "time_graphed_steps"]

TRAIN_WARMUP_STEPS = 5  # untimed steps per method (compilation, autotuning, optimiser state)
TRAIN_LOSS_STEPS = 10  # the loss reported is the mean over this many last steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_train_steps(model, opt, batches, loss_fn, warmup: int, loop_steps: int, device, ref_loss=None) -> tuple:
    """``(row, loss)``: ``warmup`` untimed and ``loop_steps`` timed steps of
    :func:`cce_autotune.data.real.train_step` on ``batches``, each timed from the host, synchronised
    before and after; ``row`` holds the ``train_step`` columns (the median, p20, p80 step; the peak
    memory a timed step holds above what the model and the optimiser held before it, CUDA only, else
    nan; ``err_loss`` against ``ref_loss``) and ``loss`` is the mean of the last steps' losses."""
    device = torch.device(device)
    times, losses = [], []
    for i in range(warmup + loop_steps):
        x, y = next(batches)
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            mem_base = torch.cuda.memory_allocated(device)
        _sync(device)
        start = time.perf_counter()
        losses.append(realdata.train_step(model, opt, x, y, loss_fn))
        _sync(device)
        times.append(time.perf_counter() - start)
    mem = (torch.cuda.max_memory_allocated(device) - mem_base) / 2**20 if device.type == "cuda" else math.nan
    return _row("train_step", times[warmup:], losses, mem, ref_loss)


def _row(pass_name: str, times: list, losses: list, mem: float, ref_loss) -> tuple:
    """``(row, loss)`` of a timed loop: the median, p20 and p80 of ``times`` (seconds) in ms, the peak
    memory ``mem`` (MiB), the mean of the last :data:`TRAIN_LOSS_STEPS` ``losses`` and its relative
    difference from ``ref_loss``."""
    p20, med, p80 = (1e3 * float(q) for q in torch.tensor(times).quantile(torch.tensor([0.2, 0.5, 0.8])))
    loss = float(torch.stack(losses[-TRAIN_LOSS_STEPS:]).mean())
    err = abs(loss - ref_loss) / ref_loss if ref_loss is not None else math.nan
    row = {"pass": pass_name, "median_ms": med, "p20_ms": p20, "p80_ms": p80, "ratio_to_matmul": math.nan,
           "peak_extra_mib": mem, "err_loss": err, "err_de": math.nan, "err_dc": math.nan}
    return row, loss


def time_graphed_steps(model, opt, batches, loss_fn, warmup: int, loop_steps: int, device, ref_loss=None) -> tuple:
    """``(row, loss)`` as :func:`time_train_steps`, with the step's forward and backward (under
    :func:`~cce_autotune.data.real.autocast`) captured once in a CUDA graph and replayed: each step
    copies its batch into the graph's inputs, replays it (the gradients land in the same tensors every
    time) and clips and steps the optimiser outside the graph. ``warmup`` eager steps
    (:func:`~cce_autotune.data.real.train_step`) on a side stream come before the capture (as
    :func:`torch.cuda.graph` asks). ``row``'s pass is ``train_step_graph``; its memory, the most the capture held above what the model and the
    optimiser held before it (the step's working set: replays allocate nothing). CUDA only: a loss
    that reads a value back to the host cannot be captured (the error is raised)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: a CUDA graph needs a CUDA device, got {device}")
    x0, y0 = next(batches)
    sx, sy = x0.clone(), y0.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            realdata.train_step(model, opt, sx, sy, loss_fn)
    torch.cuda.current_stream(device).wait_stream(side)
    model.zero_grad(set_to_none=True)  # (the graph allocates the gradients it writes on every replay)
    _sync(device)
    mem_base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with realdata.autocast(device):
            static_loss = loss_fn(model, sx, sy)
        static_loss.backward()
    mem = (torch.cuda.max_memory_allocated(device) - mem_base) / 2**20
    times, losses = [], []
    for _ in range(loop_steps):
        x, y = next(batches)
        _sync(device)
        start = time.perf_counter()
        sx.copy_(x)
        sy.copy_(y)
        graph.replay()
        torch.nn.utils.clip_grad_norm_(model.parameters(), realdata.GRAD_CLIP)
        opt.step()
        losses.append(static_loss.detach().clone())
        _sync(device)
        times.append(time.perf_counter() - start)
    del graph
    model.zero_grad(set_to_none=True)
    return _row("train_step_graph", times, losses, mem, ref_loss)

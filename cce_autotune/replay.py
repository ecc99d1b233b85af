"""Replaying a loop of kernel launches as a CUDA graph while its arguments hold.

A strategy's loop launches the same kernels call after call with arguments that differ only where the
call's tensors lie: the chunked strategy's chunk loop at Llama 3.2 1B's head (128256 x 2048, 8192
rows) launches two kernels a chunk, 126 a call, about 5 ms of the host's time against 6 ms of the
device's (benchmarks/NOTES.md rows 221-225). Replayed as a CUDA graph, the loop costs one graph launch.

:func:`run` ``(fn, *args)`` calls ``fn(*args)``, or replays a graph of an earlier call of ``fn`` whose
arguments were the same: the same tensors (address, dtype, shape, strides, device), TMA descriptors
of them, numbers of the same type and bits, strings, dtypes, and dataclasses of these, compared
field by field (:func:`describe`). A replay launches the kernels the captured call launched, with the
same arguments: ``fn`` must launch nothing that its arguments do not determine (a module-level
function, not a closure; nothing read back to the host) and allocate little, and nothing a caller
reads afterwards: what it allocates while captured lives in the graph's own memory, reused by each
replay and held while the graph is kept (a loop whose temporaries are large, cuBLAS's products on a
gathered chunk of C, is not one to replay). Nor a loop that calls cuBLAS: PyTorch keys cuBLAS's
workspaces by stream, and letting go of one graph captured on a stream can free the workspace that
another graph captured on it still uses (pytorch/pytorch#193402, an illegal address at its replay);
the replayed loops launch Triton's kernels alone. The data the kernels read is read at the replay:
only the arguments are remembered.

When. A call whose arguments were seen among the site's last :data:`SEEN` calls is captured (on a
side stream, nothing run while captured) and replayed; a site keeps its :data:`KEPT` most recent
graphs. A key seen once runs as it is: arguments that change at every call (an allocator that
never gives a buffer the same address twice) cost one description a call, and no capture. Never on
the CPU, under Triton's interpreter, while a CUDA graph is being captured (the caller's graph takes
the launches), while a launch hook is set (a profiler's: every launch through Triton), for an
argument :func:`describe` does not know, or when replays are off: :func:`replays` (off by default: on an
H100 they cut a call's host time but not its wall, which the device sets; ``CCE_AUTOTUNE_REPLAY=1``
turns them on). A capture that fails
runs the loop as it is and turns replays off for the process, with one warning.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import OrderedDict

from ._lazy import torch  # (imported on first use: see cce_autotune._lazy)
from .codegen import interpreting
from .launch import launch_hooked

__all__ = ["run", "replays", "describe", "Undescribed", "SEEN", "KEPT", "ENV_REPLAY"]

ENV_REPLAY = "CCE_AUTOTUNE_REPLAY"
SEEN = 8  # the keys a site remembers having run (a key among them is captured when it comes again)
KEPT = 4  # the graphs a site keeps (each holds what its capture allocated: the loop's small temporaries)

_state: dict = {}
_sites: dict = {}  # fn -> _Site


def replays(on: bool | None = None) -> bool:
    """Whether loops are replayed as CUDA graphs; ``on`` sets it (for the process). Unset, the
    environment's ``CCE_AUTOTUNE_REPLAY`` says (on when set to anything but ``0`` or nothing)."""
    if on is not None:
        _state["on"] = bool(on)
        if not on:
            _sites.clear()  # (the graphs and their memory go)
    if "on" not in _state:
        _state["on"] = os.environ.get(ENV_REPLAY, "0").strip() not in ("", "0")
    return _state["on"]


class Undescribed(TypeError):
    """An argument :func:`describe` cannot compare between calls."""


def describe(x):
    """A hashable description of ``x`` under which two calls launch the same: tensors by address,
    dtype, shape, strides and device (the data is read at the replay); numbers by type and bits (so
    that ``1``, ``True`` and ``1.0``, or ``0.0`` and ``-0.0``, differ); strings, None, dtypes and
    devices; tuples, lists, dicts and dataclasses (a TMA descriptor, a variant, a plan) of these.
    :class:`Undescribed` for anything else."""
    t = type(x)
    if t is int or t is bool or t is str or x is None:
        return (t, x)
    if t is float:
        return (t, x.hex())
    if isinstance(x, torch.Tensor):
        return ("tensor", x.data_ptr(), x.dtype, tuple(x.shape), x.stride(), x.device)
    if isinstance(x, (tuple, list)):  # (torch.Size, named tuples too)
        return (t, *map(describe, x))
    if t is dict:
        return (t, *((describe(k), describe(v)) for k, v in x.items()))
    if t is torch.dtype or t is torch.device:
        return (t, x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (t, *(describe(getattr(x, f.name)) for f in dataclasses.fields(x)))
    raise Undescribed(f"{t.__name__} is not compared between calls")


class _Site:
    """One loop's remembered keys and graphs."""

    __slots__ = ("seen", "graphs")

    def __init__(self):
        self.seen: OrderedDict = OrderedDict()
        self.graphs: OrderedDict = OrderedDict()


def run(fn, *args) -> None:
    """``fn(*args)``, or the replay of a CUDA graph of an earlier such call (see the module docstring)."""
    if getattr(fn, "__closure__", None):
        raise ValueError(f"{fn.__qualname__}: a replayed loop must not be a closure (its key would not see "
                         "what it holds)")
    if not replays() or not _replayable(args):
        fn(*args)
        return
    try:
        key = describe(args)
    except Undescribed:
        fn(*args)
        return
    site = _sites.get(fn)
    if site is None:
        site = _sites[fn] = _Site()
    graph = site.graphs.get(key)
    if graph is not None:
        site.graphs.move_to_end(key)
        graph.replay()
        return
    if key not in site.seen:
        site.seen[key] = None
        if len(site.seen) > SEEN:
            site.seen.popitem(last=False)
        fn(*args)
        return
    del site.seen[key]
    try:
        graph = _capture(fn, args)
    except Exception as err:  # (nothing ran while captured: the loop runs as it is)
        _state["on"] = False
        _sites.clear()
        warnings.warn(f"cce_autotune: a CUDA graph of {fn.__qualname__} could not be captured ({err}); "
                      "loops are launched as they are from now on", RuntimeWarning, stacklevel=2)
        fn(*args)
        return
    site.graphs[key] = graph
    if len(site.graphs) > KEPT:
        site.graphs.popitem(last=False)
    graph.replay()


def _replayable(args) -> bool:
    """Whether a call with ``args`` may be captured: its tensors on a GPU, no capture under way, no
    launch hook set, the kernels compiled (not interpreted)."""
    device = _device(args)
    if device is None or device.type != "cuda":
        return False
    if interpreting() or torch.cuda.is_current_stream_capturing():
        return False
    return not launch_hooked()


def _device(args):
    """The device of a tensor among ``args`` (looked for in tuples, lists and dataclasses, the shallowest
    first), or None."""
    todo = list(args)
    while todo:
        x = todo.pop(0)
        if isinstance(x, torch.Tensor):
            return x.device
        if isinstance(x, (tuple, list)):
            todo.extend(x)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            todo.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return None


def _capture(fn, args):
    """A CUDA graph of ``fn(*args)``, captured on a side stream of the arguments' device (one a device,
    made once; nothing runs while it is captured); the caller replays it."""
    device = _device(args)
    current = torch.cuda.current_stream(device)
    side = _state.get(("stream", device))
    if side is None:
        side = _state[("stream", device)] = torch.cuda.Stream(device)
    side.wait_stream(current)  # (before the capture: the capture records no wait)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        # ("thread_local": another thread's CUDA calls, a data loader's, are not this capture's concern)
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn(*args)
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph

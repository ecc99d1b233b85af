"""Loops replayed as CUDA graphs while their arguments hold (cce_autotune.replay): what a key tells
apart, when a loop is captured and replayed (against a stand-in for the capture, on the CPU), that the
chunked strategy's loop runs from its argument alone and gives the same bits when run again, and on a
GPU that replayed calls give the eager gradients."""

import math
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from cce_autotune import linear_cross_entropy, memory, replay
from cce_autotune.codegen import Flags
from cce_autotune.planning import filters
from cce_autotune.strategies import chunked
from helpers import NO_CHUNK_HOST, make_inputs
from test_loss import prime_order
from test_planner import _force
from test_tile_map import MAPPED


@dataclass
class Desc:  # (a TMA descriptor's fields, as Triton's host-side TensorDescriptor has them)
    base: object
    shape: list
    strides: list
    block_shape: list
    padding: str = "zero"


def test_a_key_tells_apart_what_a_launch_tells_apart():
    d = replay.describe
    assert d((1, 2.5, "x", None)) == d((1, 2.5, "x", None))
    # (Triton specializes 1 and True apart, and passes 0.0 and -0.0 as different bits)
    assert len({d(1), d(True), d(1.0)}) == 3 and d(0.0) != d(-0.0)
    t = torch.zeros(4, 6)
    assert d(t) == d(t) == d(t.view(4, 6)) and d(t) != d(t.clone())  # (another address)
    assert d(t[1:]) != d(t[:3])  # (same shape, another address)
    assert d(t.T) != d(t.view(6, 4))  # (same address and shape, other strides)
    assert d(t.view(torch.int32)) != d(t)  # (other dtype)
    assert d(torch.Size([4, 6])) == d(torch.Size([4, 6])) != d(torch.Size([6, 4]))
    assert d({"BLOCK": 16}) != d({"BLOCK": 32})
    assert d(Flags(has_bias=True)) == d(Flags(has_bias=True)) != d(Flags())
    assert d(Desc(t, [4, 6], [6, 1], [2, 2])) != d(Desc(t, [4, 6], [6, 1], [4, 2]))
    assert d(torch.float32) != d(torch.bfloat16)
    with pytest.raises(replay.Undescribed):
        d([1, object()])


class Captures:
    """Stands in for the CUDA capture: a graph that, replayed, runs the loop on the arguments it was
    captured with (a CUDA graph launches the captured kernels on the captured addresses); counts
    captures and replays. ``fail``: the capture raises it."""

    def __init__(self, fail=None):
        self.captured = self.replayed = 0
        self.fail = fail

    def capture(self, fn, args):
        if self.fail is not None:
            raise self.fail
        self.captured += 1
        outer = self

        class Graph:
            def replay(self):
                outer.replayed += 1
                fn(*args)

        return Graph()


@pytest.fixture
def captures(monkeypatch):
    c = Captures()
    monkeypatch.setattr(replay, "_capture", c.capture)
    monkeypatch.setattr(replay, "_replayable", lambda args: True)
    monkeypatch.setattr(replay, "_sites", {})
    monkeypatch.setitem(replay._state, "on", True)
    return c


def _loop(out, n):  # (a module-level loop: what a replayed loop must be)
    for _ in range(n):
        out.add_(1)


def test_a_loop_seen_again_is_captured_then_replayed(captures):
    out, other = torch.zeros(3), torch.zeros(3)
    replay.run(_loop, out, 2)  # first seen: as it is
    assert (captures.captured, captures.replayed) == (0, 0) and out.tolist() == [2, 2, 2]
    replay.run(_loop, out, 2)  # again: captured (nothing runs while captured), replayed
    assert (captures.captured, captures.replayed) == (1, 1) and out.tolist() == [4, 4, 4]
    replay.run(_loop, out, 2)
    assert (captures.captured, captures.replayed) == (1, 2) and out.tolist() == [6, 6, 6]
    replay.run(_loop, out, 3)  # another argument: a key of its own, as it is
    replay.run(_loop, other, 2)  # another tensor
    assert (captures.captured, captures.replayed) == (1, 2)
    assert out.tolist() == [9, 9, 9] and other.tolist() == [2, 2, 2]


def test_a_site_remembers_its_last_keys_and_keeps_its_last_graphs(captures):
    bufs = [torch.zeros(1) for _ in range(replay.SEEN + 1)]
    for b in bufs:
        replay.run(_loop, b, 1)
    replay.run(_loop, bufs[0], 1)  # (forgotten: SEEN others came since) as it is, seen again
    assert captures.captured == 0
    newest = bufs[-(replay.KEPT + 1):]
    for b in reversed(newest):
        replay.run(_loop, b, 1)  # seen before: captured
    assert captures.captured == replay.KEPT + 1
    assert len(replay._sites[_loop].graphs) == replay.KEPT  # the oldest graph let go
    replay.run(_loop, newest[-1], 1)  # (its graph went, and it counts as seen no more: as it is)
    assert captures.captured == replay.KEPT + 1
    assert bufs[0].item() == 2 and newest[-1].item() == 3 and newest[0].item() == 2


def test_a_failed_capture_runs_the_loop_and_turns_replays_off(captures):
    captures.fail = RuntimeError("operation not permitted when stream is capturing")
    out = torch.zeros(2)
    replay.run(_loop, out, 1)
    with pytest.warns(RuntimeWarning, match="could not be captured"):
        replay.run(_loop, out, 1)
    assert out.tolist() == [2, 2] and not replay.replays() and replay._sites == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay.run(_loop, out, 1)  # (off: as it is, no warning)
    assert out.tolist() == [3, 3]


def test_an_argument_without_a_key_runs_as_it_is(captures):
    out = torch.zeros(1)
    for _ in range(3):
        replay.run(lambda o, x: o.add_(1), out, object())
    assert out.item() == 3 and captures.captured == 0


def test_a_closure_is_refused():
    k = 2

    def closure(out):
        out.add_(k)

    with pytest.raises(ValueError, match="closure"):
        replay.run(closure, torch.zeros(1))


def test_off_by_default_and_never_on_the_cpu(monkeypatch):
    monkeypatch.setattr(replay, "_state", {})
    monkeypatch.delenv(replay.ENV_REPLAY, raising=False)
    assert not replay.replays()
    monkeypatch.setattr(replay, "_state", {})
    monkeypatch.setenv(replay.ENV_REPLAY, "1")
    assert replay.replays()
    monkeypatch.setattr(replay, "_sites", {})
    out = torch.zeros(1)
    for _ in range(3):
        replay.run(_loop, out, 1)  # (CPU tensors: as they are, nothing remembered)
    assert out.item() == 3 and replay._sites == {}


def _tensors(x, out=None) -> list:
    """The tensors among ``x``'s fields (in tuples, lists, dicts and dataclasses), each once."""
    from dataclasses import fields, is_dataclass

    out = [] if out is None else out
    if isinstance(x, torch.Tensor):
        if not any(y is x for y in out):
            out.append(x)
    elif isinstance(x, (tuple, list)):
        for y in x:
            _tensors(y, out)
    elif isinstance(x, dict):
        _tensors(list(x.values()), out)
    elif is_dataclass(x) and not isinstance(x, type):
        _tensors([getattr(x, f.name) for f in fields(x)], out)
    return out


def _index(state: list, x) -> int:
    return next(i for i, y in enumerate(state) if y is x)


class FakeCuda:
    """``torch.cuda`` as the capture uses it, logging each step: streams, their waits, the current
    stream, and a graph's capture."""

    def __init__(self):
        self.log = []
        self.now = self.default = self.Stream("default")

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        cuda = self

        class Stream:
            def __init__(self, name):
                self.name = name
                cuda.log.append(("stream", name))

            def wait_stream(self, other):
                cuda.log.append(("wait", self.name, other.name))

        return Stream(device if isinstance(device, str) else f"side of {device}")

    def current_stream(self, device=None):
        return self.now

    def stream(self, s):
        cuda = self

        class Within:
            def __enter__(self):
                cuda.before, cuda.now = cuda.now, s

            def __exit__(self, *exc):
                cuda.now = cuda.before

        return Within()

    def CUDAGraph(self):  # noqa: N802
        cuda = self

        class Graph:
            def capture_begin(self, capture_error_mode="global"):
                cuda.log.append(("begin", cuda.now.name, capture_error_mode))

            def capture_end(self):
                cuda.log.append(("end", cuda.now.name))

        return Graph()


def _logging_loop(cuda, out, fail):  # (module-level, as a replayed loop must be)
    cuda.log.append(("loop", cuda.now.name))
    if fail:
        raise RuntimeError("operation not permitted when stream is capturing")
    out.add_(1)


def test_a_capture_waits_then_records_the_loop_on_a_side_stream_and_always_ends(monkeypatch):
    # The lines of the capture the CPU never reaches otherwise, against a stand-in for torch.cuda: the
    # side stream (made once a device) waits for the current one before the capture begins ("thread_local"),
    # the loop runs with it current, the capture ends (also when the loop raises), the current stream
    # waits for the side one.
    cuda = FakeCuda()
    monkeypatch.setattr(replay, "torch", SimpleNamespace(Tensor=torch.Tensor, cuda=cuda))
    monkeypatch.setattr(replay, "_state", {})
    out = torch.zeros(1)
    replay._capture(_logging_loop, (cuda, out, False))
    replay._capture(_logging_loop, (cuda, out, False))
    side = "side of cpu"
    once = [("wait", side, "default"), ("begin", side, "thread_local"), ("loop", side), ("end", side),
            ("wait", "default", side)]
    assert cuda.log == [("stream", "default"), ("stream", side)] + once + once
    assert cuda.now is cuda.default and out.item() == 2  # (the stand-in runs what it records)
    cuda.log.clear()
    with pytest.raises(RuntimeError, match="capturing"):
        replay._capture(_logging_loop, (cuda, out, True))
    assert cuda.log == [("wait", side, "default"), ("begin", side, "thread_local"), ("loop", side), ("end", side)]
    assert cuda.now is cuda.default


@pytest.mark.parametrize("capturing, hooked, interpreted", [(False, False, False), (True, False, False),
                                                           (False, True, False), (False, False, True)])
def test_only_a_gpu_call_outside_a_capture_without_hooks_is_replayable(capturing, hooked, interpreted, monkeypatch):
    cuda = SimpleNamespace(is_current_stream_capturing=lambda: capturing)
    monkeypatch.setattr(replay, "torch", SimpleNamespace(Tensor=torch.Tensor, cuda=cuda))
    monkeypatch.setattr(replay, "_device", lambda args: torch.device("cuda", 0))
    monkeypatch.setattr(replay, "launch_hooked", lambda: hooked)
    monkeypatch.setattr(replay, "interpreting", lambda: interpreted)
    assert replay._replayable(()) == (not (capturing or hooked or interpreted))


def test_the_device_is_a_tensors_within_the_arguments():
    t = torch.zeros(1, device="meta")
    assert replay._device((1, [None, (Desc(t, [1], [1], [1]),)])) == t.device  # (within a descriptor)
    assert replay._device((1, [None, (Desc(t, [1], [1], [1]),)], torch.zeros(1))).type == "cpu"  # (the shallowest)
    assert replay._device((1, "x", [])) is None


def test_a_launch_hook_is_seen(monkeypatch):
    from cce_autotune import launch

    hooks = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setitem(launch._state, "triton", (SimpleNamespace(runtime=hooks), None))
    assert not launch.launch_hooked()
    hooks.launch_exit_hook = lambda metadata: None
    assert launch.launch_hooked()


@pytest.mark.parametrize("groups", [0, 32], ids=["one row group", "row groups"])
def test_the_chunk_loop_runs_from_its_argument_alone(groups, device, monkeypatch, set_costs):
    # What a replay relies on: the chunked strategy's loop with products by live tile launches from its
    # one argument (every field has a key), and run again on the call's buffers as they were before it
    # (dE's accumulator zero, dC's and g's unwritten) it gives the same bits: it keeps nothing of an
    # earlier run (the launch series, the lists) that a replay would not have.
    set_costs(map_ms=0.0, **NO_CHUNK_HOST, pause_share=math.inf, tile_products=0.0,
              max_dropped=math.inf)
    e, c, t, b = make_inputs((2, 29), 400, 45, torch.bfloat16, bias=True, peaked=2.0, device=device)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked", chunk_v=64))
    seen = []

    def recording(fn, *args):
        (loop,) = args
        seen.append((fn, replay.describe(args), loop))
        state = _tensors(loop)
        before = [x.clone() for x in state]
        fn(loop)
        after = [x.clone() for x in state]
        for x, b in zip(state, before):
            x.copy_(b)
        fn(loop)  # (as a replay would: the same launches on the buffers as they were)
        for x, a in zip(state, after):
            assert torch.equal(x, a) or torch.allclose(x, a, rtol=1e-6, atol=0)  # (dbias: float atomics)
        assert torch.equal(loop.acc, after[_index(state, loop.acc)]) and torch.equal(loop.dc, after[_index(state, loop.dc)])

    monkeypatch.setattr(replay, "run", recording)
    ee, cc, bb = (x.clone().requires_grad_() for x in (e, c, b))
    prime_order(cc, ee, "sorted")
    if groups:
        _force(monkeypatch, chunk=(64, True, groups))  # (rows in groups of 32)
    linear_cross_entropy(ee, cc, t, bb, impl="triton", variants=kv).backward()
    assert seen and all(fn is chunked._run_chunks for fn, _, _ in seen)
    loop = seen[-1][2]
    assert loop.tile_live is not None and (len(loop.groups) > 1) == bool(groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["one row group", "row groups", "fp32 classifier, converted chunks"])
def test_replayed_calls_give_the_eager_gradients(case, monkeypatch, set_costs, planned):
    # A training loop's steady mapped calls with replays on: the chunk loop is captured at its second
    # call with the same buffers and replayed after; each call's gradients are bit for bit those of
    # the same call with replays off, also when other rows come at the same storage (their data is
    # read at the replay; the fingerprint fails on the device and every tile is live). In one row
    # group, in groups of 128 rows (dC summed over them in fp32), and with an fp32 classifier whose
    # chunks are converted inside the loop.
    from cce_autotune.planning import planner

    e, c, t, _ = make_inputs((512,), 4096, 256, torch.bfloat16, peaked=2.0, seed=5, device="cuda")
    flat, _, _, _ = make_inputs((512,), 4096, 256, torch.bfloat16, peaked=0.0, seed=6, device="cuda")
    if case.startswith("fp32"):
        c = c.float()
        monkeypatch.setattr(planner, "converts_whole", lambda *a: False)
    if case == "row groups":
        _force(monkeypatch, chunk=(256, True, 128))
    monkeypatch.setattr(filters, "MAX_ERROR", 1.0)
    set_costs(max_dropped=math.inf, pause_share=math.inf, tile_products=0.0, **NO_CHUNK_HOST)
    kv = MAPPED.replace(backward=MAPPED.backward.replace(filter_eps=2.0**-6, strategy="chunked", chunk_v=256))
    monkeypatch.setattr(replay, "_sites", {})
    monkeypatch.setattr(replay, "_state", {})

    def run(on: bool) -> list:
        memory.clear()
        replay.replays(on)
        ee, cc = e.clone().requires_grad_(), c.clone().requires_grad_()
        prime_order(cc, ee, "sorted")
        # (the gradients kept in storage made before the loop: each step then allocates as the one
        # before it, and the allocator gives its buffers the same addresses, as in a training loop)
        out = [(torch.empty_like(e), torch.empty(c.shape, dtype=c.dtype, device="cuda"), [False]) for _ in range(8)]
        for i in range(8):
            if i == 6:
                ee.data.copy_(flat)
            ee.grad = cc.grad = None
            linear_cross_entropy(ee, cc, t, impl="triton", variants=kv).backward()
            out[i][0].copy_(ee.grad)
            out[i][1].copy_(cc.grad)
            out[i][2][0] = planned[-1].call.backward.tile_products
            planned.clear()  # (a plan holds its call's live grid: kept, the next call's would lie elsewhere)
        return out

    eager = run(False)
    replayed = run(True)
    graphs = len(replay._sites.get(chunked._run_chunks, replay._Site()).graphs)
    replay.replays(False)
    assert graphs >= 1  # (the loop was captured)
    assert sum(tp[0] for _, _, tp in replayed) >= 4
    for (de0, dc0, _), (de1, dc1, _) in zip(eager, replayed):
        assert torch.equal(de0, de1) and torch.equal(dc0, dc1)

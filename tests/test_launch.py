"""The launcher that skips Triton's launch path after a specialization's first launch
(cce_autotune.launch), against a stand-in for Triton's JIT function, binder and compiled kernel."""

from types import SimpleNamespace

import pytest
import torch

from cce_autotune import launch
from cce_autotune.launch import Launcher


class Compiled:
    """A compiled kernel: records its launcher's calls."""

    function = "function"
    packed_metadata = "metadata"

    def __init__(self, fail: Exception | None = None):
        self.calls = []
        self.fail = fail

    def run(self, *args):
        if self.fail is not None:
            raise self.fail
        self.calls.append(args)


class Jit:
    """A @triton.jit function: its binder specializes tensors-as-(name, aligned) pairs by alignment
    and ints by divisibility by 16; ``kernel[grid](...)`` records the launch through Triton's path."""

    def __init__(self, fail: Exception | None = None):
        self.device_caches = {0: ("cache", "target", self.binder)}
        self.launched = []
        self.compiled = {}
        self.fail = fail
        self.fn = "the python function"

    @staticmethod
    def _spec(a):
        if isinstance(a, tuple):
            return ("*bf16", "D" if a[1] else "")
        return ("i32", "D" if a % 16 == 0 else "")

    def binder(self, *args, **kw):
        options = {k: v for k, v in kw.items() if k.startswith("num_")}
        bound = {f"a{i}": a for i, a in enumerate(args)} | {k: v for k, v in kw.items() if k not in options}
        spec = [self._spec(a) for a in args] + [("constexpr", v) for k, v in kw.items() if k not in options]
        return bound, spec, options

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.launched.append((grid, args, kw))
            spec = tuple(self.binder(*args, **kw)[1])
            return self.compiled.setdefault(spec, Compiled(self.fail))
        return run


class HookChain:
    """Triton's chain of launch hooks (empty by default)."""

    def __init__(self):
        self.calls = []


@pytest.fixture
def triton_stub(monkeypatch):
    """Triton's settings and driver as the launcher reads them (stream 7 on device 0; the hooks are
    empty chains, as Triton 3.4 and later keep them)."""
    hooks = SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain())
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 7)
    monkeypatch.setitem(launch._state, "triton", (SimpleNamespace(runtime=hooks), SimpleNamespace(active=active)))
    monkeypatch.setitem(launch._state, "direct", True)
    return hooks


def test_a_specialization_is_launched_through_triton_once_then_directly(triton_stub):
    jit = Jit()
    k = Launcher(jit)
    args = (("e", True), ("c", True), 64)
    k[(5,)](*args, BLOCK=32, num_warps=4)
    k[(6, 2)](*args, BLOCK=32, num_warps=4)
    k[(3,)](*args, BLOCK=32, num_warps=4)
    assert len(jit.launched) == 1  # the first only
    (compiled,) = jit.compiled.values()
    assert compiled.calls == [
        (6, 2, 1, 7, "function", "metadata", None, None, None, ("e", True), ("c", True), 64, 32),
        (3, 1, 1, 7, "function", "metadata", None, None, None, ("e", True), ("c", True), 64, 32),
    ]


def test_another_specialization_goes_through_triton_first(triton_stub):
    jit = Jit()
    k = Launcher(jit)
    k[(1,)](("e", True), 64, BLOCK=32)
    k[(1,)](("e", False), 64, BLOCK=32)  # a misaligned tensor
    k[(1,)](("e", True), 65, BLOCK=32)  # an int not divisible by 16
    k[(1,)](("e", True), 64, BLOCK=64)  # another constant
    assert len(jit.launched) == 4 and len(jit.compiled) == 4
    k[(1,)](("e", False), 64, BLOCK=32)
    k[(1,)](("e", True), 80, BLOCK=32)  # divisible again: the first one's kernel
    assert len(jit.launched) == 4
    calls = {spec: len(c.calls) for spec, c in jit.compiled.items()}
    assert sorted(calls.values()) == [0, 0, 1, 1]


@pytest.mark.parametrize("where", ["enter chain", "exit chain", "enter function"])
def test_a_launch_hook_sends_every_launch_through_triton(triton_stub, where):
    jit = Jit()
    k = Launcher(jit)
    k[(1,)](("e", True), 64)
    k[(1,)](("e", True), 64)  # (empty chains: direct)
    assert len(jit.launched) == 1
    if where == "enter chain":
        triton_stub.launch_enter_hook.calls.append(lambda metadata: None)
    elif where == "exit chain":
        triton_stub.launch_exit_hook.calls.append(lambda metadata: None)
    else:  # (a Triton that keeps one function, or None)
        triton_stub.launch_enter_hook = lambda metadata: None
    k[(1,)](("e", True), 64)
    k[(1,)](("e", True), 64)
    assert len(jit.launched) == 3
    (compiled,) = jit.compiled.values()
    assert len(compiled.calls) == 1


def test_no_hook_at_all_is_no_hook(triton_stub):
    triton_stub.launch_enter_hook = triton_stub.launch_exit_hook = None  # (Triton before 3.4)
    jit = Jit()
    k = Launcher(jit)
    k[(1,)](("e", True), 64)
    k[(1,)](("e", True), 64)
    assert len(jit.launched) == 1


def test_a_launcher_that_refuses_its_arguments_falls_back_for_good(triton_stub):
    jit = Jit(fail=TypeError("function takes 14 arguments"))
    k = Launcher(jit)
    k[(1,)](("e", True), 64)
    k[(1,)](("e", True), 64)  # the direct call raises before launching: Triton's path launches it
    assert len(jit.launched) == 2
    assert not launch.direct_launches()
    k[(1,)](("e", True), 64)
    assert len(jit.launched) == 3


def test_other_triton_internals_fall_back_for_good(triton_stub):
    jit = Jit()
    jit.device_caches = {}  # no binder where this Triton keeps it
    k = Launcher(jit)
    k[(1,)](("e", True), 64)
    assert len(jit.launched) == 1 and not launch.direct_launches()


def test_a_launch_error_is_not_retried(triton_stub):
    jit = Jit(fail=RuntimeError("CUDA error: an illegal memory access"))
    k = Launcher(jit)
    k[(1,)](("e", True), 64)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        k[(1,)](("e", True), 64)
    assert len(jit.launched) == 1


def test_interpreted_kernels_and_attributes_are_triton_s(triton_stub):
    jit = Jit()
    k = Launcher(jit, interpreted=True)
    k[(1,)](("e", True), 64)
    k[(1,)](("e", True), 64)
    assert len(jit.launched) == 2
    assert k.fn == "the python function"
    with pytest.raises(AttributeError):
        k.no_such_attribute


def test_rendered_kernels_come_in_one_launcher_each():
    from cce_autotune.codegen import Flags, load_kernel, load_utility
    from cce_autotune.variant import KernelVariants

    v = KernelVariants().indexed_dot
    k = load_kernel(v, Flags(interpret=True))
    assert isinstance(k, Launcher) and load_kernel(v, Flags(interpret=True)) is k
    assert k.fn.__name__ == "cce_indexed_dot_kernel"  # (the @jit function's attributes pass through)
    u = load_utility("convert.py.j2", "cce_convert_rows_kernel", GATHER=False)
    assert isinstance(u, Launcher)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_later_launches_skip_triton_s_path_and_compute_the_same(monkeypatch):
    from triton.runtime import jit as triton_jit

    from cce_autotune import linear_cross_entropy

    torch.manual_seed(0)
    e = torch.randn(300, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c = torch.randn(1000, 96, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1000, (300,), device="cuda")

    def grads():
        e.grad = c.grad = None
        loss = linear_cross_entropy(e, c, t, filter_eps=None, deterministic=True)
        loss.backward()
        return loss.detach().clone(), e.grad.clone(), c.grad.clone()

    direct = grads()  # (each specialization's first launch: Triton's path)
    through = []
    run = triton_jit.JITFunction.run
    monkeypatch.setattr(triton_jit.JITFunction, "run", lambda self, *a, **k: through.append(self) or run(self, *a, **k))
    again = grads()
    assert launch.direct_launches() and through == []  # every launch straight to the compiled kernel
    launch.direct_launches(False)
    try:
        slow = grads()
    finally:
        launch.direct_launches(True)
    assert through  # (Triton's path, turned on again)
    for a, b, s in zip(direct, again, slow):
        assert torch.equal(a, b) and torch.equal(a, s)


# -- a series of launches (Launcher.series) --------------------------------------------------------
class SeriesJit(Jit):
    """A JIT function whose binder is counted, with its parameters (``n`` positional ones, then the
    constants) and the per-argument specialization that Triton's binder calls for each of them."""

    def __init__(self, n: int, constants=("BLOCK",)):
        super().__init__()
        plain = dict(is_constexpr=False, is_const=False, do_not_specialize=False,
                     do_not_specialize_on_alignment=False, annotation_type="")
        self.params = [SimpleNamespace(**plain) for _ in range(n)] + [
            SimpleNamespace(**(plain | {"is_constexpr": True})) for _ in constants]
        self.binds = 0
        self.device_caches = {0: ("cache", "target", "backend", self.counted_binder)}

    def counted_binder(self, *args, **kw):
        self.binds += 1
        return self.binder(*args, **kw)


@pytest.fixture
def specialize(monkeypatch, triton_stub):
    """Triton's per-argument specialization, as the stand-in binder specializes (calls counted)."""
    calls = []

    def native(backend, arg, is_const, spec, align):
        assert backend == "backend"
        calls.append(arg)
        return Jit._spec(arg)

    monkeypatch.setitem(launch._state, "specialize", native)
    return calls


def test_a_series_binds_once_while_the_changed_arguments_specialize_alike(specialize):
    jit = SeriesJit(3)
    s = Launcher(jit).series()
    e, c = ("e", True), ("c", True)
    for lo in (0, 2048, 4096, 6144):
        s[(8,)](e, c, lo, BLOCK=32, num_warps=4)
    assert len(jit.launched) == 1 and jit.binds == 1  # (the first: Triton's path, which binds on its own)
    (compiled,) = jit.compiled.values()
    assert [call[9:] for call in compiled.calls] == [(e, c, lo, 32) for lo in (2048, 4096, 6144)]
    assert specialize == [2048, 4096, 6144]  # only the argument that changed, once a launch


def test_a_series_binds_again_where_a_specialization_or_constant_changes(specialize):
    jit = SeriesJit(3)
    s = Launcher(jit).series()
    e, c = ("e", True), ("c", True)
    s[(1,)](e, c, 64, BLOCK=32)
    s[(1,)](e, c, 64, BLOCK=32)  # (an equal int: its specialization is compared, equal)
    assert jit.binds == 1
    s[(1,)](e, c, 65, BLOCK=32)  # not divisible by 16: another kernel
    s[(1,)](e, ("c", False), 80, BLOCK=32)  # a misaligned tensor
    s[(1,)](e, ("c", False), 80, BLOCK=64)  # a constant changed
    s[(1,)](e, ("c", False), 80, BLOCK=64, num_warps=8)  # an option given
    assert jit.binds == 5 and len(jit.launched) == 5  # (each a new specialization: Triton's path)
    s[(1,)](e, ("c", False), 96, BLOCK=64, num_warps=8)
    assert jit.binds == 5 and len(jit.launched) == 5  # the last bound launch's kernel again, directly
    last = jit.compiled[(("*bf16", "D"), ("*bf16", ""), ("i32", "D"), ("constexpr", 64))]
    assert last.calls[-1][9:] == (e, ("c", False), 96, 64)


def test_a_series_without_triton_s_specialization_binds_every_launch(triton_stub, monkeypatch):
    monkeypatch.setitem(launch._state, "specialize", None)
    jit = SeriesJit(2)
    s = Launcher(jit).series()
    for lo in (0, 16, 32):
        s[(1,)](("e", True), lo, BLOCK=32)
    assert jit.binds == 3 and len(jit.launched) == 1


def test_a_series_with_a_hook_launches_through_triton(specialize, triton_stub):
    jit = SeriesJit(2)
    s = Launcher(jit).series()
    s[(1,)](("e", True), 0, BLOCK=32)
    triton_stub.launch_enter_hook.calls.append(lambda metadata: None)
    s[(1,)](("e", True), 16, BLOCK=32)
    assert len(jit.launched) == 2


def test_a_specialization_of_another_signature_turns_series_off_not_direct_launches(triton_stub, monkeypatch):
    def native(backend, arg):  # (a Triton whose function takes other arguments)
        return Jit._spec(arg)

    monkeypatch.setitem(launch._state, "specialize", native)
    jit = SeriesJit(2)
    s = Launcher(jit).series()
    for lo in (0, 16, 32):
        s[(1,)](("e", True), lo, BLOCK=32)
    assert jit.binds == 3 and len(jit.launched) == 1  # bound each time, launched directly after the first
    assert launch._state["specialize"] is None and launch.direct_launches()


def test_a_binder_of_another_layout_turns_the_series_off(specialize):
    jit = SeriesJit(2)
    jit.params = jit.params[:1]  # (fewer parameters than the binder's values)
    s = Launcher(jit).series()
    for lo in (0, 16, 32):
        s[(1,)](("e", True), lo, BLOCK=32)
    assert jit.binds == 3 and specialize == []


def test_the_host_s_cdiv_and_next_power_of_2_are_triton_s():
    import triton

    for a in range(0, 300):
        for b in (1, 2, 3, 16, 64, 128):
            assert launch.cdiv(a, b) == triton.cdiv(a, b)
    for n in range(0, 5000):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)

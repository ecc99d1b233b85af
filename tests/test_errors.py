"""Bad input gets a clear exception naming the argument (never a crash)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from conftest_tune import run_cli
from helpers import make_inputs, rel_err
from test_loss import SMALL

from cce_autotune import KernelVariants, linear_cross_entropy

V, D = 20, 8


def ok_inputs():
    g = torch.Generator().manual_seed(0)
    e, c, t = torch.randn(4, 5, D, generator=g), torch.randn(V, D, generator=g), torch.randint(0, V, (4, 5), generator=g)
    return e.to(DEVICE), c.to(DEVICE), t.to(DEVICE)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize(
    "mutate, exc, name",
    [
        (lambda e, c, t, kw: (e, torch.randn(V, D + 1, device=e.device), t, kw), ValueError, "c"),
        (lambda e, c, t, kw: (e, c, t[:, :4], kw), ValueError, "targets"),
        (lambda e, c, t, kw: (e, c, t.float(), kw), TypeError, "targets"),
        (lambda e, c, t, kw: (e, c, t.clone().fill_(V), kw), ValueError, "targets"),
        (lambda e, c, t, kw: (e, c, t.clone().fill_(-1), kw), ValueError, "targets"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "bias": torch.randn(V + 1, device=e.device)}), ValueError, "bias"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "bias": torch.randn(V, 2, device=e.device)}), ValueError, "bias"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "reduction": "avg"}), ValueError, "reduction"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "shift": 5}), ValueError, "shift"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "shift": -1}), ValueError, "shift"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "shift": 1.0}), TypeError, "shift"),
        (lambda e, c, t, kw: (e, c.double(), t, kw), TypeError, "c"),
        (lambda e, c, t, kw: (e.to(torch.int32), c, t, kw), TypeError, "e"),
        (lambda e, c, t, kw: (e[0, 0], c, t, kw), ValueError, "e"),
        (lambda e, c, t, kw: (e, c[None], t, kw), ValueError, "c"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "softcap": -1.0}), ValueError, "softcap"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "filter_eps": 2.0}), ValueError, "filter_eps"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "impl": "cuda"}), ValueError, "impl"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "variants": {"lse_forward": {"block_v": 100}}}), ValueError, "variants"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "variants": {"nope": {}}}), ValueError, "variants"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "variants": 3}), TypeError, "variants"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "variants": '{"backward": '}), ValueError, "variants"),
        (lambda e, c, t, kw: (e.tolist(), c, t, kw), TypeError, "e"),
        (lambda e, c, t, kw: (e.to_sparse(), c, t, kw), TypeError, "e"),
        (lambda e, c, t, kw: (e, c.to_sparse(), t, kw), TypeError, "c"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "token_weights": torch.ones(t.shape, device=e.device).to_sparse()}),
         TypeError, "token_weights"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "ignore_index": 2**70}), ValueError, "ignore_index"),
        (lambda e, c, t, kw: (e, c, t, {**kw, "ignore_index": -2**63 - 1}), ValueError, "ignore_index"),
    ],
)
def test_bad_input_names_the_argument(mutate, exc, name, impl):
    e, c, t = ok_inputs()
    e, c, t, kw = mutate(e, c, t, {"impl": impl})
    with pytest.raises(exc) as info:
        linear_cross_entropy(e, c, t, **kw)
        land_checks()
    assert str(info.value).startswith(name + ":"), str(info.value)


def land_checks():
    """On a GPU a call checks its targets' range without a host sync: wait for the check, and make
    the call that raises what it found (nothing where it found nothing)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        linear_cross_entropy(*ok_inputs())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_kinds_are_checked_before_autocast(impl):
    # Inside torch.autocast, e is cast before the call: a list or a sparse e must still be named.
    e, c, t = ok_inputs()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        for bad in (e.tolist(), e.to_sparse()):
            with pytest.raises(TypeError, match="^e: "):
                linear_cross_entropy(bad, c, t, impl=impl)


def test_targets_out_of_range_other_than_ignore_index():
    e, c, t = ok_inputs()
    t[1, 1] = -100  # ignored: fine
    linear_cross_entropy(e, c, t, impl="torch")
    t[1, 2] = -7
    with pytest.raises(ValueError, match=r"targets: value -7 is outside \[0, 20\)"):
        linear_cross_entropy(e, c, t, impl="torch")
        land_checks()


def test_an_out_of_range_targets_row_has_a_nan_loss_and_no_gradient():
    # What a GPU call computes until its range check lands (the CPU raises at once): a NaN loss, and
    # no gradient from the row (its target is not read).
    from cce_autotune.options import Options
    from cce_autotune.runtime import execute
    from cce_autotune.runtime.call import prepare

    e, c, t = (x.cpu() for x in ok_inputs())
    t[1, 2] = 25
    call = prepare(e, c, t, None, None, Options.check(), "torch")
    assert call.out_of_range.sum() == 1 and call.weights[call.out_of_range].item() == 0.0
    assert call.targets.max() < V
    lse = torch.zeros(call.n_rows)
    loss, _ = execute.reduce_loss(call, lse, torch.zeros(call.n_rows), None)
    assert torch.isnan(loss)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_targets_out_of_range_on_a_gpu_raise_without_a_host_sync(impl):
    # The call itself does not wait for the check: its loss is NaN, and the ValueError comes from the
    # first call that finds the check's copy landed (here the same call's backward).
    e, c, t = (x.cuda() for x in ok_inputs())
    e.requires_grad_()
    t[1, 2] = 25
    loss = linear_cross_entropy(e, c, t, impl=impl)
    assert torch.isnan(loss).item()  # (this test's own sync)
    with pytest.raises(ValueError, match=r"targets: value 25 is outside \[0, 20\)"):
        loss.backward()
    linear_cross_entropy(e, c, t.clamp(0, V - 1), impl=impl).backward()  # reported once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tensors_on_different_devices():
    e, c, t = ok_inputs()
    with pytest.raises(ValueError, match="^c: on cpu"):
        linear_cross_entropy(e.cuda(), c.cpu(), t.cuda())


def test_tensors_on_different_devices_meta():
    # Without a GPU the device check is still exercised with the 'meta' device.
    e, c, t = (x.cpu() for x in ok_inputs())
    with pytest.raises(ValueError, match="^targets: on meta"):
        linear_cross_entropy(e, c, t.to("meta"), impl="torch")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    e, c, t = (x.cpu() for x in ok_inputs())
    with pytest.raises(ValueError, match="^impl: 'triton' needs CUDA tensors"):
        linear_cross_entropy(e, c, t, impl="triton")


def test_auto_on_cpu_uses_torch_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    e, c, t = (x.cpu() for x in ok_inputs())
    loss = linear_cross_entropy(e, c, t, variants=KernelVariants())
    assert torch.isfinite(loss)


# Second derivatives: refused clearly on both paths (the torch path used to return a wrong one).
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_double_backward_is_refused_clearly(impl, device):
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float32, device=device)
    e.requires_grad_()
    loss = linear_cross_entropy(e, c, t, impl=impl, variants=SMALL)
    (g,) = torch.autograd.grad(loss, e, create_graph=True)
    with pytest.raises(RuntimeError, match="second derivatives are not supported"):
        torch.autograd.grad((g * g).sum(), e)

# Unsigned targets: ignore_index=-100 must not wrap to 156 (class 156 silently ignored).
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_uint8_targets_compare_in_int64(impl, device):
    e, c, _, _ = make_inputs((8,), 200, 16, torch.float32, device=device)
    t = torch.tensor([156, 3, 156, 199, 0, 156, 7, 100], dtype=torch.uint8, device=device)
    out = linear_cross_entropy(e, c, t, impl=impl, variants=SMALL)
    ref = F.cross_entropy(e.double() @ c.double().T, t.long())
    assert torch.isfinite(out) and rel_err(out, ref) < 1e-5

# Smaller items.
def test_float64_on_the_cpu_with_impl_auto():
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float64)
    assert torch.equal(linear_cross_entropy(e, c, t), linear_cross_entropy(e, c, t, impl="torch"))

def test_softcap_as_a_numpy_scalar_or_a_0d_tensor():
    np = pytest.importorskip("numpy")
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float32)
    ref = linear_cross_entropy(e, c, t, softcap=30.0)
    for cap in (np.float32(30), torch.tensor(30.0)):
        assert torch.equal(linear_cross_entropy(e, c, t, softcap=cap), ref)
    with pytest.raises(ValueError, match="^softcap: "):
        linear_cross_entropy(e, c, t, softcap=torch.ones(2))

def test_error_prefixes_are_not_doubled(capsys):
    e, c, t, _ = make_inputs((6,), 20, 16, torch.float32)
    with pytest.raises(ValueError) as exc:
        linear_cross_entropy(e, c, t, variants={"nonsense": {}})
    assert str(exc.value).startswith("variants: ") and "variants: variants:" not in str(exc.value)
    rc, out, err = run_cli(capsys, "--gpu", "h200", "--vocab", "0", "--dry-run")
    assert rc == 2 and "--vocab: --vocab" not in err and "argument --vocab: expected positive integers" in err


def test_options_encoded_once_are_still_checked_by_type():
    # The options' text is kept for the next call with the same values of the same types: an equal
    # value of a refused type (1 for True, 1.0 for an int) still gets its error.
    from cce_autotune import api

    assert api._encode_options(deterministic=True, softcap=30) == api._encode_options(softcap=30, deterministic=True)
    with pytest.raises(TypeError, match="deterministic"):
        api._encode_options(deterministic=1)
    api._encode_options(ignore_index=-100)
    with pytest.raises(TypeError, match="ignore_index"):
        api._encode_options(ignore_index=-100.0)
    with pytest.raises(ValueError, match="reduction"):
        api._encode_options(reduction="avg")
    text = api._encode_options(variants=KernelVariants().to_dict())  # (a dict: not kept, checked each time)
    assert '"variants": {' in text


@pytest.mark.parametrize("dtype, strided, weighted, shift", [(torch.int64, False, False, 0), (torch.int32, True, True, 1),
                                                             (torch.int64, True, True, 0), (torch.uint8, False, True, 1)])
def test_the_targets_kernel_prepares_what_the_pytorch_path_does(dtype, strided, weighted, shift, device):
    # The kernels' path prepares a call's targets in one launch (strategies.forward.prepare_targets):
    # the same positions taking part, targets, weights (a NaN weight at an ignored position stays out)
    # and out-of-range flags as the PyTorch path's element-wise ops, over several blocks, with the
    # first bad position and its target for the range check.
    from cce_autotune.options import Options
    from cce_autotune.runtime.call import prepare
    from cce_autotune.strategies.forward import TARGETS_BLOCK

    g = torch.Generator().manual_seed(3)
    B, T, Vs, D = 2, TARGETS_BLOCK + 300, 20, 8
    low = 0 if dtype == torch.uint8 else -120
    t = torch.randint(low, 30, (B, 2 * T if strided else T), generator=g).to(dtype)
    if dtype != torch.uint8:
        t[t < -60] = -100  # ignored
    t = t[:, ::2] if strided else t
    tw = torch.rand(B, 2 * T, generator=g)[:, ::2] if strided else torch.rand(B, T, generator=g)
    tw[t == -100] = float("nan")
    e = torch.zeros(B, T, D)
    c = torch.zeros(Vs, D)
    o = Options.check(ignore_index=-100, shift=shift)
    t, tw, e, c = (x.to(device) for x in (t, tw, e, c))
    ours = prepare(e, c, t, None, tw if weighted else None, o, "triton")
    ref = prepare(e, c, t, None, tw if weighted else None, o, "torch")
    for name in ("valid", "out_of_range", "targets", "weights"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours.out_of_range.any() and ours.valid.any()
    assert ours.valid.all() == (dtype == torch.uint8)  # (uint8 holds no -100: nothing ignored)
    first, value = min(ours.firsts.tolist())
    bad = ours.out_of_range.nonzero().view(-1)
    assert (first, value) == ((int(bad[0]), int(ref.raw_targets[bad[0]])) if bad.numel() else (ours.n_rows, 0))
    assert ours.firsts.shape[0] == -(-ours.n_rows // TARGETS_BLOCK)

"""Bad input gets a clear exception naming the argument (never a crash)."""

import pytest
import torch

from cce_autotune import KernelVariants, linear_cross_entropy
from conftest import DEVICE

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
    ],
)
def test_bad_input_names_the_argument(mutate, exc, name, impl):
    e, c, t = ok_inputs()
    e, c, t, kw = mutate(e, c, t, {"impl": impl})
    with pytest.raises(exc) as info:
        linear_cross_entropy(e, c, t, **kw)
    assert str(info.value).startswith(name + ":"), str(info.value)


def test_targets_out_of_range_other_than_ignore_index():
    e, c, t = ok_inputs()
    t[1, 1] = -100  # ignored: fine
    linear_cross_entropy(e, c, t, impl="torch")
    t[1, 2] = -7
    with pytest.raises(ValueError, match=r"targets: value -7 is outside \[0, 20\)"):
        linear_cross_entropy(e, c, t, impl="torch")


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

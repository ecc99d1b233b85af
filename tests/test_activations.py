"""Captured activations: saved as a training step passes them, loaded, fitted to a token count, and
read by the benchmark's and the tuner's data paths."""

import warnings

import pytest
import torch

from cce_autotune import bench, linear_cross_entropy
from cce_autotune.data import captured as activations
from cce_autotune.data import file_dtype, make_data, resolve_data


def _inputs(seed=0, T=7, V=40, D=16):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(2, T, D, generator=g)
    c = torch.randn(V, D, generator=g)
    t = torch.randint(0, V, (2, T), generator=g)
    t[0, 3] = -100
    return e, c, t


def test_save_applies_shift_and_drops_ignored_positions(tmp_path):
    e, c, t = _inputs()
    path = activations.save_activations(tmp_path / "a.pt", e, c, t, softcap=30, shift=1, note="step 5")
    a = activations.load_activations(path)
    keep = t[:, 1:].reshape(-1) != -100
    assert torch.equal(a.e, e[:, :-1].reshape(-1, 16)[keep])
    assert torch.equal(a.targets, t[:, 1:].reshape(-1)[keep])
    assert (a.n, a.V, a.D, a.softcap, a.note) == (int(keep.sum()), 40, 16, 30.0, "step 5")
    assert a.describe()["sha256"] == a.digest[:16] and a.describe()["rows"] == a.n
    # The loss over the file's rows is the loss of the call it was captured from.
    ref = linear_cross_entropy(e, c, t, shift=1, softcap=30.0)
    assert torch.allclose(linear_cross_entropy(a.e, a.c, a.targets, softcap=a.softcap), ref, rtol=1e-5)


def test_capture_records_the_calls_inside_the_block_only(tmp_path):
    e, c, t = _inputs()
    with activations.capture(tmp_path / "cap.pt", calls=2) as rec:
        l1 = linear_cross_entropy(e, c, t, ignore_index=-100)
        linear_cross_entropy(e * 2, c, t)
        linear_cross_entropy(e * 3, c, t)  # a third call: not recorded
    linear_cross_entropy(e, c, t)  # after the block: not recorded
    assert [p.name for p in rec.saved] == ["cap-0.pt", "cap-1.pt"]
    a0, a1 = (activations.load_activations(p) for p in rec.saved)
    assert torch.equal(a1.e, 2 * a0.e)
    assert torch.allclose(linear_cross_entropy(a0.e, a0.c, a0.targets), l1)
    assert not activations._active


def test_rows_for_repeats_or_cuts_and_make_data_reads_the_file(tmp_path):
    e, c, t = _inputs()
    path = activations.save_activations(tmp_path / "a.pt", e, c, t)
    a = activations.load_activations(path)
    e2, c2, t2, b2 = activations.rows_for(a, a.n + 3, dtype=torch.bfloat16)
    assert e2.shape == (a.n + 3, 16) and e2.dtype == torch.bfloat16 and b2 is None
    assert torch.equal(t2[a.n:], a.targets[:3])
    e3, c3, t3 = make_data(str(path), 4, 40, 16, dtype=torch.float32)
    assert torch.equal(e3, a.e[:4]) and torch.equal(c3, a.c)
    with pytest.raises(ValueError, match="V=40, D=16"):
        make_data(str(path), 4, 41, 16)
    assert bench.resolve_shapes(None, str(path)) == [("a", a.n, 40, 16)]
    assert bench.parse_data(f"lm,{path}") == ["lm", str(path)]
    with pytest.raises(ValueError, match="no such activation file"):
        bench.parse_data(str(tmp_path / "missing.pt"))


def test_bad_files_and_arguments_are_named(tmp_path):
    e, c, t = _inputs()
    path = activations.save_activations(tmp_path / "a.pt", e, c, t)
    body = torch.load(path, weights_only=True)
    body["e"] = body["e"] + 1  # edited after saving
    torch.save(body, tmp_path / "edited.pt")
    with pytest.raises(ValueError, match="SHA-256"):
        activations.load_activations(tmp_path / "edited.pt")
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="format"):
        activations.load_activations(tmp_path / "other.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="junk.pt"):
        activations.load_activations(tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="targets"):
        activations.save_activations(tmp_path / "b.pt", e, c, torch.full_like(t, -100))
    with pytest.raises(ValueError, match="targets"):
        activations.save_activations(tmp_path / "b.pt", e, c, t + 100)
    with pytest.raises(ValueError, match="calls"):
        with activations.capture(tmp_path / "c.pt", calls=0):
            pass
    assert not (tmp_path / "b.pt").exists()


def test_a_capture_never_breaks_the_call(tmp_path):
    # Calls that cannot be saved run as without the capture, with a warning each (once per kind); the
    # next call that can be saved is recorded instead.
    e, c, t = _inputs()
    ignored = torch.full_like(t, -100)
    with pytest.warns(UserWarning, match="every target is ignore_index=-100 is not recorded"):
        with activations.capture(tmp_path / "a.pt") as rec:
            loss = linear_cross_entropy(e, c, ignored)
            linear_cross_entropy(e, c, t)
    torch.testing.assert_close(loss, linear_cross_entropy(e, c, ignored), equal_nan=True)
    assert rec.saved == [tmp_path / "a.pt"] and activations.load_activations(rec.saved[0]).n == int((t != -100).sum())

    with pytest.warns(UserWarning) as caught:
        with activations.capture(tmp_path / "b.pt") as rec:
            loss = linear_cross_entropy(e.double(), c.double(), t)
            linear_cross_entropy(e.double(), c.double(), t)
    torch.testing.assert_close(loss, linear_cross_entropy(e.double(), c.double(), t))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "float64 call is not recorded" in messages[0]
    assert "nothing was written: none of the 2" in messages[1] and rec.saved == []

    (tmp_path / "file").write_text("")  # a failed write (here: a file where the folder should be)
    with pytest.warns(UserWarning) as caught:
        with activations.capture(tmp_path / "file" / "c.pt"):
            assert torch.allclose(linear_cross_entropy(e, c, t), linear_cross_entropy(e, c, t))
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "could not be recorded (" in messages[0] and "the call itself goes on" in messages[0]
    assert "none of the 2" in messages[1]


def test_a_call_that_raises_for_its_options_writes_nothing(tmp_path):
    # linear_cross_entropy records only after checking its options: a call that fails writes nothing.
    e, c, t = _inputs()
    for bad in (dict(softcap=-1.0), dict(softcap=0.0), dict(softcap=float("nan")), dict(reduction="avg")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            with activations.capture(tmp_path / "a.pt"):
                linear_cross_entropy(e, c, t, **bad)
        assert not (tmp_path / "a.pt").exists()


def test_an_empty_capture_warns(tmp_path):
    with pytest.warns(UserWarning, match="nothing was written: no linear_cross_entropy call.*model.train"):
        with activations.capture(tmp_path / "a.pt") as rec:
            pass
    assert rec.saved == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError):  # a block that fails: its own error, no warning on top
            with activations.capture(tmp_path / "a.pt"):
                raise KeyError("x")


@pytest.mark.parametrize("softcap", [float("nan"), float("inf"), 0.0, -30.0, "30"])
def test_a_file_with_a_bad_softcap_is_refused(tmp_path, softcap):
    e, c, t = _inputs()
    path = activations.save_activations(tmp_path / "a.pt", e, c, t)
    body = torch.load(path, weights_only=True)
    body["softcap"] = softcap  # (the digest covers the tensors only)
    torch.save(body, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"bad.pt: field 'softcap': expected a positive finite number"):
        activations.load_activations(tmp_path / "bad.pt")
    if not isinstance(softcap, str):
        with pytest.raises(ValueError, match="softcap: expected a positive finite number"):
            activations.save_activations(tmp_path / "b.pt", e, c, t, softcap=softcap)
    assert not (tmp_path / "b.pt").exists()


def test_data_values_that_name_nothing_say_no_such_file(tmp_path):
    e, c, t = _inputs()
    path = str(activations.save_activations(tmp_path / "a.pt", e, c, t))
    assert resolve_data("lm") == "lm" and resolve_data(path) == path
    missing = str(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match=f"--data: no such file: {missing}"):
        resolve_data(missing)
    with pytest.raises(ValueError, match="--data: 'lmm' is none of lm, real and no such file: lmm"):
        resolve_data("lmm", kinds=("lm", "real"))
    with pytest.raises(ValueError, match="not a file"):
        resolve_data(str(tmp_path))
    with pytest.raises(ValueError, match=f"data: no such file: {missing}"):
        make_data(missing, 4, 40, 16)
    with pytest.raises(ValueError, match="no such file: real2"):
        make_data("real2", 4, 40, 16)
    with pytest.raises(FileNotFoundError, match=f"no such file: {missing}"):
        activations.load_activations(missing)


def test_file_dtype_is_the_captured_calls(tmp_path):
    # What cce-tune --data FILE plans for: the dtype the call ran in, not a default bf16.
    e, c, t = _inputs()
    assert file_dtype(str(activations.save_activations(tmp_path / "a.pt", e, c, t))) == "fp32"
    with activations.capture(tmp_path / "b.pt") as rec, torch.autocast("cpu", dtype=torch.bfloat16):
        linear_cross_entropy(e, c, t)  # the fp32 classifier with e cast by autocast
    assert file_dtype(str(rec.saved[0])) == "bf16"
    path = activations.save_activations(tmp_path / "h.pt", e.half(), c.half(), t)
    assert file_dtype(str(path)) == "fp16"

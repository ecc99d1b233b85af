"""Captured activations: saved as a training step passes them, loaded, fitted to a token count, and
read by the benchmark's and the tuner's data paths."""

import pytest
import torch

from cce_autotune import bench, linear_cross_entropy
from cce_autotune.data import captured as activations
from cce_autotune.data import make_data


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

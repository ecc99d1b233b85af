"""Real data (cce_autotune.data.real): the standard-library corpus, the small GPT trained on it, the
cached results, make_data("real"), and the benchmark's real-data options (CPU, tiny models)."""

import math
import os
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cce_autotune import bench
from cce_autotune.data import real as realdata
from cce_autotune.data import make_data

# A model that trains in about two seconds on one CPU core and still learns more than token frequencies.
TINY = dict(layers=2, seq=64, tokens_per_step=1024)
V, D, B, STEPS = 300, 64, 512, 60


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: thread hand-offs cost more than they save (and the other core may be busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CCE_AUTOTUNE_DATA_DIR", str(tmp_path))
    return tmp_path


def test_tokenize():
    text = "def f(x):\n    return x+10  # 'hi'\n\nclass Ä_1: pass\n"
    assert realdata.tokenize(text) == [
        "def", "f", "(", "x", ")", ":", "\n    ", "return", "x", "+", "10", "#", "'", "hi", "'", "\n", "\n",
        "class", "Ä_1", ":", "pass", "\n"]
    assert realdata.tokenize(text) == realdata.tokenize(text)


def test_corpus_vocabulary_and_disk_cache(data_dir, monkeypatch):
    realdata._corpora.clear()  # build it here, into this test's folder
    corpus = realdata.load_corpus()
    assert len(corpus) > 100_000 and corpus.ranks.dtype == torch.int32
    counts = torch.bincount(corpus.ranks.long()).tolist()  # by rank: most frequent first, ties by text
    assert len(counts) == len(corpus.words) == len(set(corpus.words))
    assert all(a > b or (a == b and u < w) for a, b, u, w in zip(counts, counts[1:], corpus.words, corpus.words[1:]))
    for v in (2, 300, 50_000):
        vocab = corpus.vocab(v)
        assert len(vocab) == v == len(set(vocab)) and vocab.count("<unk>") == 1
        ids = corpus.ids(v)
        assert ids.dtype == torch.int64 and ids.shape == (len(corpus),)
        assert 0 <= int(ids.min()) and int(ids.max()) < v
    vocab, ids = corpus.vocab(V), corpus.ids(V)
    assert {"(", ")", "def", "self", "\n"} <= set(vocab)  # the most frequent tokens are kept
    first_file = realdata._stdlib_files(Path(sysconfig.get_paths()["stdlib"]))[0]
    first = realdata.tokenize(first_file.read_text(encoding="utf-8", errors="replace"))[:200]
    assert [vocab[i] for i in ids[:len(first)].tolist()] == [w if w in vocab else "<unk>" for w in first]
    train, held = corpus.split(V)
    assert len(train) + len(held) == len(corpus) and len(held) == pytest.approx(0.05 * len(corpus), rel=0.01)
    # The second load reads the cache instead of tokenizing, and gives the same corpus.
    assert list(data_dir.glob("corpus_*.pt"))
    realdata._corpora.clear()
    monkeypatch.setattr(realdata, "_build_corpus", lambda *a: pytest.fail("corpus rebuilt despite the cache"))
    again = realdata.load_corpus()
    assert torch.equal(again.ranks, corpus.ranks) and again.words == corpus.words


def test_real_data_trains_learns_and_caches(data_dir, tmp_path_factory, monkeypatch):
    e, c, t = realdata.real_data(B, V, D, torch.bfloat16, "cpu", seed=0, steps=STEPS, **TINY)
    assert e.shape == (B, D) and c.shape == (V, D) and t.shape == (B,)
    assert e.dtype == c.dtype == torch.bfloat16 and t.dtype == torch.int64
    assert e.device.type == c.device.type == t.device.type == "cpu"
    assert e.is_contiguous() and c.is_contiguous()
    assert torch.isfinite(e.float()).all() and torch.isfinite(c.float()).all()
    assert 0 <= int(t.min()) and int(t.max()) < V
    # Learned: held-out loss far below uniform guessing, and below a unigram model of the training text.
    e32, c32, _ = realdata.real_data(B, V, D, torch.float32, "cpu", seed=0, steps=STEPS, **TINY)  # from the cache
    loss = float(F.cross_entropy(e32 @ c32.T, t))
    train, _ = realdata.load_corpus().split(V)
    unigram = float(-torch.log(torch.bincount(train, minlength=V).double() / len(train))[t].mean())
    assert loss < math.log(V) - 1.5 and loss < unigram - 0.2, (loss, unigram, math.log(V))
    assert torch.equal(e32.to(torch.bfloat16), e)
    # Cached: the second call does not train.
    files = list(data_dir.glob("real_*.pt"))
    assert len(files) == 1
    monkeypatch.setattr(realdata, "_train_and_sample", lambda *a: pytest.fail("trained again despite the cache"))
    e2, c2, t2 = realdata.real_data(B, V, D, torch.bfloat16, "cpu", seed=0, steps=STEPS, **TINY)
    assert torch.equal(e2, e) and torch.equal(c2, c) and torch.equal(t2, t)
    monkeypatch.undo()
    # Deterministic: a fresh cache folder trains again and gets the same tensors; another seed does not.
    monkeypatch.setenv("CCE_AUTOTUNE_DATA_DIR", str(tmp_path_factory.mktemp("fresh")))
    e3, c3, t3 = make_data("real", B, V, D, torch.bfloat16, "cpu", 0, steps=STEPS, **TINY)
    assert torch.equal(e3, e) and torch.equal(c3, c) and torch.equal(t3, t)
    e4, _, t4 = realdata.real_data(B, V, D, torch.bfloat16, "cpu", seed=1, steps=STEPS, **TINY)
    assert torch.equal(t4, t) and not torch.equal(e4, e)  # same held-out text, another model


def test_gpt_config_and_errors(data_dir):
    assert [(realdata.GPTConfig.for_width(50000, d).layers, realdata.GPTConfig.for_width(50000, d).heads)
            for d in (768, 2048, 4096)] == [(6, 12), (4, 16), (2, 32)]
    assert realdata.GPTConfig.for_width(300, 45).heads == 1
    with pytest.raises(ValueError, match="^D:"):
        realdata.GPTConfig.for_width(300, 0)
    with pytest.raises(ValueError, match="^B:"):
        realdata.real_data(0, V, D)
    with pytest.raises(ValueError, match="^V:"):
        realdata.load_corpus().ids(1)
    model = realdata.GPT.create(realdata.GPTConfig.for_width(V, 32, layers=1, seq=64))
    with pytest.raises(ValueError, match="^tokens_per_step:"):
        realdata.pretrain(model, torch.arange(1000) % V, steps=1, tokens_per_step=100, seed=0)


def test_make_data_unknown_kind():
    with pytest.raises(ValueError, match=r"^data: 'bogus' is none of lm, sampled, random, real and no such file: bogus"):
        make_data("bogus", 8, 16, 4)


def test_bench_shapes_and_arguments(capsys):
    assert [s[0] for s in bench.resolve_shapes(None, "real")] == ["gpt768", "gpt2048", "gpt4096"]
    assert [s[0] for s in bench.resolve_shapes(None, "lm")] == ["gemma2", "llama3", "mistral"]
    assert bench.resolve_shapes("gpt768,64:300:32", "lm") == [("gpt768", 8192, 50000, 768), ("64x300x32", 64, 300, 32)]
    with pytest.raises(ValueError, match="^--shapes: 'gpt9'"):
        bench.resolve_shapes("gpt9", "real")
    assert bench.parse_data("lm,real") == ["lm", "real"]
    grid = bench.resolve_grid(None)
    assert len(grid) == 12 and ("256000x2304", 8192, 256000, 2304, 30.0) in grid
    assert {(B, V, D) for _, B, V, D, _ in grid} >= {(2048, 128256, 4096), (32768, 128256, 4096), (8192, 32000, 4096)}
    assert bench.resolve_grid("50257x768,128256x4096_B2048") == [("50257x768", 8192, 50257, 768, None),
                                                                ("128256x4096_B2048", 2048, 128256, 4096, None)]
    with pytest.raises(ValueError, match="^--data: 'reel'"):
        bench.parse_data("lm,reel")
    for argv, message in ((["--data", "reel"], "--data: 'reel'"), (["--train", "--dtype", "fp32"], "--dtype:"),
                          (["--train-steps", "-1"], "--train-steps:"),
                          (["--train", "--shapes", "1000:300:32"], "--shapes: 1000x300x32 has B=1000"),
                          (["--softcap", "0"], "--softcap: expected a positive number"),
                          (["--softcap", "nan"], "--softcap: expected a positive number"),
                          (["--train", "--softcap", "30"], "--softcap: --train"),
                          (["--grid", "--shapes", "gemma2"], "--shapes: with --grid, a comma list of"),
                          (["--grid", "--train"], "--grid: times the heads alone"),
                          (["--grid", "--classifier", "fp32"], "--grid: times the heads alone"),
                          (["--graph"], "--graph: times the GPTs' training steps"),
                          (["--train", "--graph", "--hf", "llama"], "--graph: times the GPTs' training steps"),
                          (["--knobs", "lse_forward.num_split=8"], "--knobs: 'lse_forward.num_split=8': lse_forward has no knob"),
                          (["--knobs", "lse.num_splits=8"], "--knobs: 'lse.num_splits=8': no kernel 'lse'"),
                          (["--knobs", "backward.sort_vocab=2"], "--knobs: sort_vocab=2: must be true or false"),
                          (["--knobs", "num_splits"], "--knobs: 'num_splits' is not kernel.knob=value"),
                          (["--knobs", ","], "--knobs: no kernel.knob=value given")):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bench_knobs_add_an_a_b_of_the_dispatched_variants(monkeypatch):
    # --knobs: ours with the variants the configs give, passed explicitly, and the same with the knobs
    # changed; values read as YAML scalars.
    knobs = bench.parse_knobs("lse_forward.num_splits=8,backward.chunk_v=512,lse_forward.merge=lock")
    assert knobs == {"lse_forward": {"num_splits": 8, "merge": "lock"}, "backward": {"chunk_v": 512}}
    seen = {}
    monkeypatch.setattr(bench, "linear_cross_entropy", lambda e, c, t, **kw: seen.setdefault(kw.pop("variants"), kw))
    e, c, t = torch.randn(8, 16), torch.randn(40, 16), torch.randint(0, 40, (8,))
    methods = bench._knob_methods(knobs, 3.0)
    from cce_autotune.configdb import dispatch

    dispatched = dispatch.select_variants(e, c, has_softcap=True)
    assert dispatched.lse_forward.num_splits != 8 and dispatched.backward.chunk_v != 512  # (the knobs change them)
    assert [m.name for m in methods] == ["cce_autotune_dispatched", "cce_autotune_knobs", "cce_autotune_exact_dispatched",
                                         "cce_autotune_exact_knobs"]
    for m in methods:
        seen.clear()
        m.loss(e, c, t)
        (kv, kw), = seen.items()
        assert kw == {"softcap": 3.0, **({"filter_eps": None} if "exact" in m.name else {})}
        changed = m.name.endswith("_knobs")
        assert (kv.lse_forward.num_splits, kv.lse_forward.merge, kv.backward.chunk_v) == \
            ((8, "lock", 512) if changed else (dispatched.lse_forward.num_splits, "buffer", dispatched.backward.chunk_v))
        assert kv.backward.replace(chunk_v=dispatched.backward.chunk_v) == dispatched.backward
        assert kv.indexed_dot == dispatched.indexed_dot


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_bench_methods_and_reference_apply_the_softcap(softcap):
    # Every method of a --softcap run computes the softcapped loss, and the reference it is checked
    # against is the softcapped one (float64 oracle on the CPU: the PyTorch path of the loss).
    g = torch.Generator().manual_seed(0)
    e, c = torch.randn(48, 32, generator=g) / 2, torch.randn(300, 32, generator=g) / 2
    t = torch.randint(0, 300, (48,), generator=g)
    ed, cd = e.double().requires_grad_(), c.double().requires_grad_()
    z = ed @ cd.T
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    want = torch.nn.functional.cross_entropy(z, t)
    want.backward()
    ref_loss, ref_de, ref_dc = bench._reference(e, c, t, softcap)
    assert float(ref_loss) == pytest.approx(float(want), rel=1e-6)
    assert float((ref_de - ed.grad).norm() / ed.grad.norm()) < 1e-5
    assert float((ref_dc - cd.grad).norm() / cd.grad.norm()) < 1e-5
    plain = float(torch.nn.functional.cross_entropy(e @ c.T, t))
    for m in bench._methods(include_peers=False, softcap=softcap):
        if m.name in ("torch", "cce_autotune", "cce_autotune_exact", "cce_autotune_default", "cce_autotune_fp32_classifier"):
            assert float(m.loss(e, c, t)) == pytest.approx(float(want), rel=1e-5), m.name
    if softcap:
        assert abs(plain - float(want)) > 1e-2  # the cap changes this loss: the check above can fail


def test_the_mixed_precision_method_keeps_a_training_steps_autocast(monkeypatch):
    # cce_autotune_fp32_classifier wraps a 16-bit e in autocast; an fp32 e (a training step's final
    # norm under autocast) is left to the step's autocast, not run with autocast turned off (in fp32).
    seen = []
    monkeypatch.setattr(bench, "linear_cross_entropy", lambda e, c, t, **k: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))))
    m = next(m for m in bench._methods(include_peers=False) if m.name == "cce_autotune_fp32_classifier")
    e, c, t = torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m.loss(e, c, t)
    m.loss(e.to(torch.float16), c, t)
    assert seen == [(True, torch.bfloat16), (True, torch.float16)]


def test_bench_train_loop_on_cpu(data_dir):
    """The training-loop benchmark end to end on a tiny head (CPU: fp32, the PyTorch path of the loss)."""
    methods = [m for m in bench._methods(include_peers=False) if m.name in ("torch", "cce_autotune", "cce_autotune_exact")]
    lines = []
    rows = bench.run_train("tiny", 256, V, 32, methods, {"gpu": "cpu"}, pretrain_steps=20, loop_steps=4, warmup=1,
                           device="cpu", layers=1, seq=64, log=lines.append)
    assert [r["method"] for r in rows] == ["torch", "cce_autotune", "cce_autotune_exact"], lines
    for r in rows:
        assert r["pass"] == "train_step" and r["data"] == "real" and r["dtype"] == "float32"
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"] and r["median_ms"] > 0
        assert r["err_loss"] < 1e-4  # same weights, same batches, exact losses: the same training
    assert rows[0]["err_loss"] == 0
    with pytest.raises(ValueError, match="^--shapes: tiny has B=100"):
        bench.run_train("tiny", 100, V, 32, methods, {}, device="cpu", seq=64)


def test_a_graphed_training_loop_needs_a_cuda_device():
    from cce_autotune.train_steps import time_graphed_steps

    with pytest.raises(ValueError, match="^device: a CUDA graph needs a CUDA device"):
        time_graphed_steps(None, None, iter(()), None, 1, 1, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_train_loop_replayed_from_a_cuda_graph(data_dir):
    """--train --graph on a tiny head: each method's loop eager, then again with its forward and
    backward captured once and replayed; both train alike (ours planned exact while captured)."""
    methods = [m for m in bench._methods(include_peers=False) if m.name in ("torch", "cce_autotune")]
    lines = []
    rows = bench.run_train("tiny", 256, V, 32, methods, {"gpu": "cuda"}, pretrain_steps=20, loop_steps=6, warmup=2,
                           device="cuda", layers=1, seq=64, graph=True, log=lines.append)
    assert [(r["method"], r["pass"]) for r in rows] == [(m, p) for m in ("torch", "cce_autotune")
                                                        for p in ("train_step", "train_step_graph")], lines
    for r in rows:
        assert r["median_ms"] > 0 and r["peak_extra_mib"] > 0
        assert r["err_loss"] < 1e-2  # bf16 autocast: the same training within rounding, against torch's of each pass


def test_sampled_data_is_calibrated_and_unlike_lm_like():
    # "sampled": targets drawn from the model's own softmax, so the loss is the softmax's mean entropy
    # (a calibrated model); lm_like's embeddings point at their targets (a loss far below its entropy).
    import torch.nn.functional as F

    from cce_autotune.data import make_data, mean_entropy

    e, c, t = make_data("sampled", 2048, 3000, 64, dtype=torch.float32, seed=1)
    assert e.shape == (2048, 64) and c.shape == (3000, 64) and t.dtype == torch.int64
    assert 0 <= int(t.min()) and int(t.max()) < 3000
    assert abs(mean_entropy(e, c) - 3.5) < 0.01
    loss = float(F.cross_entropy(e @ c.T, t))
    assert abs(loss - mean_entropy(e, c, rows=2048)) < 0.15, loss
    e2, c2, t2 = make_data("sampled", 2048, 3000, 64, dtype=torch.float32, seed=1)
    assert torch.equal(e, e2) and torch.equal(c, c2) and torch.equal(t, t2)
    e3, c3, t3 = make_data("lm", 2048, 3000, 64, dtype=torch.float32, seed=1)
    assert float(F.cross_entropy(e3 @ c3.T, t3)) < mean_entropy(e3, c3) - 1.0
    assert make_data("sampled", 8, 300, 16)[0].dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the profile measures CUDA kernels")
def test_the_device_time_profile_detaches_cupti_unless_told(monkeypatch):
    # CUPTI left attached after a profile slows every later launch: the bench's wall times measured
    # after its first device time would carry that. A user's own setting is kept.
    x = torch.ones(1024, device="cuda")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    assert bench.device_ms(lambda: x.mul_(1.0)) > 0
    assert os.environ["TEARDOWN_CUPTI"] == "1"
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    bench.device_ms(lambda: x.mul_(1.0))
    assert os.environ["TEARDOWN_CUPTI"] == "0"

"""``cce-bench --train --hf``: the Hugging Face training-step runner on tiny models on the CPU (the
timings themselves are the GPU benchmark's business, never asserted here)."""

import math

import pytest
import torch

pytest.importorskip("transformers")

from cce_autotune import bench  # noqa: E402
from cce_autotune.bench_hf import HF_MODELS, resolve_hf, run_hf_train  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8)


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # (gemma2: its final-logit softcap reaches our loss)
def test_patched_and_unpatched_steps_train_alike_and_leave_the_model_unpatched(family):
    ids = torch.randint(0, TINY["vocab_size"], (4000,), generator=torch.Generator().manual_seed(0))
    logs = []
    rows = run_hf_train(family, {"gpu": "cpu"}, methods=("unpatched", "cce_autotune", "liger_flce"), tokens=64,
                        seq=16, loop_steps=2, warmup=1, layers=1, device="cpu", ids=ids, sizes=TINY, log=logs.append)
    by = {r["method"]: r for r in rows}
    assert by["unpatched"]["err_loss"] == 0.0 and by["unpatched"]["shape"] == f"hf_{family}"
    assert by["unpatched"]["V"] == 97 and by["unpatched"]["D"] == 32 and by["unpatched"]["pass"] == "train_step"
    # The same weights, batches and optimiser: the fused loss trains as the model's own (fp32 on the CPU).
    assert by["cce_autotune"]["err_loss"] < 1e-5
    assert all(r["median_ms"] > 0 and math.isnan(r["peak_extra_mib"]) for r in rows)
    try:
        import liger_kernel  # noqa: F401
    except Exception:  # not installed: skipped with a line saying so, not failed
        assert "liger_flce" not in by and any("liger_flce skipped" in line for line in logs)
    assert not any("FAILED" in line for line in logs if "liger" not in line), logs


def test_the_hf_option_names_its_families_and_needs_train(capsys):
    assert resolve_hf("all") == list(HF_MODELS) and resolve_hf("qwen3, llama") == ["qwen3", "llama"]
    with pytest.raises(ValueError, match="--hf: mistral is not one of llama, gemma2, qwen3"):
        resolve_hf("llama,mistral")
    with pytest.raises(SystemExit):
        bench.main(["--hf", "llama"])
    assert "--hf: times whole training steps; give --train too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--train", "--hf", "gpt2"])
    assert "--hf: gpt2 is not one of" in capsys.readouterr().err


def test_the_cli_refuses_a_method_no_part_of_the_run_offers(capsys):
    # (it was skipped without a word: "liger" for liger_flce left the Hugging Face run without the peer)
    with pytest.raises(SystemExit):
        bench.main(["--train", "--hf", "llama", "--methods", "unpatched,cce_autotune,liger"])
    err = capsys.readouterr().err
    assert "--methods: liger not among this run's methods (cce_autotune, liger_flce, unpatched;" in err
    with pytest.raises(SystemExit):
        bench.main(["--grid", "--shapes", "50000x2048", "--no-peers", "--methods", "torch,apple_cce"])
    assert "--methods: apple_cce not among this run's methods" in capsys.readouterr().err


def test_an_unknown_method_is_refused_by_name():
    with pytest.raises(ValueError, match="methods: 'apple' is not one of unpatched, cce_autotune, liger_flce"):
        run_hf_train("llama", {}, methods=("apple",), tokens=32, seq=16, loop_steps=1, warmup=0, layers=1,
                     device="cpu", ids=torch.arange(90), sizes=TINY)

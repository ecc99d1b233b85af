"""The one table of well-known heads (cce_autotune.heads): its values against transformers' configs,
and what the tuner's defaults take from it."""

import pytest

from cce_autotune import heads
from cce_autotune.configdb import store as db
from cce_autotune.paths import resource_dir


def test_heads_match_transformers_config_defaults():
    transformers = pytest.importorskip("transformers")
    checked = 0
    for h in heads.HEADS:
        if h.config is None:
            continue
        cfg = getattr(transformers, h.config)()
        assert (cfg.vocab_size, getattr(cfg, "hidden_size", None) or cfg.n_embd) == (h.V, h.D), h
        assert getattr(cfg, "final_logit_softcapping", None) == h.softcap, h
        checked += 1
    assert checked >= 6


def test_the_table_is_consistent():
    assert len({(h.family, h.model) for h in heads.HEADS}) == len(heads.HEADS)
    assert all(h.V > 0 and h.D > 0 and (h.softcap is None or h.softcap > 0) for h in heads.HEADS)
    # the mix-ups: Gemma 2's vocabulary, Gemma 3's two vocabularies, Qwen2.5 7B's
    assert {h.V for h in heads.HEADS if h.family == "Gemma 2"} == {256000}
    assert [h.name for h in heads.by_vocab(262144)] == ["Gemma 3 1B"]
    assert "Qwen2.5 7B" not in [h.name for h in heads.by_vocab(151936)]


def test_shipped_entries_of_known_heads_have_their_softcap():
    # A call is looked up with its flags: an entry for Gemma 2's head without its softcap is never used.
    shipped = db.load_file(resource_dir("tuned_configs") / "h200.yaml")
    known = 0
    for key in shipped.by_key():
        caps = {h.softcap is not None for h in heads.find(key.V, key.D)}
        if caps:
            known += 1
            assert caps == {key.has_softcap}, key
    assert known >= 10


def test_tune_defaults_come_from_the_table():
    tune = pytest.importorskip("cce_autotune.tuner")
    sizes, note = tune.default_hidden(256000)
    assert sizes == [2048, 3072, 2304, 3584, 4608] and "Gemma 2 2B (D=2304, softcap 30)" in note
    assert tune.default_hidden(151936)[0] == [896, 1536, 2048]
    plan = tune.make_plan("h200", [256000], [2048, 2304], tokens=[8192], kernels=["backward"], trials=3)
    flags = {(s.problem.D, s.problem.has_softcap, s.problem.softcap) for s in plan.studies}
    assert flags == {(2048, False, 30.0), (2304, True, 30.0)}
    assert any("Gemma 2 2B: tuned with its softcap 30" in n for n in plan.notes)
    # an activation file's own flags decide
    plan = tune.make_plan("h200", [256000], [2304], tokens=[8192], kernels=["backward"], trials=3,
                          data="/x.pt", data_id="abc")
    assert {s.problem.has_softcap for s in plan.studies} == {False}


def test_docs_list_the_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "tuning.md").read_text()
    assert heads.markdown_table() in text

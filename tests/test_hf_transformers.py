"""The Hugging Face transformers integration against the unpatched models.

Tiny randomly initialised models of each supported family (float32, CPU, built from configs, no
download): the patched training loss and every parameter gradient match the model's own
``ForCausalLMLoss``; evaluation and ``generate`` are unchanged; ``Trainer`` trains a patched model.
On the CPU ``linear_cross_entropy`` takes its PyTorch path.
"""

import copy
import functools
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cce_autotune  # noqa: E402
import cce_autotune.integrations.transformers as hf  # noqa: E402
from cce_autotune.integrations.transformers import FAMILIES, patch, unpatch  # noqa: E402

V = 101
COMMON = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
# family -> (config class, family-specific settings): tied and untied heads, a biased head (phi),
# logit softcapping (gemma2), sliding windows shorter than the sequence, explicit head_dim.
CONFIGS = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, final_logit_softcapping=30.0, sliding_window=4)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=4)),
    "phi": ("PhiConfig", dict()),
    "phi3": ("Phi3Config", dict()),
    "olmo2": ("Olmo2Config", dict()),
}
RTOL, ATOL = 1e-4, 1e-6


def make_model(family: str, **overrides):
    config_cls, settings = CONFIGS[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **settings, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, FAMILIES[family])(config).float()


def patched_pair(family: str, **options):
    """(patched, reference): the same weights; only the first is patched (per instance)."""
    ref = make_model(family)
    model = copy.deepcopy(ref)
    assert patch(model, **options) is model
    return model, ref


def batch(seed: int = 1, shape=(2, 10)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, shape, generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    labels[1, 5] = -100
    return ids, labels


def assert_grads_match(model, ref):
    named_ref = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        q = named_ref[name]
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.fixture
def spy(monkeypatch):
    """Records the keyword arguments of every linear_cross_entropy call the patched forward makes."""
    calls = []
    real = hf.linear_cross_entropy

    @functools.wraps(real)  # keeps the signature that patch() checks options against
    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "linear_cross_entropy", recording)
    return calls


@pytest.mark.parametrize("family", list(CONFIGS))
def test_training_loss_and_grads_match(family, spy):
    model, ref = patched_pair(family)
    model.train(), ref.train()
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    expected = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    assert len(spy) == 1 and spy[0]["shift"] == 1 and spy[0]["reduction"] == "mean"
    assert spy[0]["softcap"] == CONFIGS[family][1].get("final_logit_softcapping")
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=0)
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_num_items_in_batch_is_sum_over_it(family):
    model, ref = patched_pair(family)
    model.train(), ref.train()
    ids, labels = batch()
    n = torch.tensor(23)  # e.g. the count over all gradient-accumulation micro-batches
    loss = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    expected = ref(input_ids=ids, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(loss, expected.loss, rtol=RTOL, atol=0)
    logits = expected.logits.float()[:, :-1]
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
    torch.testing.assert_close(loss, total / 23, rtol=RTOL, atol=0)
    loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_eval_and_generate_unchanged(family, spy):
    model, ref = patched_pair(family)
    ids, labels = batch()
    model.eval(), ref.eval()
    with torch.no_grad():
        out, expected = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
        assert torch.equal(out.logits, expected.logits) and torch.equal(out.loss, expected.loss)
        mask = torch.ones_like(ids)
        kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
        assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    model.train(), ref.train()
    with torch.no_grad():  # training mode without labels: the original forward too
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert spy == []


def test_shift_labels_keyword():
    model, ref = patched_pair("llama")
    model.train(), ref.train()
    ids, labels = batch()
    shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    shift_labels[1, 2] = -100  # differs from labels[:, 1:], so the keyword must be the one used
    out = model(input_ids=ids, labels=labels, shift_labels=shift_labels)
    expected = ref(input_ids=ids, labels=labels, shift_labels=shift_labels)
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=0)
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)


def test_return_dict_false_and_positional_arguments():
    model, ref = patched_pair("gemma2")
    model.train(), ref.train()
    ids, labels = batch()
    out = model(ids, None, None, None, None, labels, return_dict=False, use_cache=False)
    expected = ref(ids, None, None, None, None, labels, return_dict=False, use_cache=False)
    # (loss, logits): None fields are dropped, as HF does, but the logits keep their place as None.
    assert isinstance(out, tuple) and len(out) == len(expected) == 2 and out[1] is None
    torch.testing.assert_close(out[0], expected[0], rtol=RTOL, atol=0)
    with pytest.raises(TypeError, match="multiple values"):
        model(ids, input_ids=ids, labels=labels)


def test_return_dict_false_keeps_the_unpatched_positions():
    # With a cache and hidden states, the tuple is (loss, logits, cache, hidden_states) unpatched:
    # out[1] must stay the (None) logits, not become the cache.
    model, ref = patched_pair("llama")
    model.train(), ref.train()
    ids, labels = batch()
    kwargs = dict(input_ids=ids, labels=labels, return_dict=False, use_cache=True, output_hidden_states=True)
    out, expected = model(**kwargs), ref(**kwargs)
    assert isinstance(out, tuple) and len(out) == len(expected) == 4
    assert out[1] is None and expected[1] is not None
    torch.testing.assert_close(out[0], expected[0], rtol=RTOL, atol=0)
    assert type(out[2]) is type(expected[2]) and out[2].get_seq_length() == expected[2].get_seq_length()
    for a, b in zip(out[3], expected[3]):
        torch.testing.assert_close(a, b)
    model.config.return_dict = False  # the config's setting, not the keyword: the same tuple
    del kwargs["return_dict"]
    out = model(**kwargs)
    assert len(out) == 4 and out[1] is None


def test_decoder_outputs_are_carried():
    model, ref = patched_pair("qwen3")
    model.train(), ref.train()
    ids, labels = batch()
    kwargs = dict(input_ids=ids, labels=labels, output_hidden_states=True, output_attentions=True, use_cache=True)
    out, expected = model(**kwargs), ref(**kwargs)
    assert len(out.hidden_states) == len(expected.hidden_states) == 3
    assert len(out.attentions) == len(expected.attentions)
    assert out.cache is not None and out.cache.get_seq_length() == ids.shape[1]
    for a, b in zip(out.hidden_states, expected.hidden_states):
        torch.testing.assert_close(a, b)


def test_patch_by_family_name_and_class_then_unpatch(spy):
    cls = transformers.Qwen2ForCausalLM
    original = cls.forward
    try:
        assert patch("qwen2", impl="torch") == "qwen2"
        patch("qwen2", impl="torch")  # again: replaces, does not stack
        assert hf._patch_of(cls.forward).original is original
        model, ref = make_model("qwen2"), make_model("qwen2")
        unpatch(ref)  # an instance without its own patch: nothing to do
        ids, labels = batch()
        out = model(input_ids=ids, labels=labels)
        assert out.logits is None and len(spy) == 1 and spy[0]["impl"] == "torch"
    finally:
        assert unpatch("qwen2") == "qwen2"
    assert cls.forward is original and "forward" not in vars(model)
    unpatched = model(input_ids=ids, labels=labels)
    assert unpatched.logits is not None
    torch.testing.assert_close(out.loss, unpatched.loss, rtol=RTOL, atol=0)

    llama = transformers.LlamaForCausalLM
    original = llama.forward
    try:
        assert patch(llama) is llama
        assert make_model("llama")(input_ids=ids, labels=labels).logits is None
    finally:
        assert unpatch(llama) is llama
    assert llama.forward is original


def test_subclass_with_inherited_forward():
    class MyLlama(transformers.LlamaForCausalLM):
        pass

    patch(MyLlama)
    assert "forward" in vars(MyLlama) and transformers.LlamaForCausalLM.forward is not MyLlama.forward
    unpatch(MyLlama)
    assert "forward" not in vars(MyLlama)


def test_instance_patch_twice_and_over_a_patched_class(spy):
    model, ref = patched_pair("llama")
    patch(model, filter_eps=None)  # replaces the first patch
    assert hf._patch_of(model.forward).original is transformers.LlamaForCausalLM.forward
    try:
        patch("llama")
        patch(model)  # wraps the original class forward, not the patched one
        assert hf._patch_of(model.forward).original is hf._patch_of(transformers.LlamaForCausalLM.forward).original
        model.train()
        ids, labels = batch()
        model(input_ids=ids, labels=labels)
        assert len(spy) == 1
    finally:
        unpatch("llama")
    assert unpatch(model) is model and "forward" not in vars(model)
    model.eval(), ref.eval()
    ids, _ = batch()
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_deepcopy_of_a_patched_instance_is_patched_on_itself():
    model, _ = patched_pair("llama")
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone


def test_bad_targets_and_options():
    model, _ = patched_pair("llama")
    with pytest.raises(ValueError, match="target: unknown model family 'gpt2'"):
        patch("gpt2")
    with pytest.raises(ValueError, match="target"):
        unpatch("gpt2")
    with pytest.raises(TypeError, match="target: expected a model instance"):
        patch(42)
    with pytest.raises(TypeError, match="target: .*GraniteForCausalLM is not a supported"):
        patch(transformers.GraniteForCausalLM)  # scales its logits: not reproduced
    with pytest.raises(TypeError, match="target: .*Linear is not a supported"):
        patch(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="options: 'reduction' is set by the patched forward"):
        patch(model, reduction="sum")
    with pytest.raises(TypeError, match="options: linear_cross_entropy has no option 'bogus'"):
        patch(model, bogus=1)
    other = make_model("llama")
    other.forward = lambda *a, **k: None  # e.g. an accelerate hook
    with pytest.raises(TypeError, match="target: .*already has its own forward"):
        patch(other)


def test_custom_loss_function_is_kept(spy):
    model, ref = patched_pair("llama")
    model.train()

    def scaled(logits, labels, vocab_size, **kwargs):
        return 2 * transformers.loss.loss_utils.ForCausalLMLoss(logits, labels, vocab_size, **kwargs)

    model.loss_function = scaled
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    assert spy == [] and out.logits is not None
    torch.testing.assert_close(out.loss, 2 * ref(input_ids=ids, labels=labels).loss)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_torch_compile_fullgraph_matches_eager(family):
    # Dynamo with fullgraph=True (no graph break anywhere in the patched model) and AOTAutograd
    # (the loss's fake implementations and registered autograd): loss and every gradient match the
    # unpatched eager model.
    model, ref = patched_pair(family)
    model.train(), ref.train()
    ids, labels = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(17), use_cache=False)
    expected = ref(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(17), use_cache=False)
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=0)
    out.loss.backward()
    expected.loss.backward()
    assert_grads_match(model, ref)
    torch._dynamo.reset()


def test_mixed_precision_under_autocast():
    # The usual mixed-precision loop: fp32 weights, bf16 autocast. The final norm hands fp32 hidden
    # states to the loss with the fp32 lm_head weight; the loss casts e (not the classifier) as
    # autocast's matmul would. Against the unpatched model under the same autocast.
    model, ref = patched_pair("llama")
    model.train(), ref.train()
    ids, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=labels)
        expected = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    expected.loss.backward()
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, expected.loss.float(), rtol=1e-2, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, name
        assert (p.grad - q.grad).norm() <= 0.05 * q.grad.norm() + 1e-6, name


def test_trainer_trains_a_patched_model(tmp_path, spy):
    pytest.importorskip("accelerate")
    model, ref = patched_pair("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    data = []
    for seed in range(4):
        ids, labels = batch(seed, shape=(2, 12))
        data += [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]

    def train(m, out_dir):
        args = transformers.TrainingArguments(
            output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
            optim="sgd", learning_rate=0.5, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
            disable_tqdm=True, dataloader_num_workers=0, seed=0,
        )
        return transformers.Trainer(model=m, args=args, train_dataset=data).train().training_loss

    loss = train(model, tmp_path / "patched")
    assert math.isfinite(loss)
    # 2 steps x 2 micro-batches, each normalised by the whole step's label count.
    assert len(spy) == 4 and all(call["reduction"] == "sum" for call in spy)
    changed = [not torch.equal(p, before[name]) for name, p in model.named_parameters()]
    assert all(changed)
    expected = train(ref, tmp_path / "reference")
    assert loss == pytest.approx(expected, rel=1e-4)
    named_ref = dict(ref.named_parameters())  # SGD: Adam would amplify rounding in tiny gradients
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, named_ref[name], rtol=1e-4, atol=1e-6)


def test_import_needs_no_transformers():
    root = os.path.dirname(os.path.dirname(os.path.abspath(cce_autotune.__file__)))
    code = (
        "import sys; sys.modules['transformers'] = None\n"  # any import of transformers now fails
        "import cce_autotune, cce_autotune.integrations.transformers as hf\n"
        "assert callable(hf.patch)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# -- PEFT (LoRA) ----------------------------------------------------------------------------------
def lora_pair(targets, how):
    """(model, ref, peft_model): the same tiny llama with the same LoRA adapter (random A and B, so
    that it changes the logits) on ``targets``; only ``model`` is patched, ``how``: before
    ``get_peft_model``, after it on the HF model, or by passing the PEFT model itself."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    ref = make_model("llama")
    base = copy.deepcopy(ref)
    torch.manual_seed(5)
    ref = peft.get_peft_model(ref, config)
    if how == "before":
        patch(base)
    torch.manual_seed(5)
    wrapped = peft.get_peft_model(base, config)
    if how == "after":
        patch(wrapped.get_base_model())
    elif how == "peft_model":
        assert patch(wrapped) is wrapped
    assert hf._patch_of(wrapped.get_base_model().forward) is not None
    wrapped.train(), ref.train()
    return wrapped, ref


def assert_trainable_grads_match(model, ref):
    named_ref = dict(ref.named_parameters())
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert trainable
    for name, p in trainable:
        assert p.grad is not None and named_ref[name].grad is not None, name
        torch.testing.assert_close(p.grad, named_ref[name].grad, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("how", ["before", "after", "peft_model"])
def test_lora_on_lm_head_runs_the_models_own_loss(how, spy, monkeypatch):
    # The fused loss reads lm_head.weight and would skip the adapter (another loss, no gradient for
    # lora_A/lora_B); the original forward runs instead, with one warning saying why.
    monkeypatch.setattr(hf, "_warned_heads", set(), raising=False)
    model, ref = lora_pair(["lm_head", "q_proj"], how)
    ids, labels = batch()
    with pytest.warns(UserWarning, match=r"lm_head is a peft\..*not a plain torch.nn.Linear.*merge_and_unload"):
        out = model(input_ids=ids, labels=labels)
    expected = ref(input_ids=ids, labels=labels)
    assert spy == [] and out.logits is not None
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=0)
    out.loss.backward()
    expected.loss.backward()
    assert any("lm_head.lora_B" in name for name, p in model.named_parameters() if p.requires_grad)
    assert_trainable_grads_match(model, ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids, labels=labels)
    assert not [w for w in caught if "lm_head is" in str(w.message)]  # once per process


@pytest.mark.parametrize("how", ["before", "peft_model"])
def test_lora_on_other_modules_keeps_the_fused_loss(how, spy):
    model, ref = lora_pair(["q_proj", "v_proj"], how)
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    expected = ref(input_ids=ids, labels=labels)
    assert len(spy) == 1 and out.logits is None
    torch.testing.assert_close(out.loss, expected.loss, rtol=RTOL, atol=0)
    out.loss.backward()
    expected.loss.backward()
    assert_trainable_grads_match(model, ref)
    assert unpatch(model) is model and "forward" not in vars(model.get_base_model())


def test_capture_activations_from_a_patched_training_step(tmp_path):
    # What cce-tune --data FILE tunes on, captured from a real (tiny) training step.
    from cce_autotune.data import captured as activations

    model, _ = patched_pair("gemma2")
    model.train()
    ids, labels = batch()
    with cce_autotune.capture_activations(tmp_path / "acts.pt") as rec:
        loss = model(input_ids=ids, labels=labels).loss
    acts = activations.load_activations(rec.saved[0])
    assert acts.n == int((labels[:, 1:] != -100).sum())  # shifted, the ignored positions dropped
    assert acts.V == model.config.vocab_size and acts.softcap == model.config.final_logit_softcapping
    assert torch.equal(acts.c, model.lm_head.weight.detach())
    again = cce_autotune.linear_cross_entropy(acts.e, acts.c, acts.targets, softcap=acts.softcap)
    assert torch.allclose(again, loss.detach(), rtol=1e-5)


@pytest.mark.parametrize("case", ["eval", "unpatched", "no_labels"])
def test_capture_that_records_nothing_says_why(tmp_path, case):
    # from_pretrained leaves a model in eval mode: the patched forward then runs the model's own loss,
    # and the capture block ends empty; it must say so, and why.
    model, ref = patched_pair("llama")
    model.train(), ref.train()
    if case == "eval":
        model.eval()
    ids, labels = batch()
    why = {"eval": "the patched model ran its own forward because the model is in eval mode",
           "unpatched": "must be patched.*in training mode.*called with labels",
           "no_labels": "because it was called without labels"}[case]
    with pytest.warns(UserWarning, match=f"capture\\(.*acts.pt\\): nothing was written.*{why}"):
        with cce_autotune.capture_activations(tmp_path / "acts.pt") as rec:
            (ref if case == "unpatched" else model)(input_ids=ids, labels=None if case == "no_labels" else labels)
    assert rec.saved == [] and not (tmp_path / "acts.pt").exists()

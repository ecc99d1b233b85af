"""``cce-bench --train --hf``: whole training steps of Hugging Face models, patched and not.

For each family of :data:`HF_MODELS` (the head and the decoder widths of a released model, a few
decoder layers, built from a config: no download), the same randomly initialised weights take
``warmup`` untimed and ``loop_steps`` timed AdamW steps on the same batches of real text (the
benchmark's corpus, :mod:`cce_autotune.data.real`), in fp32 master weights under bf16 autocast (what
``Trainer(bf16=True)`` runs), with each loss: the model's own (``unpatched``: full logits, then
cross-entropy), ``patch(model)`` (``cce_autotune``), and Liger's fused linear cross-entropy patched
into the instance where ``liger-kernel`` imports (``liger_flce``; its other kernels - RoPE, norms,
MLPs - left out, so that only the loss differs). Apple's ``cut-cross-entropy`` 25.1.1 has no
transformers patch: it is not run here. Rows are those of :func:`cce_autotune.bench.run_train`
(``pass`` = ``train_step``; ``err_loss`` against ``unpatched``), with ``shape`` ``hf_<family>``.
"""

from __future__ import annotations

import gc
import inspect

import torch

from . import memory
from .data import real as realdata
from .integrations.transformers import FAMILIES, patch, unpatch
from .train_steps import TRAIN_WARMUP_STEPS, time_train_steps

__all__ = ["HF_MODELS", "HF_METHODS", "resolve_hf", "run_hf_train"]

# family -> (config class, config of the released model's widths, which model)
HF_MODELS = {
    "llama": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                  num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0),
              "Llama 3.2 1B"),
    "gemma2": ("Gemma2Config", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                    num_key_value_heads=4, head_dim=256, final_logit_softcapping=30.0,
                                    attn_logit_softcapping=50.0, query_pre_attn_scalar=256, sliding_window=4096,
                                    tie_word_embeddings=True),
               "Gemma 2 2B"),
    "qwen3": ("Qwen3Config", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                  num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
              "Qwen 3 1.7B"),
}
HF_METHODS = ("unpatched", "cce_autotune", "liger_flce")
HF_LAYERS = 2
HF_SEQ = 512


def resolve_hf(spec: str) -> list[str]:
    """The families of a ``--hf`` comma list (``all``: every one). ValueError naming ``--hf``."""
    names = list(HF_MODELS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in HF_MODELS]
    if bad or not names:
        raise ValueError(f"--hf: {', '.join(bad) or repr(spec)} is not one of {', '.join(HF_MODELS)} (or 'all')")
    return names


def _build(family: str, layers: int, seq: int, sizes: dict | None, device):
    import transformers  # (lazy: an optional extra, needed only here)

    config_cls, settings, _ = HF_MODELS[family]
    config = getattr(transformers, config_cls)(**{**settings, **(sizes or {}), "num_hidden_layers": layers,
                                                  "max_position_embeddings": seq})
    # Gemma 2's attention softcap runs in the eager attention (as its model card says to train it).
    config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, FAMILIES[family])(config).to(device=device, dtype=torch.float32)


def _liger_patch(family: str):
    """Liger's patch of an instance's loss alone, or None where liger-kernel does not import."""
    try:
        from liger_kernel.transformers import monkey_patch  # (lazy: a peer, where installed)
    except Exception:  # noqa: BLE001 - any import failure means "not installed here"
        return None
    fn = getattr(monkey_patch, f"apply_liger_kernel_to_{family}", None)
    if fn is None:
        return None
    switches = {k: k == "fused_linear_cross_entropy" for k, p in inspect.signature(fn).parameters.items()
                if isinstance(p.default, bool)}
    return lambda model: fn(model=model, **switches)


def run_hf_train(family: str, meta: dict, *, methods=HF_METHODS, tokens: int = 8192, loop_steps: int = 40,
                 warmup: int = TRAIN_WARMUP_STEPS, layers: int = HF_LAYERS, seq: int = HF_SEQ, device="cuda", ids=None,
                 sizes: dict | None = None, log=print) -> list[dict]:
    """Rows (``pass`` = ``train_step``) timing whole training steps of family ``family``'s model with
    each of ``methods`` (of :data:`HF_METHODS`; ``unpatched`` first: the others' ``err_loss`` is
    against it). ``tokens`` per step in windows of ``seq``; ``ids``: the token ids to draw windows
    from (default: the benchmark corpus's training part); ``sizes``: config fields that replace the
    released model's (tests build tiny models). Steps are timed as
    :func:`cce_autotune.train_steps.time_train_steps` times them."""
    if tokens % seq:
        raise ValueError(f"tokens: {tokens} is not a multiple of the sequence length {seq}")
    device = torch.device(device)
    model = _build(family, layers, seq, sizes, device)
    V, D = model.config.vocab_size, model.config.hidden_size
    if ids is None:
        ids = realdata.load_corpus().split(V)[0]
    ids = ids.to(device)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = f"hf_{family}"
    base = dict(meta, data="real", shape=name, B=tokens, V=V, D=D,
                dtype=str(realdata.compute_dtype(device)).replace("torch.", ""))
    lr = realdata.default_lr(D)

    def loss_fn(m, x, y):
        return m(input_ids=x, labels=x).loss  # (the model shifts the labels itself)

    rows, ref_loss = [], None
    for method in methods:
        undo = None
        try:
            model.load_state_dict(init)
            model.zero_grad(set_to_none=True)
            memory.clear()
            if method == "cce_autotune":
                patch(model)
                undo = lambda: unpatch(model)  # noqa: E731
            elif method == "liger_flce":
                liger = _liger_patch(family)
                if liger is None:
                    log(f"{name}: liger_flce skipped: liger-kernel does not import or has no {family} patch")
                    continue
                liger(model)
                undo = lambda: model.__dict__.pop("forward", None)  # noqa: E731 - (Liger sets the instance's)
            elif method != "unpatched":
                raise ValueError(f"methods: {method!r} is not one of {', '.join(HF_METHODS)}")
            opt = realdata.make_optimizer(model, lr)
            row, loss = time_train_steps(model, opt, realdata.batches(ids, tokens // seq, seq, seed=1), loss_fn,
                                         warmup, loop_steps, device, ref_loss)
            if method == "unpatched":
                ref_loss, row["err_loss"] = loss, 0.0
            rows.append(dict(base, method=method, **row))
            med, mem = row["median_ms"], row["peak_extra_mib"]
            ref = f"{ref_loss:.4f}" if ref_loss is not None else "n/a"
            log(f"{name} ({HF_MODELS[family][2]}, {layers} layers): {method:14s} train_step {med:8.2f} ms  "
                f"{mem:9.1f} MiB  loss {loss:.4f} (unpatched {ref})")
            del opt
        except Exception as exc:  # a peer failing must not stop the others
            if isinstance(exc, ValueError) and str(exc).startswith("methods:"):
                raise
            log(f"{name}: {method} train_step FAILED: {exc!r}")
        finally:
            if undo is not None:
                undo()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows

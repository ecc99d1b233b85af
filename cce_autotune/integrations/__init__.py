"""Optional integrations with third-party libraries.

Each submodule imports its library lazily, so ``import cce_autotune`` never needs them:
``cce_autotune.integrations.transformers`` patches Hugging Face causal-LM models to compute their
training loss with :func:`cce_autotune.linear_cross_entropy`.
"""

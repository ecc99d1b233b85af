"""cce-autotune: autotuned, template-generated Cut Cross-Entropy kernels.

The public names are imported on first use (PEP 562), so that ``cce-tune --help`` and other
commands that need no kernel do not pay for importing PyTorch.
"""

from __future__ import annotations

import importlib

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropy",
    "KernelVariants",
    "IndexedDotVariant",
    "LSEForwardVariant",
    "BackwardVariant",
    "VariantError",
    "save_activations",
    "load_activations",
    "capture_activations",
]
__version__ = "0.1.0"

_WHERE = {
    "linear_cross_entropy": "loss",
    "LinearCrossEntropy": "loss",
    "KernelVariants": "variant",
    "IndexedDotVariant": "variant",
    "LSEForwardVariant": "variant",
    "BackwardVariant": "variant",
    "VariantError": "variant",
    "save_activations": "activations",
    "load_activations": "activations",
    "capture_activations": "activations",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'cce_autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)

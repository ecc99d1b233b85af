"""cce-autotune: autotuned, template-generated Cut Cross-Entropy kernels.

The public names are imported on first use (PEP 562), so that ``cce-tune --help`` and other
commands that need no kernel do not pay for importing PyTorch.

The flow of a call: :mod:`.api` (the function and its Module) -> :mod:`.runtime` (the custom
operators, one call's tensors, the execution of its plan) -> :mod:`.planning` (the call's plan: the
budget, the cost model, the filter's accuracy check) -> :mod:`.strategies` (each way of computing the
gradients, and the forward's kernels) -> :mod:`.codegen` (templates rendered into Triton kernels).
Beside it: :mod:`.configdb` (the tuned-config database and the dispatcher), :mod:`.memory` (what is
remembered per classifier), :mod:`.tuner` (cce-tune), :mod:`.data`, :mod:`.integrations`, :mod:`.cli`.
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
    "linear_cross_entropy": "api",
    "LinearCrossEntropy": "api",
    "KernelVariants": "variant",
    "IndexedDotVariant": "variant",
    "LSEForwardVariant": "variant",
    "BackwardVariant": "variant",
    "VariantError": "variant",
    "save_activations": "data.captured",
    "load_activations": "data.captured",
    "capture_activations": "data.captured",
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

"""cce-autotune: autotuned, template-generated Cut Cross-Entropy kernels."""

from .loss import LinearCrossEntropy, linear_cross_entropy
from .variant import BackwardVariant, IndexedDotVariant, KernelVariants, LSEForwardVariant, VariantError

__all__ = [
    "linear_cross_entropy",
    "LinearCrossEntropy",
    "KernelVariants",
    "IndexedDotVariant",
    "LSEForwardVariant",
    "BackwardVariant",
    "VariantError",
]
__version__ = "0.1.0"

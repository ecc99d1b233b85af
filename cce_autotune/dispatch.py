"""GPU + problem shape -> kernel variants."""

from __future__ import annotations

from .variant import KernelVariants

__all__ = ["select_variants", "default_variants"]


def default_variants() -> KernelVariants:
    return KernelVariants()


def select_variants(e, c) -> KernelVariants:
    return default_variants()

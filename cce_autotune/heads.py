"""Well-known models' heads: the one table of (family, model, V, D, softcap) that the tuner's
defaults and the documentation read.

``cce-tune --vocab V`` without ``--hidden`` tunes the hidden sizes of the heads here with vocabulary
V, and a head here with a softcap is tuned with it (Gemma 2's 30): a tuned entry is looked up with the
flags of the call, so a Gemma 2 entry tuned without its softcap would never be used. The values are
the models' published configs; ``config`` names the transformers config class whose defaults are this
head (tests/test_heads.py checks them where transformers is installed).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Head", "HEADS", "by_vocab", "find", "describe", "markdown_table"]


@dataclass(frozen=True)
class Head:
    family: str
    model: str  # the size(s) within the family
    V: int
    D: int
    softcap: float | None = None  # the final logit softcap (transformers' final_logit_softcapping)
    config: str | None = None  # a transformers config class whose defaults are this head

    @property
    def name(self) -> str:
        return f"{self.family} {self.model}"


HEADS = (
    Head("GPT-2", "124M", 50257, 768, config="GPT2Config"),
    Head("Pythia", "1B / 1.4B", 50304, 2048),
    Head("Llama 2", "7B", 32000, 4096, config="LlamaConfig"),
    Head("Mistral v0.1", "7B", 32000, 4096, config="MistralConfig"),
    Head("Mistral v0.3", "7B", 32768, 4096),
    Head("Phi-3 mini", "3.8B", 32064, 3072, config="Phi3Config"),
    Head("Llama 3.2", "1B", 128256, 2048),
    Head("Llama 3.2", "3B", 128256, 3072),
    Head("Llama 3", "8B", 128256, 4096),
    Head("Qwen2.5", "0.5B", 151936, 896),
    Head("Qwen2.5", "1.5B", 151936, 1536),
    Head("Qwen2.5", "3B", 151936, 2048),
    Head("Qwen2.5", "7B", 152064, 3584),
    Head("Qwen2.5", "14B", 152064, 5120),
    Head("Gemma", "2B", 256000, 2048),
    Head("Gemma", "7B", 256000, 3072, config="GemmaConfig"),
    Head("Gemma 2", "2B", 256000, 2304, 30.0, config="Gemma2Config"),
    Head("Gemma 2", "9B", 256000, 3584, 30.0),
    Head("Gemma 2", "27B", 256000, 4608, 30.0),
    Head("Gemma 3", "1B", 262144, 1152),
    Head("Gemma 3", "4B", 262208, 2560),
    Head("Gemma 3", "12B", 262208, 3840),
)


def by_vocab(V: int) -> list[Head]:
    """The heads with vocabulary ``V``, in the table's order."""
    return [h for h in HEADS if h.V == V]


def find(V: int, D: int) -> list[Head]:
    """The heads of shape (``V``, ``D``) (several models may share one)."""
    return [h for h in HEADS if h.V == V and h.D == D]


def describe(heads: list[Head]) -> str:
    """"Gemma 2 2B (D=2304, softcap 30), ..." for a note."""
    return ", ".join(f"{h.name} (D={h.D}" + (f", softcap {h.softcap:g})" if h.softcap else ")") for h in heads)


def markdown_table() -> str:
    """The table as Markdown (docs/tuning.md holds it; a test keeps the two equal)."""
    rows = ["| Model | V | D | softcap |", "|---|---:|---:|---:|"]
    rows += [f"| {h.name} | {h.V} | {h.D} | {'' if h.softcap is None else f'{h.softcap:g}'} |" for h in HEADS]
    return "\n".join(rows)

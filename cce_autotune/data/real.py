"""Real data: hidden states of small language models trained on the Python standard library's source.

Synthetic inputs (:mod:`cce_autotune.data`) only imitate what a trained model hands to the loss.  Real
text exists on every machine that runs Python: the standard library's own ``.py`` files (about 8 M
tokens under 3.11 with its test suite, less where a distribution strips the tests).  This module

- tokenizes them at the word level (:func:`tokenize`, :func:`load_corpus`): identifiers and keywords,
  digit runs, every other visible character on its own (quotes, operators, brackets), and each line
  break together with the next line's indentation as one token (``"\\n" + "    "``).  The vocabulary
  of size ``V`` is the ``V - 1`` most frequent tokens (ties by the token's text) plus ``<unk>``.  Ids
  are a fixed pseudo-random permutation of those frequency ranks, as in :func:`~cce_autotune.data.lm_like`,
  so that the id order tells a kernel nothing about frequency that it has not sorted out itself;
- trains a small decoder-only transformer (:class:`GPT`: pre-LayerNorm, causal attention, GELU MLP,
  learned positions, untied ``lm_head``) on the first 95 % of the corpus (:func:`pretrain`);
- runs it on held-out windows of the last 5 % and returns what the loss sees (:func:`real_data`):
  the final LayerNorm's hidden states, ``lm_head.weight`` and the next tokens.

Training recipe: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices and embeddings), peak learning
rate ``6e-4 · sqrt(768 / D)`` (GPT-3's table: 6e-4 at 125 M parameters, 2.5e-4 at 760 M), 10 % linear
warm-up then cosine to a tenth, gradient clipping at 1.0, fp32 master weights, the loss
``F.cross_entropy`` on the full logits.  On CUDA the forward runs under ``torch.autocast(bfloat16)``,
so every matmul is a bf16 tensor-core product and TF32 would change nothing; elsewhere (the CPU tests)
everything stays fp32, which the CPU runs faster and more portably than emulated bf16.

Depth by width: 6 layers up to D = 1024, 4 up to 2048, 2 above; 64-wide heads up to D = 1024, 128-wide
above.  H200 budget at V = 50,000, 300 steps × 8,192 tokens (≈ 6 · matmul parameters · tokens):

====== ====== ============================== ========= ===========================
D      layers matmul parameters (+ lm_head) PFLOP     H200 at 400-500 TFLOP/s
====== ====== ============================== ========= ===========================
768    6      42 M + 38 M                    1.2       3 s (≈ 6 s: small matmuls)
2048   4      201 M + 102 M                  4.5       9-11 s
4096   2      403 M + 205 M                  9.0       18-22 s
====== ====== ============================== ========= ===========================

about 30-40 s for the three heads, plus a few seconds of AdamW updates, under the 90 s target.

Results are cached on disk (:func:`data_dir`: ``$CCE_AUTOTUNE_DATA_DIR``, default ``~/.cache/cce_autotune/real``): the
tokenized corpus per Python installation, and each :func:`real_data` result (fp32, converted to the
requested dtype on load) per (corpus, V, D, B, model shape, training recipe, seed, device type).  A
result is deterministic for a seed on the CPU; on CUDA a few kernels (embedding and attention
backward) accumulate in a nondeterministic order, and the cache is what makes repeated calls equal.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import re
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..paths import cache_dir, save_torch_atomic

__all__ = ["TOKEN_RE", "tokenize", "Corpus", "load_corpus", "data_dir", "GPTConfig", "GPT", "autocast",
           "compute_dtype", "default_lr", "make_optimizer", "batches", "lm_loss", "train_step", "pretrain", "real_data"]

TOKEN_RE = re.compile(r"\n[ \t]*|[^\W\d]\w*|\d+|\S")
DEFAULT_SEQ = 512  # tokens per training window (and the model's number of positions)
HELDOUT_FRACTION = 0.05
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
FINAL_LR_FRACTION = 0.1  # the cosine schedule ends at this fraction of the peak learning rate
_FORMAT = 1  # bump when the tokenizer, the model or the recipe changes: old cache files stop matching


# --- corpus -------------------------------------------------------------------------------------


def data_dir() -> Path:
    """Cache folder of this module: ``$CCE_AUTOTUNE_DATA_DIR``, else ``real/`` in the package's user
    cache (:func:`cce_autotune.paths.cache_dir`: ``~/.cache/cce_autotune/real`` by default)."""
    env = os.environ.get("CCE_AUTOTUNE_DATA_DIR")
    path = Path(env) if env else cache_dir() / "real"
    path.mkdir(parents=True, exist_ok=True)
    return path


def tokenize(text: str) -> list[str]:
    """Word-level tokens of Python source; see the module docstring.  Spaces inside a line are dropped."""
    return TOKEN_RE.findall(text)


def _stdlib_files(root: Path) -> list[Path]:
    """The standard library's ``.py`` files under ``root``, sorted, without installed packages."""
    skip = {"site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))
    if not files:
        raise RuntimeError(f"real data: no .py files under the standard library folder {root}")
    return files


@dataclass(frozen=True)
class Corpus:
    """The tokenized standard library.  ``ranks[i]`` is the frequency rank of token ``i`` among all
    distinct tokens (``words[r]`` is the token of rank ``r``); :meth:`ids` maps ranks to the ids of a
    ``V``-word vocabulary, so one tokenization serves every ``V``."""

    ranks: torch.Tensor  # (N,) int32
    words: list[str]
    key: str  # identifies the Python installation and the tokenizer (part of every cache key)

    def __len__(self) -> int:
        return self.ranks.numel()

    @staticmethod
    def id_of_rank(V: int) -> torch.Tensor:
        """(V,) int64: the id of each of the ``V - 1`` kept ranks, then of ``<unk>``."""
        if V < 2:
            raise ValueError(f"V: a vocabulary needs at least 2 ids (one word and <unk>), got {V}")
        return torch.randperm(V, generator=torch.Generator().manual_seed(0))

    def ids(self, V: int) -> torch.Tensor:
        """(N,) int64 token ids in ``[0, V)``; tokens of rank ``V - 1`` and rarer become ``<unk>``."""
        return self.id_of_rank(V)[self.ranks.clamp(max=V - 1).long()]

    def vocab(self, V: int) -> list[str]:
        """The token of each id (``<unk>`` once; ``<unusedN>`` where the corpus has fewer words)."""
        out = [""] * V
        for rank, i in enumerate(self.id_of_rank(V).tolist()):
            if rank == V - 1:
                out[i] = "<unk>"
            elif rank < len(self.words):
                out[i] = self.words[rank]
            else:
                out[i] = f"<unused{rank}>"
        return out

    def split(self, V: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(training ids, held-out ids): the first 95 % and the last 5 % of the corpus (different files)."""
        ids = self.ids(V)
        cut = min(len(ids) - 1, max(1, round(len(ids) * (1 - HELDOUT_FRACTION))))
        return ids[:cut], ids[cut:]


_corpora: dict[str, Corpus] = {}


def _corpus_key(root: Path) -> str:
    text = f"{platform.python_implementation()} {platform.python_version()} {root} {TOKEN_RE.pattern} {_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _build_corpus(files: list[Path], key: str) -> Corpus:
    index: dict[str, int] = {}  # token -> id in first-seen order
    chunks = []
    for path in files:
        tokens = tokenize(path.read_text(encoding="utf-8", errors="replace"))
        chunks.append(torch.tensor([index.setdefault(t, len(index)) for t in tokens], dtype=torch.int32))
    first_seen = torch.cat(chunks)
    counts = torch.bincount(first_seen, minlength=len(index)).tolist()
    words = list(index)
    order = sorted(range(len(words)), key=lambda i: (-counts[i], words[i]))
    rank_of = torch.empty(len(words), dtype=torch.int32)
    rank_of[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(words), dtype=torch.int32)
    return Corpus(ranks=rank_of[first_seen.long()], words=[words[i] for i in order], key=key)


def load_corpus() -> Corpus:
    """The tokenized standard library of the running Python, from memory, the disk cache, or built
    (a few seconds) and cached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    key = _corpus_key(root)
    if key in _corpora:
        return _corpora[key]
    path = data_dir() / f"corpus_py{platform.python_version()}_{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        corpus = Corpus(ranks=saved["ranks"], words=saved["words"], key=key)
    else:
        files = _stdlib_files(root)
        corpus = _build_corpus(files, key)
        save_torch_atomic({"ranks": corpus.ranks, "words": corpus.words}, path)
        print(f"# real data: corpus of {len(corpus):,} tokens ({len(corpus.words):,} distinct) from "
              f"{len(files)} files under {root}, cached in {path}", file=sys.stderr, flush=True)
    _corpora[key] = corpus
    return corpus


# --- model --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    V: int
    D: int
    layers: int
    heads: int
    seq: int

    @classmethod
    def for_width(cls, V: int, D: int, layers: int | None = None, seq: int = DEFAULT_SEQ) -> "GPTConfig":
        """The shape used for hidden size ``D``: depth and head width as in the module docstring."""
        for name, value in (("V", V), ("D", D), ("seq", seq)) + ((("layers", layers),) if layers is not None else ()):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if layers is None:
            layers = 6 if D <= 1024 else 4 if D <= 2048 else 2
        head_dim = 64 if D <= 1024 else 128
        heads = next(h for h in range(max(1, D // head_dim), 0, -1) if D % h == 0)
        return cls(V=V, D=D, layers=layers, heads=heads, seq=seq)


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP, each residual."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        D = cfg.D
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D, bias=False)
        self.out = nn.Linear(4 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer with learned positions, a final LayerNorm and an untied lm_head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.V, cfg.D)
        self.pos = nn.Embedding(cfg.seq, cfg.D)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.D)
        self.lm_head = nn.Linear(cfg.D, cfg.V, bias=False)

    @classmethod
    def create(cls, cfg: GPTConfig, seed: int = 0, device="cpu") -> "GPT":
        """A freshly initialised model on ``device``, from a generator of its own (the global RNG is
        left alone; modules are built on the meta device, so nothing is initialised twice).
        GPT-2's init: N(0, 0.02), residual output projections N(0, 0.02 / sqrt(2 · layers))."""
        with torch.device("meta"):
            model = cls(cfg)
        model.to_empty(device=device)
        g = torch.Generator(device=device).manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * cfg.layers)
        with torch.no_grad():
            for name, m in model.named_modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.fill_(1.0)
                    m.bias.zero_()
                elif isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, residual_std if name.endswith(("proj", "out")) else 0.02, generator=g)
        return model

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """(b, t) token ids -> (b, t, D) final LayerNorm output: what the loss multiplies by lm_head."""
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.ln_f(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(x))


# --- training -----------------------------------------------------------------------------------


def autocast(device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA, nothing elsewhere (fp32; see the module docstring)."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compute_dtype(device) -> torch.dtype:
    """The dtype :func:`autocast` computes products in on ``device``."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def default_lr(D: int) -> float:
    """Peak learning rate for hidden size ``D``: 6e-4 at 768, falling as 1/sqrt(D)."""
    return 6e-4 * math.sqrt(768 / D)


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings, none on LayerNorm parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def _windows(ids: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (len(starts), seq), of windows wrapping around ``ids``
    (a corpus shorter than a window, or than the tokens asked for, is cycled)."""
    idx = (starts.to(ids.device)[:, None] + torch.arange(seq + 1, device=ids.device)) % ids.numel()
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


def batches(ids: torch.Tensor, n_seqs: int, seq: int, seed: int):
    """Endless (x, y) batches of ``n_seqs`` windows of ``ids`` at random starts, the same sequence
    for a seed on every device (the starts come from a CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield _windows(ids, torch.randint(0, ids.numel(), (n_seqs,), generator=g), seq)


def lm_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference loss: full logits, then F.cross_entropy."""
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def train_step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, loss_fn=lm_loss) -> torch.Tensor:
    """One optimiser step: ``loss_fn(model, x, y)`` under :func:`autocast`, backward, gradient
    clipping, AdamW.  Returns the loss, detached and still on the device (no synchronisation)."""
    with autocast(x.device):
        loss = loss_fn(model, x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _schedule(steps: int):
    warm = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, steps - warm)
        return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def pretrain(model: GPT, train_ids: torch.Tensor, *, steps: int, tokens_per_step: int, seed: int,
             lr: float | None = None) -> float:
    """Train ``model`` for ``steps`` steps of ``tokens_per_step`` tokens (whole windows of the model's
    sequence length) with the recipe of the module docstring; returns the mean loss of the last 10
    steps (nan without steps)."""
    seq = model.cfg.seq
    if tokens_per_step < seq or tokens_per_step % seq:
        raise ValueError(f"tokens_per_step: expected a positive multiple of the sequence length {seq}, got {tokens_per_step}")
    if steps < 0:
        raise ValueError(f"steps: expected >= 0, got {steps}")
    opt = make_optimizer(model, lr if lr is not None else default_lr(model.cfg.D))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(steps))
    model.train()
    losses = []
    data = batches(train_ids, tokens_per_step // seq, seq, seed)
    for _ in range(steps):
        losses.append(train_step(model, opt, *next(data)))
        sched.step()
    return float(torch.stack(losses[-10:]).mean()) if losses else float("nan")


def real_data(B: int, V: int, D: int, dtype=torch.bfloat16, device="cpu", seed: int = 0, steps: int = 300, *,
              layers: int | None = None, seq: int = DEFAULT_SEQ, tokens_per_step: int = 8192, lr: float | None = None):
    """(e (B, D) in ``dtype``, c (V, D) in ``dtype``, targets (B,) int64) of a model trained on the
    standard library: the final LayerNorm's hidden states at the first B positions of evenly spaced
    held-out windows, ``lm_head.weight``, and the token that follows each position.

    The model (:meth:`GPTConfig.for_width`, overridable by ``layers`` and ``seq``) is trained for
    ``steps`` steps of ``tokens_per_step`` tokens from ``seed``; the result is cached on disk (see
    the module docstring), so only the first call per configuration trains.  Logs one line per model
    trained (losses, seconds) to stderr."""
    if not isinstance(B, int) or B < 1:
        raise ValueError(f"B: expected a positive int, got {B!r}")
    cfg = GPTConfig.for_width(V, D, layers=layers, seq=seq)
    corpus = load_corpus()
    device = torch.device(device)
    lr = lr if lr is not None else default_lr(D)
    key = dict(asdict(cfg), B=B, steps=steps, tokens_per_step=tokens_per_step, lr=lr, seed=seed,
               device=device.type, corpus=corpus.key, format=_FORMAT)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    path = data_dir() / f"real_V{V}_D{D}_B{B}_{digest}.pt"
    if path.exists():
        result = torch.load(path, map_location=device, weights_only=True)
    else:
        result = _train_and_sample(cfg, corpus, B, device, seed, steps, tokens_per_step, lr)
        save_torch_atomic({k: v.cpu() for k, v in result.items()}, path)
    e, c = result["e"].to(dtype).contiguous(), result["c"].to(dtype).contiguous()
    return e, c, result["targets"]


def _train_and_sample(cfg: GPTConfig, corpus: Corpus, B: int, device: torch.device, seed: int, steps: int,
                      tokens_per_step: int, lr: float) -> dict[str, torch.Tensor]:
    """Train the model, then run it on held-out windows: fp32 e, c and int64 targets on ``device``."""
    train_ids, heldout_ids = (t.to(device) for t in corpus.split(cfg.V))
    t0 = time.perf_counter()
    model = GPT.create(cfg, seed, device)
    train_loss = pretrain(model, train_ids, steps=steps, tokens_per_step=tokens_per_step, seed=seed, lr=lr)
    n = -(-B // cfg.seq)
    starts = torch.linspace(0, max(0, heldout_ids.numel() - cfg.seq - 1), n).long()
    x, y = _windows(heldout_ids, starts, cfg.seq)
    model.eval()
    with torch.no_grad(), autocast(device):
        e = model.hidden(x).flatten(0, 1)[:B].float()
    c = model.lm_head.weight.detach().float()
    targets = y.flatten()[:B].contiguous()
    heldout = float(F.cross_entropy(e @ c.T, targets))
    print(f"# real data: V={cfg.V} D={cfg.D} (layers={cfg.layers}, heads={cfg.heads}, seq={cfg.seq}) on {device.type}: "
          f"{steps} steps x {tokens_per_step} tokens of a {len(corpus):,}-token corpus, train loss {train_loss:.3f}, "
          f"held-out loss {heldout:.3f} (log V = {math.log(cfg.V):.2f}), {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    return {"e": e.contiguous(), "c": c.contiguous(), "targets": targets}

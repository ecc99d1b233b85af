"""The planner's decisions, recorded: the `cce-tune explain` grid and the plans, checks and results of a
sequence of small calls, compared with files under tests/golden/ (first written before the runtime was
reshaped, issue 20; rewritten for the intended changes of issue 22, the tiles strategy's removal among them). A change that moves a plan shows
here as a diff.

To rewrite the files after an intended change of behaviour: ``python tests/test_plans_unchanged.py --write``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).parent / "golden"

# (V, D) of the heads planned for, token counts, dtypes, budgets, GPUs (h200 reads the shipped file).
HEADS = [(256128, 2304), (128256, 4096), (32768, 4096), (50000, 768), (151936, 896), (128256, 2048)]
TOKENS = "2048,8192,32768"
BUDGETS = ["auto", "none", "256MiB"]
LIVE = "0.02,0.1,0.3,0.6,1"


def explain_grid() -> str:
    from cce_autotune import cli

    out = io.StringIO()
    for gpu in ("h200", "a100"):
        for V, D in HEADS:
            for budget in BUDGETS if gpu == "h200" else ["auto"]:
                for extra in ([], ["--bias"]) if (V, D) == (50000, 768) else ([],):
                    argv = ["explain", "--gpu", gpu, "--vocab", str(V), "--hidden", str(D), "--tokens", TOKENS,
                            "--dtype", "bf16,fp32", "--max-extra-memory", budget, "--live", LIVE, *extra]
                    out.write("$ cce-tune " + " ".join(argv) + "\n")
                    err = io.StringIO()
                    with contextlib.redirect_stderr(err):
                        rc = cli.main_with(argv, out, err) if hasattr(cli, "main_with") else _main(cli, argv, out)
                    out.write(f"rc {rc}\n")
    return out.getvalue()


def _main(cli, argv, out):
    with contextlib.redirect_stdout(out):
        return cli.main(argv)


def _fmt(x: torch.Tensor | None) -> str:
    """The norm and a sum with fixed random signs. (Not the plain sum: dC's is zero up to rounding, since
    each row's softmax minus onehot sums to zero, and printed its rounding noise, which differed from
    one machine to another.)"""
    if x is None:
        return "None"
    x = x.detach().double().flatten()
    signs = torch.randint(0, 2, (x.numel(),), generator=torch.Generator().manual_seed(0)).double() * 2 - 1
    return f"{float(x.norm()):.6g}/{float((x * signs).sum()):.5g}"


# Small configurations run through the interpreter: each a sequence of calls of one classifier that
# moves a little between calls, as in training, on LM-like data peaked enough (0.5 nats of entropy, or
# 3 for the flat cases) that filters leave a share of the tiles live.
def _cases():
    from cce_autotune import BackwardVariant, IndexedDotVariant, KernelVariants, LSEForwardVariant

    small = KernelVariants(
        indexed_dot=IndexedDotVariant(block_b=16, block_d=16),
        lse_forward=LSEForwardVariant(block_b=16, block_v=32, block_d=16, num_splits=3, group_b=2),
        backward=BackwardVariant(block_b=16, block_v=16, block_d=16, group_b=2, chunk_v=64),
    )
    coarse = small.replace(backward=small.backward.replace(filter_eps=2.0**-6))
    return {
        "auto-default-costs": dict(variants=small, costs="default"),
        "auto": dict(variants=small),
        "auto-flat": dict(variants=small, entropy=3.0),
        "coarse": dict(variants=coarse),
        "coarse-flat": dict(variants=coarse, entropy=3.0),
        "medium": dict(variants=small.replace(backward=small.backward.replace(filter_eps=2.0**-10))),
        "coarse-sparse": dict(variants=coarse.replace(backward=coarse.backward.replace(strategy="sparse"))),
        "features": dict(variants=coarse, shift=1, ignore=True, bias=True, softcap=8.0, weights=True),
        "terms": dict(variants=coarse, label_smoothing=0.1, z_loss=1e-3, reduction="none"),
        "lse": dict(variants=coarse, return_lse=True),
        "deterministic": dict(variants=coarse, deterministic=True),
        "tight": dict(variants=coarse, max_extra_memory=12_000),
        "unlimited": dict(variants=coarse, max_extra_memory=None),
        "exact": dict(variants=small, filter_eps=None),
        "mixed": dict(variants=coarse, mixed=True),
        "fused": dict(variants=coarse.replace(backward=coarse.backward.replace(strategy="fused"))),
    }


def _zero_fixed_costs():
    """The planner's cost model without its fixed host costs, so that plans on these tiny shapes are
    decided by the live shares (as on the large shapes of a GPU) and not by launch overheads.
    Returns a function that restores the model."""
    from helpers import NO_CHUNK_HOST

    from cce_autotune.planning import costs

    saved = costs.BUILTIN["h200"]
    costs.BUILTIN["h200"] = dict(map_ms=0.0, **NO_CHUNK_HOST, block_ms=0.0)

    def restore():
        costs.BUILTIN["h200"] = saved

    return restore


def call_trace(names=None) -> str:
    """The trace of the cases ``names`` (all, in order, when None); each case starts afresh (the
    classifier's memory cleared), so a case's trace is the same alone or in the sequence."""
    from cce_autotune import memory
    from cce_autotune.data import lm_like

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = []
    for name, spec in _cases().items():
        if names is not None and name not in names:
            continue
        memory.clear()
        spec = dict(spec)
        restore = _zero_fixed_costs() if spec.pop("costs", "zero") == "zero" else (lambda: None)
        n, V, D = 48, 384, 16  # (small: every call runs the kernels through the interpreter)
        e, c, t = lm_like(n, V, D, dtype=torch.float32, seed=3, entropy=spec.pop("entropy", 0.5))
        g = torch.Generator().manual_seed(7)
        bias = torch.randn(V, generator=g) * 0.3 if spec.pop("bias", False) else None
        if spec.pop("ignore", False):
            t[::7] = -100
        w = torch.rand(n, generator=g) + 0.5 if spec.pop("weights", False) else None
        mixed = spec.pop("mixed", False)
        dt = torch.float16 if mixed else torch.float32
        drift = torch.randn(V, D, generator=g) * 0.01
        e, c, t = e.to(device, dt), c.to(device), t.to(device)
        c = c if mixed else c.to(dt)
        bias = bias.to(device) if bias is not None else None
        w = w.to(device) if w is not None else None
        cc = c.clone()
        try:
            _run_calls(name, spec, e, cc, t, bias, w, drift, device, lines)
        finally:
            restore()
    return "\n".join(lines) + "\n"


def _run_calls(name, spec, e, cc, t, bias, w, drift, device, lines):
    from cce_autotune import linear_cross_entropy

    for step in range(3):
        with torch.no_grad():
            cc.add_(drift.to(device, cc.dtype), alpha=1.0 if step % 2 == 0 else -1.0)
        ee = e.detach().clone().requires_grad_()
        cc.requires_grad_()
        b = bias.detach().clone().requires_grad_() if bias is not None else None
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            out = linear_cross_entropy(ee, cc, t, b, impl="triton", token_weights=w, **spec)
            loss = out[0] if isinstance(out, tuple) else out
            if isinstance(out, tuple):
                loss = loss + 0.1 * (out[1] ** 2).sum()
            if loss.dim():
                loss = (loss * torch.linspace(0.5, 1.5, loss.numel(), device=device)).sum()
            loss.backward()
        lines.append(f"== {name} call {step}: loss {float(loss.detach()):.6g}; dE {_fmt(ee.grad)}; dC {_fmt(cc.grad)}; "
                     f"dbias {_fmt(b.grad if b is not None else None)}")
        lines += [x for x in err.getvalue().splitlines() if x.startswith("cce_autotune plan") or
                  x.startswith("cce_autotune check") or x.startswith("    ")]
        cc = cc.detach()


_NUMBER = re.compile(r"-?\d+\.?\d*(?:e[-+]?\d+)?")


def _alike(text: str, want: str, rel: float = 1e-4) -> bool:
    """Whether ``text`` is ``want`` but for the last digits of the numbers on the computed-value lines
    ("== ..."): a gradient's signed sum rounds a last digit differently on another processor's vector
    code (seen between two x86 boxes). Plan and check lines must match exactly."""
    got, ref = text.splitlines(), want.splitlines()
    if len(got) != len(ref):
        return False
    for a, b in zip(got, ref):
        if a == b:
            continue
        if not a.startswith("== ") or _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
            return False
        for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b)):
            x, y = float(x), float(y)
            if abs(x - y) > rel * max(abs(x), abs(y), 1e-3):
                return False
    return True


def _compare(name: str, text: str, section: str | None = None) -> None:
    path = GOLDEN / name
    assert path.is_file(), f"{path} missing: run python tests/test_plans_unchanged.py --write"
    want = path.read_text() if section is None else _section(path.read_text(), section)
    if section is not None:
        assert want, f"{path} holds no case {section!r}: run python tests/test_plans_unchanged.py --write"
    if text != want and not _alike(text, want):
        import difflib

        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), "golden", "now", n=1))
        pytest.fail(f"{name} differs from the recorded plans:\n{diff[:6000]}")


def test_the_explain_grid_plans_as_recorded(monkeypatch):
    monkeypatch.delenv("CCE_AUTOTUNE_MAX_EXTRA_MEMORY", raising=False)
    monkeypatch.delenv("CCE_AUTOTUNE_CONFIG_DIR", raising=False)
    monkeypatch.delenv("CCE_AUTOTUNE_NO_CONFIGS", raising=False)
    _compare("explain_grid.txt", explain_grid())


def _section(text: str, name: str) -> str:
    """Case ``name``'s lines of a call trace: from its first call's line to the next case's."""
    out, inside = [], False
    for line in text.splitlines(True):
        if line.startswith("== ") and " call 0: " in line:
            inside = line.startswith(f"== {name} call 0: ")
        if inside:
            out.append(line)
    return "".join(out)


CASE_NAMES = list(_cases())


def test_the_recorded_call_trace_holds_every_case_in_order():
    text = (GOLDEN / "call_trace.txt").read_text()
    firsts = [line.split(" call 0: ")[0][3:] for line in text.splitlines() if line.startswith("== ") and " call 0: " in line]
    assert firsts == CASE_NAMES
    assert "".join(_section(text, name) for name in CASE_NAMES) == text


# (one test per case, so that the suite's workers share them)
@pytest.mark.skipif(torch.cuda.is_available(), reason="recorded on the CPU interpreter (GPU rounding differs)")
@pytest.mark.parametrize("case", CASE_NAMES)
def test_a_sequence_of_calls_plans_and_computes_as_recorded(monkeypatch, case):
    monkeypatch.setenv("CCE_AUTOTUNE_EXPLAIN", "all")
    monkeypatch.delenv("CCE_AUTOTUNE_MAX_EXTRA_MEMORY", raising=False)
    _compare("call_trace.txt", call_trace([case]), section=case)


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/test_plans_unchanged.py --write")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ["CCE_AUTOTUNE_EXPLAIN"] = "all"
    for k in ("CCE_AUTOTUNE_MAX_EXTRA_MEMORY", "CCE_AUTOTUNE_CONFIG_DIR", "CCE_AUTOTUNE_NO_CONFIGS"):
        os.environ.pop(k, None)
    if "CCE_AUTOTUNE_CACHE_DIR" not in os.environ:
        import tempfile

        os.environ["CCE_AUTOTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="cce_golden_")
    GOLDEN.mkdir(exist_ok=True)
    (GOLDEN / "explain_grid.txt").write_text(explain_grid())
    (GOLDEN / "call_trace.txt").write_text(call_trace())
    print("wrote", GOLDEN)

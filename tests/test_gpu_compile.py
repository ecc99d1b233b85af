"""Every kernel the loss launches compiles for the GPUs, on a machine without one.

The interpreter runs the kernels' Python, never Triton's compiler: a template can run there and still
fail to build for a GPU (a type, a layout, a loop the pipeliner refuses). ``gpu_compile.py`` records,
under the interpreter, each launch of representative calls (the sweep's configurations and the shipped
H200 tiles in each strategy, bf16 and an fp32 classifier) as the GPU's JIT would specialize it, then, in
a process without the interpreter, compiles each one with ``triton.compile`` for sm_90 (Hopper, TMA
descriptors) and sm_80 (Ampere, those without descriptors), ptxas included.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _ptxas() -> str | None:
    """The ptxas Triton ships (None: no NVIDIA backend or no ptxas here)."""
    try:
        from triton import knobs
        from triton.backends import backends

        if "nvidia" not in backends:
            return None
        path = knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - an older or newer Triton without these: nothing to compile with
        return None
    return path if path and os.path.exists(path) else None


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend or its ptxas is not installed")
def test_every_launched_kernel_compiles_for_hopper_and_ampere(tmp_path):
    records = tmp_path / "launches.json"
    env = {**os.environ, "CCE_AUTOTUNE_CACHE_DIR": str(tmp_path / "cce"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    rec = subprocess.run([sys.executable, str(HERE / "gpu_compile.py"), "record", str(records)],
                         env={**env, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert rec.returncode == 0, rec.stderr[-3000:]
    launches = json.loads(records.read_text())
    kernels = {r["function"] for r in launches}
    # (every kernel of every strategy, the forward's, the rows' and the utilities': a record that
    # missed some would prove nothing about them)
    assert {"cce_lse_forward_kernel", "cce_indexed_dot_kernel", "cce_grad_chunk_kernel", "cce_fused_logits_kernel",
            "cce_sparse_grad_kernel", "cce_targets_kernel", "cce_coefficients_kernel"} <= kernels, kernels
    assert any(kind.startswith("tensordesc") for r in launches for _, kind, _, _ in r["signature"])
    # (the shipped tiles, block_d 64 where the sweep's take 16, with a bias: the fp32 classifier's call)
    assert any(r.get("flags", {}).get("has_bias") and r["variant"].get("block_d") == 64 for r in launches)
    for arch in (90, 80):
        out = subprocess.run([sys.executable, str(HERE / "gpu_compile.py"), "compile", str(records), str(arch)]
                             + (["--accesses"] if arch == 90 else []),
                             env={**env, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        assert lines, (arch, out.stderr[-3000:])
        result = json.loads(lines[-1])
        assert out.returncode == 0 and not result["failures"], (arch, result["failures"][:3])
        assert result["compiled"] >= (len(kernels) if arch == 90 else 1), result
        if arch == 90:
            _assert_fused_accesses_vectorized(out.stdout)


def _assert_fused_accesses_vectorized(stdout: str) -> None:
    # The fused strategy's kernels read and write g's rows (a block's rows x V, the call's largest
    # traffic) in 16-byte accesses, also at an odd V such as the records' 301 or GPT-2's 50257: its rows
    # lie a multiple of 16 elements apart and the masks' bound is the row's width, not V (with V as
    # the bound, sm_90's PTX had 64 scalar 2-byte stores of u, and 32 loads and 32 stores of g). At
    # most one other 2-byte access, an operand's single load in the logits kernel.
    seen = [json.loads(line[len("accesses "):]) for line in stdout.splitlines() if line.startswith("accesses ")]
    fused = [a for a in seen if a["function"] in ("cce_fused_logits_kernel", "cce_fused_grad_kernel")]
    assert {a["function"] for a in fused} == {"cce_fused_logits_kernel", "cce_fused_grad_kernel"}, seen[:3]
    for a in fused:
        allowed = 1 if a["function"] == "cce_fused_logits_kernel" else 0
        assert a["vector"] > 0 and a["scalar16"] <= allowed, a

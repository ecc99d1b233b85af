"""Compiling the kernels for a GPU on a machine without one (used by ``test_gpu_compile.py``).

The interpreter runs the kernels' Python, not Triton's compiler: a template that renders and runs
there may still fail to compile for a GPU. Two processes close that gap:

- ``record``, under the interpreter: runs calls of the loss and records each kernel launch as the
  GPU's JIT would specialize it (the kernel's variant, flags and function, or the utility template and
  its switches; each argument's type and divisibility from Triton's own ``specialize_impl``; the
  constants, warps and stages);
- ``compile``, without the interpreter: renders each recorded kernel for the GPU and compiles it with
  ``triton.compile`` for a target (``cuda:90`` ...), ptxas included: what a GPU's first launch does.

``python tests/gpu_compile.py record OUT.json`` / ``python tests/gpu_compile.py compile IN.json 90 [--usage] [--accesses]``
(``--usage``: each kernel's registers and stack bytes, from the cubin by the ``cuobjdump`` Triton ships: a
kernel spilling to the stack reads and writes local memory in its loop or epilogue; ``--accesses``: each
kernel's global loads and stores in its PTX, scalar 2-byte ones and vectorized ones, as JSON lines).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import time


def _configurations():
    """The loss calls recorded: the sweep's seeded configurations (small tiles; every strategy, dtype,
    flag and term), and the shipped H200 variants' tiles (what a GPU compiles: 128 x 256 x 64 tiles in
    8 warps and 3 stages, TMA descriptors; Llama 3.2 1B's head) in each strategy, a bf16 classifier and
    an fp32 one, the latter with a softcap and a bias."""
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    import test_sweep

    from cce_autotune import KernelVariants
    from cce_autotune.configdb import store as db
    from cce_autotune.paths import resource_dir

    cfgs = [test_sweep._configuration(seed) for seed in range(int(os.environ.get("GPU_COMPILE_SEEDS", "16")))]
    shipped = db.load_file(resource_dir("tuned_configs") / "h200.yaml", expect_gpu="h200").by_key()
    pick = {k.kernel: entry.variant for k, entry in sorted(shipped.items(), key=lambda kv: (kv[0].V, kv[0].D))
            if k.B == 8192 and k.V == 128256 and k.D == 2048 and k.dtype == "bf16"}
    g = torch.Generator().manual_seed(0)
    for strategy in ("chunked", "sparse", "fused"):
        for classifier in (torch.bfloat16, torch.float32):
            full = classifier == torch.float32  # (the fp32 classifier's call with a softcap and a bias)
            kv = KernelVariants(indexed_dot=pick["indexed_dot"], lse_forward=pick["lse_forward"],
                                backward=pick["backward"].replace(strategy=strategy))
            e = (torch.randn(40, 64, generator=g) / 3).bfloat16()
            c = (torch.randn(301, 64, generator=g) / 3).to(classifier)
            t = torch.randint(0, 301, (40,), generator=g)
            cfgs.append(dict(e=e, c=c, t=t, b=(torch.randn(301, generator=g) / 4).bfloat16() if full else None,
                             w=None, o=dict(softcap=30.0 if full else None),
                             run=dict(variants=kv, filter_eps="auto", max_extra_memory=None)))
    return cfgs


def record(path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "record runs under the interpreter"
    import torch
    import triton.language as tl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    from cce_autotune import codegen, linear_cross_entropy
    from cce_autotune.launch import Launcher

    origin, seen, records = {}, set(), []
    real_kernel, real_utility, real_getitem = codegen.load_kernel, codegen.load_utility, Launcher.__getitem__

    def load_kernel(variant, flags=codegen.Flags(), name=None):
        k = real_kernel(variant, flags, name)
        origin[id(k)] = {"variant": variant.to_dict(), "flags": dataclasses.asdict(flags),
                         "function": name or variant.kernel_function}
        return k

    def load_utility(template, function, **switches):
        k = real_utility(template, function, **switches)
        origin[id(k)] = {"template": template, "switches": switches, "function": function}
        return k

    def getitem(self, grid):
        run = real_getitem(self, grid)

        def launch(*args, **kw):
            sig_of = inspect.signature(self.jit.fn)
            params = sig_of.parameters
            bound = sig_of.bind(*args, **{k: v for k, v in kw.items() if k in params})
            sig = []
            for name, p in params.items():
                value = bound.arguments[name]
                if p.annotation is tl.constexpr or "constexpr" in str(p.annotation):
                    kind, attr = "constexpr", None  # (as Triton's binder: the value itself)
                else:
                    kind, attr = native_specialize_impl(CUDABackend, value, False, True, True)
                sig.append([name, kind, attr, value if kind == "constexpr" else None])
            rec = {**origin[id(self)], "signature": sig,
                   "num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
            key = json.dumps(rec, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                records.append(rec)
            return run(*args, **kw)

        return launch

    codegen.load_kernel, codegen.load_utility, Launcher.__getitem__ = load_kernel, load_utility, getitem
    for module in list(sys.modules.values()):  # (the strategies imported the functions by name)
        if getattr(module, "__name__", "").startswith("cce_autotune."):
            for attr, fn in (("load_kernel", load_kernel), ("load_utility", load_utility)):
                if getattr(module, attr, None) in (real_kernel, real_utility):
                    setattr(module, attr, fn)
    for cfg in _configurations():
        e, c, t, b, w = cfg["e"], cfg["c"], cfg["t"], cfg["b"], cfg["w"]
        e, c = e.detach().requires_grad_(), c.detach().requires_grad_()
        for _ in range(3):  # (the first call, then calls with the classifier's order and tile map)
            out = linear_cross_entropy(e, c, t, b, impl="triton", token_weights=w, **cfg["run"], **cfg["o"])
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
    with open(path, "w") as f:
        json.dump(records, f, default=str)
    print(f"recorded {len(records)} launches")


def _usage(cubin: bytes) -> tuple:
    """(registers, stack bytes) of a cubin, or None where cuobjdump is not there."""
    import re
    import subprocess
    import tempfile

    from triton import knobs

    tool = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _accesses(ptx: str) -> dict:
    """Counts of a kernel's global accesses in its PTX: scalar 2-byte loads and stores, and vectorized ones."""
    import re

    ops = re.findall(r"\b(?:ld|st)\.global\S*", ptx)  # (e.g. st.global.v4.b32, ld.global.nc.L1::evict_last.b16)
    vector = [op for op in ops if re.search(r"\.v[248]\.", op)]
    return {"scalar16": sum(1 for op in ops if op not in vector and re.search(r"\.[bfu]16$", op)),
            "vector": len(vector)}


def compile_records(path: str, arch: int, usage: bool = False, accesses: bool = False) -> int:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile runs without the interpreter"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from cce_autotune import codegen
    from cce_autotune.variant import variant_from_dict

    records = json.load(open(path))
    done, failures, t0 = set(), [], time.time()
    for rec in records:
        if "variant" in rec:
            flags = codegen.Flags(**{**rec["flags"], "interpret": False})
            kernel = codegen.load_kernel(variant_from_dict(rec["variant"]), flags, rec["function"])
            what = f"{rec['variant']['kernel']}/{rec['function']} {rec['variant']} {flags}"
        else:
            kernel = codegen.load_utility(rec["template"], rec["function"], **rec["switches"])
            what = f"{rec['template']}/{rec['function']} {rec['switches']}"
        if arch < 90 and any(kind.startswith("tensordesc") for _, kind, _, _ in rec["signature"]):
            continue  # (TMA descriptors: compute capability 9 and later only, as the launcher decides)
        fn = kernel.jit
        signature, constexprs, attrs = {}, {}, {}
        for i, (name, kind, attr, value) in enumerate(rec["signature"]):
            signature[name] = kind
            if kind == "constexpr":
                constexprs[(i,)] = value
            elif attr:
                attrs[(i,)] = CUDABackend.parse_attr(attr)
        key = json.dumps([fn.__name__, fn.cache_key, signature, sorted(map(str, constexprs.items())),
                          sorted(map(str, attrs.items())), rec["num_warps"], rec["num_stages"]])
        if key in done:
            continue
        done.add(key)
        try:
            ck = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": rec["num_warps"], "num_stages": rec["num_stages"]})
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with the kernel it hit
            failures.append(f"{what}: {type(exc).__name__}: {str(exc)[-600:]}")
            continue
        if usage:
            print(f"usage {_usage(ck.asm['cubin'])} {what}")
        if accesses:
            print("accesses " + json.dumps({"function": rec["function"], "variant": rec.get("variant"),
                                            **_accesses(ck.asm["ptx"])}))
    print(json.dumps({"compiled": len(done), "failures": failures, "seconds": round(time.time() - t0, 1)}))
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2])
    else:
        sys.exit(compile_records(sys.argv[2], int(sys.argv[3]), usage="--usage" in sys.argv[4:],
                                 accesses="--accesses" in sys.argv[4:]))

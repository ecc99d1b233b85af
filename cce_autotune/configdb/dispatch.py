"""GPU + problem shape -> kernel variants, from the tuned-config database.

- GPU slug: ``$CCE_AUTOTUNE_GPU`` (a slug or a device name) if set, else the CUDA device's name through
  the alias table (``tuned_configs/aliases.yaml``); CPU tensors give ``"cpu"``.
- Search path, first wins per key: ``$CCE_AUTOTUNE_CONFIG_DIR`` (one or more folders, separated by
  ``os.pathsep``), the user cache's ``tuned_configs/`` (where ``cce-tune`` writes), then the packaged
  ``tuned_configs/``.
- Each kernel is looked up on its own: exact match on dtype and feature flags (has_bias, has_softcap),
  then the nearest tuned shape by log2 distance on B, V and D; the entry is re-validated against the
  device's shared memory. Without a usable entry the kernel keeps its built-in default and ONE
  :class:`TunedConfigWarning` per process names the ``cce-tune`` command that would tune the shape.
  On CPU tensors without ``$CCE_AUTOTUNE_GPU`` the defaults are used silently.
- Lookups are cached: after the first call for a key no file is read and no YAML is parsed again
  (:func:`clear_cache` forgets everything, e.g. after ``cce-tune`` wrote new results).
- Nothing here raises for a file or folder the runtime cannot use: a folder that cannot be searched
  (mode 000), a file that cannot be read or does not load, or a bad ``cost_model`` section is skipped
  with one warning naming it (the entries of a file whose section is bad still apply), and the user
  cache is never created by a lookup (a cache path that is a file or read-only costs nothing).

Never imports optuna or torch at module level (the CLI's lookups stay instant).
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..codegen import template_hash
from ..paths import cache_dir, resource_dir
from ..planning import costs as cost_models
from ..variant import DEFAULT_SMEM_BYTES, KERNELS, KernelVariants, VariantError
from . import store as db

__all__ = [
    "ENV_GPU",
    "ENV_CONFIG_DIR",
    "ENV_NO_CONFIGS",
    "stored_entries",
    "TunedConfigWarning",
    "select_variants",
    "default_variants",
    "select",
    "explain",
    "Explanation",
    "Choice",
    "gpu_slug",
    "resolve_gpu",
    "alias_table",
    "config_search_path",
    "smem_limit_for",
    "dtype_name",
    "b_bucket",
    "tune_command",
    "clear_cache",
    "cost_model_for",
    "costs_for",
]

ENV_GPU = "CCE_AUTOTUNE_GPU"
ENV_CONFIG_DIR = "CCE_AUTOTUNE_CONFIG_DIR"
ENV_NO_CONFIGS = "CCE_AUTOTUNE_NO_CONFIGS"  # "1": no tuned-config file is read (built-in defaults)
CPU_SLUG = "cpu"


class TunedConfigWarning(UserWarning):
    """No tuned variant for this GPU and shape: built-in defaults are used (shown once per process)."""


def default_variants(elem_bytes: int = 2) -> KernelVariants:
    """The built-in variants for inputs of ``elem_bytes`` bytes per element (see KernelVariants.defaults)."""
    return KernelVariants.defaults(elem_bytes)


# -- small helpers ------------------------------------------------------------------------------
def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (also accepts the short names)."""
    name = str(dtype).replace("torch.", "")
    names = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
    name = names.get(name, name)
    if name not in db.DTYPES:
        raise ValueError(f"dtype: {dtype!r} has no tuned configs; use one of {list(db.DTYPES)}")
    return name


def b_bucket(B: int) -> int:
    """The power of two nearest to B in log scale (the token-count buckets of the database)."""
    if B <= 1:
        return 1
    return 1 << round(math.log2(B))


def _log_distance(a: db.EntryKey, B: int, V: int, D: int) -> float:
    return abs(math.log2(a.B / B)) + abs(math.log2(a.V / V)) + abs(math.log2(a.D / D))


def _env_key() -> tuple:
    return tuple(os.environ.get(k) for k in (ENV_CONFIG_DIR, "CCE_AUTOTUNE_CACHE_DIR", "XDG_CACHE_HOME", ENV_NO_CONFIGS))


def configs_disabled() -> bool:
    """``$CCE_AUTOTUNE_NO_CONFIGS`` is set (to anything but "" or "0"): the runtime reads no tuned
    config, every call uses the built-in defaults and cost model."""
    return os.environ.get(ENV_NO_CONFIGS, "0") not in ("", "0")


_skipped: set = set()  # files, folders and sections already warned about
_files: dict[tuple, db.ConfigFile | None] = {}  # (path, slug, env) -> the loaded file or None


def _warn_once(what: str, message: str) -> None:
    if what not in _skipped:
        _skipped.add(what)
        warnings.warn(message, stacklevel=4)


def _load_or_skip(path: Path, slug: str) -> db.ConfigFile | None:
    """The config file (loaded once per process), or None (one warning per file and process) when it
    cannot be read or parsed: a broken file must not stop training, and other folders' entries still
    apply. A bad ``cost_model`` section, or an entry beyond the database's bounds, is left out of the
    file with a warning and the rest applies. (``cce-tune show`` and saving report such a file, or
    section, as an error.)"""
    key = (str(path), slug, _env_key())
    if key in _files:
        return _files[key]
    try:
        cfg = db.load_file(path, expect_gpu=slug, strict_cost_model=False)
    except db.ConfigDBError as exc:
        _warn_once(str(path), f"cce_autotune: skipping a tuned-config file that does not load: {exc} "
                              f"(set {ENV_NO_CONFIGS}=1 to read no config file)")
        cfg = None
    _files[key] = cfg
    return cfg


def _unsearchable(folder: Path) -> str | None:
    """Why the files of ``folder`` cannot be looked up (permissions), or None: they can, or there is
    nothing there to look up (no such folder, or a file)."""
    try:
        os.stat(os.path.join(folder, "."))  # (resolving "folder/." needs the right to search it)
    except PermissionError as exc:
        return exc.strerror or str(exc)
    except OSError:
        pass
    return None


def config_search_path(skipped: list | None = None) -> list[Path]:
    """Folders searched for ``<slug>.yaml`` and ``aliases.yaml``, highest priority first. A folder
    whose files cannot be looked up (no permission) is left out, with one warning per folder and
    process; ``skipped``: a list that gets ``(folder, reason)`` for each (for ``cce-tune show``)."""
    dirs: list[Path] = []
    env = os.environ.get(ENV_CONFIG_DIR)
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs.append(cache_dir(create=False) / "tuned_configs")  # (a lookup never creates the cache)
    try:
        dirs.append(resource_dir("tuned_configs"))
    except FileNotFoundError:  # pragma: no cover - broken install
        pass
    out = []
    for d in dirs:
        if d in out:
            continue
        why = _unsearchable(d)
        if why is not None:
            _warn_once(f"folder {d}", f"cce_autotune: skipping tuned-config folder {d}: cannot search it ({why})")
            if skipped is not None:
                skipped.append((d, why))
            continue
        out.append(d)
    return out


def _config_file(folder: Path, slug: str) -> Path | None:
    """``folder/<slug>.yaml`` when it is a file (None also when it cannot even be looked up: warned)."""
    path = folder / f"{slug}.yaml"
    try:
        return path if path.is_file() else None
    except OSError as exc:
        _warn_once(str(path), f"cce_autotune: skipping a tuned-config file that cannot be read: {path}: "
                              f"{exc.strerror or exc}")
        return None


@lru_cache(maxsize=8)
def _alias_table(env_key: tuple) -> db.AliasTable:
    table = db.AliasTable()
    for d in config_search_path():
        try:
            table = table.extend(db.load_aliases([d / "aliases.yaml"]))
        except db.ConfigDBError as exc:  # a broken alias file: skipped, as a broken config file
            warnings.warn(f"cce_autotune: skipping an alias file that does not load: {exc}", stacklevel=3)
    return table


def alias_table() -> db.AliasTable:
    return _alias_table(_env_key())


def resolve_gpu(name_or_slug: str) -> str:
    """Slug of a device name (``"NVIDIA H200"`` -> ``"h200"``) or of a slug (itself)."""
    return alias_table().resolve(name_or_slug)


def _cuda_name(device) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


@lru_cache(maxsize=64)
def _device_slug(index: int, env_key: tuple) -> str:
    name = _cuda_name(index)
    return resolve_gpu(name) if name else CPU_SLUG


def gpu_slug(device=None) -> str:
    """Slug of ``device`` (a torch device, index or None for the current CUDA device).

    ``$CCE_AUTOTUNE_GPU`` overrides; a CPU device (or no CUDA) gives ``"cpu"``.
    """
    env = os.environ.get(ENV_GPU)
    if env:
        return resolve_gpu(env)
    import torch

    if device is not None and torch.device(device).type != "cuda":
        return CPU_SLUG
    if not torch.cuda.is_available():
        return CPU_SLUG
    index = torch.device(device).index if device is not None else None
    if index is None:
        index = torch.cuda.current_device()
    return _device_slug(index, _env_key())


@lru_cache(maxsize=64)
def _device_smem(index: int) -> int | None:
    import torch

    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None)


def smem_limit_for(slug: str, device=None) -> int | None:
    """Shared memory per block the variants must fit: the CUDA device's opt-in limit when there is
    one, else the alias table's figure for ``slug``, else the Hopper default. None on the CPU."""
    if device is not None:
        import torch

        dev = torch.device(device)
        if dev.type != "cuda":
            return None  # the Triton interpreter has no shared memory limit
        smem = _device_smem(dev.index if dev.index is not None else torch.cuda.current_device())
        if smem:
            return int(smem)
    if slug == CPU_SLUG:
        return None
    return alias_table().shared_memory.get(slug, DEFAULT_SMEM_BYTES)


def tune_command(gpu: str, dtype: str, B: int, V: int, D: int, has_bias=False, has_softcap=False,
                 kernels=None) -> str:
    """The ``cce-tune`` command line that would tune this shape."""
    cmd = f"cce-tune --gpu {gpu} --vocab {V} --hidden {D} --tokens {b_bucket(B)} --dtype {dtype}"
    if has_bias:
        cmd += " --bias"
    if has_softcap:
        cmd += " --softcap"
    if kernels and set(kernels) != set(KERNELS):
        cmd += " --kernels " + ",".join(kernels)
    return cmd


# -- loading the database ---------------------------------------------------------------------
def _load_entries(slug: str) -> list[tuple[db.Entry, Path]]:
    """All entries for ``slug`` along the search path; a key in an earlier folder hides later ones."""
    seen: dict[db.EntryKey, tuple[db.Entry, Path]] = {}
    if configs_disabled():
        return []
    for d in config_search_path():
        path = _config_file(d, slug)
        if path is None:
            continue
        cfg = _load_or_skip(path, slug)
        for entry in cfg.entries if cfg is not None else []:
            seen.setdefault(entry.key, (entry, path))
    return list(seen.values())


_lock = threading.Lock()
_entries_cache: dict[tuple, list] = {}
_select_cache: dict[tuple, KernelVariants] = {}
_warned = False


def _entries(slug: str, env_key: tuple) -> list[tuple[db.Entry, Path]]:
    key = (slug, env_key)
    hit = _entries_cache.get(key)
    if hit is None:
        with _lock:
            hit = _entries_cache.get(key)
            if hit is None:
                hit = _load_entries(slug)
                _entries_cache[key] = hit
    return hit


def stored_entries(slug: str) -> list[db.Entry]:
    """Every entry the lookups of GPU ``slug`` see (a key in an earlier folder hides later ones), on any
    template: what a tuning run would replace."""
    return [entry for entry, _ in _entries(slug, _env_key())]


_cost_cache: dict[tuple, dict | None] = {}


def cost_model_for(slug: str) -> tuple[dict, Path] | None:
    """The planner's cost coefficients for GPU ``slug``: the ``cost_model`` section of the first
    ``<slug>.yaml`` along the search path that has a valid one, with its file; None without one (a
    bad section is passed over with a warning, as if the file had none)."""
    key = (slug, _env_key())
    if key not in _cost_cache:
        found = None
        for d in [] if configs_disabled() else config_search_path():
            path = _config_file(d, slug)
            if path is not None:
                cfg = _load_or_skip(path, slug)
                if cfg is not None and cfg.cost_model:
                    found = (cfg.cost_model, path)
                    break
        with _lock:
            _cost_cache[key] = found
    return _cost_cache[key]


def costs_for(gpu: str | None):
    """The planner's cost model for GPU slug ``gpu`` (None: the CPU): the one the tuner set in this
    process, else the ``cost_model`` section of the GPU's tuned-config file over the built-in
    coefficients, else the built-in ones (:mod:`cce_autotune.planning.costs`)."""
    if not gpu or gpu == CPU_SLUG:
        return cost_models.cost_model(None)
    found = cost_model_for(gpu)
    try:
        return cost_models.cost_model(gpu, *(found or (None, None)))
    except (ValueError, TypeError) as exc:  # (loading validates the section: a last net, the loss never raises)
        _warn_once(f"cost_model {found[1] if found else gpu}",
                   f"cce_autotune: ignoring a cost_model section: {exc}; the built-in cost model is used")
        return cost_models.cost_model(gpu)


def clear_cache() -> None:
    """Forget every cached lookup, file and alias table (and allow the fallback warning again)."""
    global _warned
    with _lock:
        _entries_cache.clear()
        _select_cache.clear()
        _cost_cache.clear()
        _files.clear()
        _alias_table.cache_clear()
        _device_slug.cache_clear()
        _skipped.clear()
        _warned = False


# -- selection --------------------------------------------------------------------------------
@dataclass
class Choice:
    """What one kernel gets for a query, and why."""

    kernel: str
    variant: object
    entry: db.Entry | None = None
    source: Path | None = None
    distance: float | None = None
    reason: str = ""
    rejected: list = field(default_factory=list)  # (entry key, source, why) of closer entries that failed

    @property
    def tuned(self) -> bool:
        return self.entry is not None


@dataclass
class Explanation:
    gpu: str
    dtype: str
    B: int
    V: int
    D: int
    has_bias: bool
    has_softcap: bool
    smem_limit: int | None
    search_path: list
    choices: dict  # kernel -> Choice

    @property
    def variants(self) -> KernelVariants:
        return KernelVariants(**{k: c.variant for k, c in self.choices.items()})

    @property
    def missing(self) -> list:
        return [k for k, c in self.choices.items() if not c.tuned]

    def __str__(self) -> str:
        flags = f"has_bias={self.has_bias}, has_softcap={self.has_softcap}"
        smem = "unlimited" if self.smem_limit is None else f"{self.smem_limit} bytes"
        lines = [
            f"GPU {self.gpu}, {self.dtype}, B={self.B} (bucket {b_bucket(self.B)}), V={self.V}, D={self.D}, {flags}",
            f"shared memory per block: {smem}",
            "search path: " + ", ".join(str(p) for p in self.search_path),
        ]
        for k, c in self.choices.items():
            knobs = ", ".join(f"{n}={v}" for n, v in c.variant.to_dict().items() if n != "kernel")
            lines.append(f"  {k}: {c.reason}")
            for key, src, why in c.rejected:
                lines.append(f"      skipped {key.describe()} from {src}: {why}")
            lines.append(f"      {knobs}")
        if self.missing and self.gpu != CPU_SLUG:
            lines.append("to tune the missing kernels: " + tune_command(
                self.gpu, self.dtype, self.B, self.V, self.D, self.has_bias, self.has_softcap, self.missing))
        return "\n".join(lines)


def _choose(kernel, entries, dtype, B, V, D, has_bias, has_softcap, smem_limit, template_hash=None) -> Choice:
    elem_bytes = 4 if dtype == "fp32" else 2
    candidates = [
        (_log_distance(e.key, B, V, D), e.key, e, src) for e, src in entries
        if e.key.kernel == kernel and e.key.dtype == dtype
        and e.key.has_bias == has_bias and e.key.has_softcap == has_softcap
    ]
    candidates.sort(key=lambda t: (t[0], t[1]))
    rejected = []
    for dist, key, entry, src in candidates:
        try:
            entry.variant.validate(elem_bytes, smem_limit)
        except VariantError as exc:
            rejected.append((key, src, str(exc)))
            continue
        how = "exact match" if dist == 0 else f"nearest tuned shape (log2 distance {dist:.2f})"
        speed = f"{entry.speedup:.2f}x the default" if entry.speedup else "the default did not run"
        reason = f"{how}: {key.describe()} from {src}, {speed}"
        if template_hash is not None and entry.template_hash != template_hash(kernel):
            reason += f" (tuned on template {entry.template_hash}, now {template_hash(kernel)}: re-tune advised)"
        return Choice(kernel, entry.variant, entry, src, dist, reason, rejected)
    if rejected:
        reason = "built-in default: no tuned entry fits this device"
    else:
        reason = f"built-in default: no tuned entry for {kernel} {dtype} has_bias={has_bias} has_softcap={has_softcap}"
    default = getattr(default_variants(4 if dtype == "fp32" else 2), kernel)
    return Choice(kernel, default, None, None, None, reason, rejected)


def _resolve(slug, dtype, B, V, D, has_bias, has_softcap, smem_limit, template_hash=None) -> dict:
    entries = _entries(slug, _env_key()) if slug != CPU_SLUG else []
    return {k: _choose(k, entries, dtype, B, V, D, has_bias, has_softcap, smem_limit, template_hash) for k in KERNELS}


def explain(gpu: str, dtype, B: int, V: int, D: int, has_bias: bool = False, has_softcap: bool = False,
            smem_limit: int | None | str = "auto") -> Explanation:
    """Which entry each kernel would use for this GPU (slug or device name) and shape, and why."""
    slug = resolve_gpu(gpu)
    dtype = dtype_name(dtype)
    smem = smem_limit_for(slug) if smem_limit == "auto" else smem_limit
    choices = _resolve(slug, dtype, b_bucket(B), V, D, has_bias, has_softcap, smem, template_hash)
    if slug == CPU_SLUG:
        for c in choices.values():
            c.reason = "built-in default: CPU tensors (set CCE_AUTOTUNE_GPU to look up a GPU's configs)"
    return Explanation(slug, dtype, B, V, D, has_bias, has_softcap, smem, config_search_path(), choices)


def select(gpu: str, dtype, B: int, V: int, D: int, has_bias: bool = False, has_softcap: bool = False,
           smem_limit: int | None | str = "auto", warn: bool = True) -> KernelVariants:
    """Cached lookup of the variants for a GPU (slug or device name) and shape (see the module docstring)."""
    global _warned
    gpu = resolve_gpu(gpu)
    dtype = dtype_name(dtype)
    if smem_limit == "auto":
        smem_limit = smem_limit_for(gpu)
    key = (gpu, dtype, b_bucket(B), V, D, bool(has_bias), bool(has_softcap), smem_limit, _env_key())
    hit = _select_cache.get(key)
    if hit is not None:
        return hit
    choices = _resolve(gpu, dtype, b_bucket(B), V, D, bool(has_bias), bool(has_softcap), smem_limit)
    variants = KernelVariants(**{k: c.variant for k, c in choices.items()})
    missing = [k for k, c in choices.items() if not c.tuned]
    with _lock:
        _select_cache[key] = variants
        emit = warn and missing and not _warned
        if emit:
            _warned = True
    if emit:
        warnings.warn(
            f"cce_autotune: no tuned config for {', '.join(missing)} on GPU {gpu!r} ({dtype}, B~{b_bucket(B)}, "
            f"V={V}, D={D}, has_bias={bool(has_bias)}, has_softcap={bool(has_softcap)}); using built-in defaults. "
            f"Tune this shape with: {tune_command(gpu, dtype, B, V, D, has_bias, has_softcap, missing)} "
            f"(shown once per process)",
            TunedConfigWarning,
            stacklevel=3,
        )
    return variants


def select_variants(e, c, *, has_bias: bool = False, has_softcap: bool = False) -> KernelVariants:
    """Kernel variants for embeddings ``e`` (..., D) and classifier ``c`` (V, D) on their device.

    CPU tensors (Triton interpreter) use the built-in defaults, quietly, unless ``$CCE_AUTOTUNE_GPU``
    asks for a GPU's configs.
    """
    if e.device.type != "cuda" and not os.environ.get(ENV_GPU):
        return default_variants(e.element_size())
    slug = gpu_slug(e.device)
    if slug == CPU_SLUG:
        return default_variants(e.element_size())
    D = e.shape[-1]
    B = max(1, e.numel() // max(D, 1))
    smem = smem_limit_for(slug, e.device)
    return select(slug, e.dtype, B, c.shape[0], D, has_bias, has_softcap, smem_limit=smem)

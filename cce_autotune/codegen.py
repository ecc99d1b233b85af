"""Render a kernel template with a variant's knobs into Triton source, cache it on disk, import it.

- Templates are Jinja2 (``templates/*.py.j2``) rendered with ``StrictUndefined``: a knob or flag the
  template uses but the caller did not pass is an error, never an empty string.
- The rendered module is written to ``<cache>/kernels/<name>_<hash>.py`` (hash of the template
  sources + knobs + flags) for people to read, but never imported from there: each process renders
  the source, checks the file against it (rewriting it when it differs) and executes the rendered
  text itself, compiled in memory into a fresh module (no ``__pycache__``: a ``.pyc`` planted beside
  the file is never read, and none is written). The text is registered in :mod:`linecache` under a
  name that is not a file (``<cce_autotune PATH>``), so ``inspect`` and Triton read the kernel's
  source from memory, never again from the disk, and Triton's compile cache keys (the source and its
  line numbers) stay stable across processes. A cache folder that cannot be written (a file, a
  read-only folder) costs one warning per folder and process: the kernels run from memory.
- :func:`render_source` returns the text of any variant, for people to read (``cce-tune render``).

A *variant* here is any object with the knobs of :mod:`cce_autotune.variant`'s kernel variants
(``kernel``, ``template``, ``kernel_function``, ``to_dict()``, ``template_knobs()``): this module knows
Jinja, not the variants' schema (which reads the strategies' table, whose modules use this one).
"""

from __future__ import annotations

import hashlib
import json
import linecache
import os
import re
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2

from .launch import Launcher
from .paths import cache_dir, resource_dir

__all__ = ["Flags", "render_source", "load_kernel", "template_hash", "template_files", "interpreting"]

_IMPORT = re.compile(r"""\{%-?\s*(?:import|from|include)\s+["']([^"']+)["']""")


def template_files(kernel: str) -> tuple:
    """Every template a kernel's variants may render: ``<kernel>.py.j2`` and ``<kernel>_*.py.j2`` (the
    backward's strategies each render ``backward_<strategy>.py.j2``)."""
    tdir = resource_dir("templates")
    return tuple(sorted(p.name for p in tdir.glob(f"{kernel}*.py.j2")
                        if p.name == f"{kernel}.py.j2" or p.name.startswith(f"{kernel}_")))


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton reads TRITON_INTERPRET when it is imported (its language functions are built for one mode);
# a change afterwards cannot take effect and would fail deep inside Triton.
_INTERPRET_AT_IMPORT = interpreting()


def check_interpret_mode() -> None:
    """Raise a clear error when ``TRITON_INTERPRET`` changed since Triton was imported."""
    now = interpreting()
    if now != _INTERPRET_AT_IMPORT:
        raise RuntimeError(
            f"TRITON_INTERPRET is {os.environ.get('TRITON_INTERPRET')!r} now but was "
            f"{'set' if _INTERPRET_AT_IMPORT else 'unset'} when Triton was imported; Triton reads it only at "
            "import: set it before importing cce_autotune (or triton), in a fresh process")


@dataclass(frozen=True)
class Flags:
    """Structural features of a call; each one is an ``{% if %}`` in the templates."""

    has_bias: bool = False
    has_softcap: bool = False
    even_d: bool = False  # D is a multiple of BLOCK_D: no masks along D
    ieee_dot: bool = False  # fp32 inputs: IEEE fp32 products instead of tf32
    dense_rows: bool = False  # row i of the problem is row i of E at stride_eb: no offset table
    rows_aligned: bool = False  # every row offset is a multiple of 8 elements (16-byte vector loads)
    interpret: bool = False  # rendering for the Triton interpreter
    walk_perm: bool = False  # forward walks the vocabulary in a given order (a previous call's sort)
    tile_map: bool = False  # forward records the per-(row, vocab tile) bound map for the backward
    tile_live: bool = False  # chunked backward: dead tiles of the live grid are written as zeros
    dead_unwritten: bool = False  # ... or not written at all (the tile products read live tiles only)
    cast_c: bool = False  # C is wider than E (fp32 classifier, 16-bit e): its tiles are rounded to E's dtype
    c_local: bool = False  # C is a converted window of the classifier, addressed by walked position
    live_mass: bool = False  # chunked backward: each row's softmax mass in the computed tiles (atomics)
    e_desc: bool = False  # LSE forward, chunked backward: E comes as a TMA descriptor (common.tma_descriptors)
    c_desc: bool = False  # LSE forward, chunked backward: C comes as a TMA descriptor (rows walked by position)

    def template_flags(self) -> dict:
        return {
            "HAS_BIAS": self.has_bias,
            "HAS_SOFTCAP": self.has_softcap,
            "EVEN_D": self.even_d,
            "IEEE_DOT": self.ieee_dot,
            "DENSE_ROWS": self.dense_rows,
            "ROWS_ALIGNED": self.rows_aligned,
            "INTERPRET": self.interpret,
            "WALK_PERM": self.walk_perm,
            "TILE_MAP": self.tile_map,
            "TILE_LIVE": self.tile_live,
            "DEAD_UNWRITTEN": self.dead_unwritten,
            "CAST_C": self.cast_c,
            "C_LOCAL": self.c_local,
            "LIVE_MASS": self.live_mass,
            "E_DESC": self.e_desc,
            "C_DESC": self.c_desc,
        }


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


@lru_cache(maxsize=None)
def template_hash(kernel: str) -> str:
    """Hash of a kernel's templates and the macro files they import: changes whenever the generated
    code may."""
    h = hashlib.sha256()
    tdir = resource_dir("templates")
    names = set(template_files(kernel))
    for name in list(names):
        names.update(_IMPORT.findall((tdir / name).read_text()))
    for name in sorted(names | {"_common.j2"}):
        h.update(name.encode())
        h.update((tdir / name).read_bytes())
    return h.hexdigest()[:16]


def _context(variant, flags: Flags) -> dict:
    knobs = variant.template_knobs()
    # Knobs that only the launcher uses (splits, filter value, ...) stay in the context: the summary
    # line shows them and templates may branch on them.
    ctx: dict[str, Any] = {**knobs, **flags.template_flags()}
    ctx["FILTER"] = knobs.get("FILTER_EPS") is not None
    ctx["TEMPLATE"] = variant.template
    ctx["KNOB_SUMMARY"] = ", ".join(f"{k}={v}" for k, v in sorted(knobs.items()))
    ctx["FLAG_SUMMARY"] = ", ".join(f"{k}={v}" for k, v in sorted(flags.template_flags().items()))
    return ctx


def render_source(variant, flags: Flags = Flags()) -> str:
    """The Triton source of ``variant`` with ``flags``: what :func:`load_kernel` compiles."""
    if not template_files(variant.kernel):
        raise ValueError(f"variant: unknown kernel {variant.kernel!r}")
    if getattr(variant, "strategy", None) == "auto":
        raise ValueError("variant: strategy 'auto' is decided at launch (cce_autotune.planning.planner); render a "
                         "concrete one")
    template = _env().get_template(variant.template)
    return template.render(**_context(variant, flags))


def source_key(variant, flags: Flags) -> str:
    blob = json.dumps(
        {"t": template_hash(variant.kernel), "v": variant.to_dict(), "f": flags.template_flags()},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


_lock = threading.Lock()
_modules: dict[tuple, ModuleType] = {}
_launchers: dict[str, dict] = {}  # module name -> {kernel name: Launcher}


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=".py")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_kernel(variant, flags: Flags = Flags(), name: str | None = None):
    """Render (once), cache on disk (once) and import the kernel; returns the ``@triton.jit`` function
    (``variant.kernel_function``, or ``name`` for templates that hold several kernels) in its
    :class:`~cce_autotune.launch.Launcher` (launched the same way: ``kernel[grid](...)``)."""
    def make() -> ModuleType:
        check_interpret_mode()  # (on a render only: a kernel already loaded runs in the mode it was made for)
        return _import_source(f"cce_{variant.kernel}_{source_key(variant, flags)}", render_source(variant, flags))

    return _launcher(_cached_module((variant, flags), make), name or variant.kernel_function)


def _launcher(mod: ModuleType, name: str) -> Launcher:
    """The :class:`~cce_autotune.launch.Launcher` of the module's kernel ``name`` (one per kernel and
    process: it keeps the kernel's compiled specializations)."""
    launchers = _launchers.get(mod.__name__)
    if launchers is None:
        launchers = _launchers.setdefault(mod.__name__, {})
    found = launchers.get(name)
    if found is None:
        found = launchers.setdefault(name, Launcher(getattr(mod, name), interpreted=_INTERPRET_AT_IMPORT))
    return found


def _cached_module(key, make) -> ModuleType:
    """The module imported for ``key``, made by ``make()`` once per process (under the lock)."""
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = _modules[key] = make()
    return mod


def render_utility(template: str, **switches: bool) -> str:
    """The source of a knob-free helper kernel (``templates/<template>``) with its ``{% if %}``
    switches (upper-case names)."""
    ctx = {**Flags().template_flags(), **switches, "TEMPLATE": template, "KNOB_SUMMARY": "none",
           "FLAG_SUMMARY": ", ".join(f"{k}={v}" for k, v in sorted(switches.items()))}
    return _env().get_template(template).render(**ctx)


def load_utility(template: str, function: str, **switches: bool):
    """Render (once), cache and import a knob-free helper kernel; returns ``function`` from it (in its
    :class:`~cce_autotune.launch.Launcher`)."""
    def make() -> ModuleType:
        check_interpret_mode()  # (on a render only, as load_kernel)
        source = render_utility(template, **switches)
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        return _import_source(f"cce_{template.split('.')[0]}_{digest}", source)

    return _launcher(_cached_module((template, tuple(sorted(switches.items()))), make), function)


_unwritable: set = set()  # kernel folders already warned about


def _cache_file(name: str, source: str) -> Path | None:
    """``<cache>/kernels/<name>.py`` holding exactly ``source`` (written when missing or different), or
    None when the cache cannot be written (one warning per folder and process)."""
    folder = cache_dir(create=False) / "kernels"
    path = folder / f"{name}.py"
    try:
        if path.read_text(encoding="utf-8") == source:
            return path
    except (OSError, UnicodeDecodeError):
        pass  # missing, unreadable or not text: written below
    try:
        _write_atomic(path, source)
    except OSError as exc:
        if str(folder) not in _unwritable:  # (callers hold _lock: see _cached_module)
            _unwritable.add(str(folder))
            warnings.warn(f"cce_autotune: cannot write the kernel cache {folder} ({exc.strerror or exc}); the "
                          "kernels are compiled from memory (set CCE_AUTOTUNE_CACHE_DIR to a writable folder)",
                          stacklevel=2)
        return None
    return path


def _import_source(name: str, source: str) -> ModuleType:
    """A fresh module ``name`` executing ``source``: the rendered text itself, never a file or a
    ``.pyc`` (the disk copy is only checked and rewritten for people to read)."""
    path = _cache_file(name, source)
    filename = f"<cce_autotune {path if path is not None else name + '.py'}>"
    # Triton reads a @jit function's source with inspect (at decoration, and the interpreter again at
    # its first call): from this entry. mtime None: linecache.checkcache keeps it; the name is not a
    # file, so nothing ever reads it from the disk.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    code = compile(source, filename, "exec")
    module = ModuleType(name)
    sys.modules[name] = module  # (functions name it in __module__: pickling and inspect find it)
    try:
        exec(code, module.__dict__)  # noqa: S102 - the rendered template, as checked above
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module

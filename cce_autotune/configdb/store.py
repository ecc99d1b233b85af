"""The tuned-config database: ``tuned_configs/<gpu-slug>.yaml`` files and the GPU alias table.

One file per GPU slug::

    schema_version: 1
    gpu: h200
    entries:
    - key: {kernel: backward, dtype: bf16, B: 8192, V: 256000, D: 2304, has_bias: false, has_softcap: true}
      variant: {kernel: backward, num_warps: 8, num_stages: 3, block_b: 128, ...}   # variant.to_dict()
      timing_ms: {median: 20.1, p20: 20.0, p80: 20.3}
      default_ms: {median: 25.4, p20: 25.3, p80: 25.6}   # the built-in default, same run (null: it failed)
      speedup: 1.264                                      # default median / tuned median (informative)
      trials: 120
      device_name: NVIDIA H200
      versions: {torch: 2.13.0, triton: 3.9.0, cce_autotune: 0.1.0}
      template_hash: 1f0c...                              # codegen.template_hash(kernel) it was tuned on
      tuned_on: '2026-12-01T10:31:05+00:00'

An optional top-level ``cost_model:`` mapping holds the planner's cost coefficients for the GPU
(numbers by name, see :class:`cce_autotune.planning.costs.CostModel`, plus ``measured_on`` / ``note``
strings); saving entries keeps it.

Loading validates everything (a bad file raises :class:`ConfigDBError` naming the file and the
problem): YAML anchors and aliases are refused (a few hundred bytes of nested aliases expand to
gigabytes), messages show at most about 200 characters of a value, the ``cost_model`` section must
name known coefficients with positive values (:func:`cce_autotune.planning.costs.check_section`;
``strict_cost_model=False``, the runtime's way, ignores a bad section with a warning instead). An entry
whose knobs are valid but beyond what the runtime may trust (a ``filter_eps`` coarser than
:data:`MAX_FILTER_EPS`) is skipped with a warning naming the file and the entry, and the others load.
Saving is atomic (temp file + ``os.replace``) and locked (``fcntl.flock`` on a sidecar
``.lock`` file): the file is re-read under the lock and merged, so concurrent writers lose nothing, and
a new result replaces a stored entry of the same key by :func:`merge_entries`' rule (tuned on the
current template first, then on data closer to a user's, then the faster).

This module knows YAML but not Optuna; it imports neither torch nor the tuner.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import reprlib
import stat
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml

from ..codegen import template_hash
from ..planning import costs as cost_models
from ..variant import KERNELS, VariantError, _Variant, variant_from_dict

try:  # POSIX; elsewhere saves are atomic but not locked
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

__all__ = [
    "SCHEMA_VERSION",
    "DTYPES",
    "MAX_FILTER_EPS",
    "ConfigDBError",
    "EntryKey",
    "Entry",
    "ConfigFile",
    "MergeReport",
    "load_file",
    "parse_config",
    "merge_entries",
    "save_entries",
    "FilesMerge",
    "merge_files",
    "AliasTable",
    "load_aliases",
    "slugify",
]

SCHEMA_VERSION = 1
DTYPES = ("bf16", "fp16", "fp32")
# The coarsest filter a tuned entry may carry. The accuracy check walks at most the ladder's last factor
# (planning/filters.py: LADDER[-1] = 2^-8) below a call's filter, so from 2^-8 its lowest candidate is
# the built-in 2^-16; it is also the coarsest value cce-tune's search space tries
# (search_spaces/backward.yaml). A coarser entry (a hand edit, another tool) is skipped at load.
MAX_FILTER_EPS = 2.0**-8
_HEADER = (
    "# Tuned Cut Cross-Entropy kernel variants for one GPU, written by `cce-tune`.\n"
    "# Format: see cce_autotune/configdb/store.py (schema_version 1). Edit with care; `cce-tune show` explains lookups.\n"
)


class ConfigDBError(ValueError):
    """A config or alias file cannot be used; ``path`` is the file, ``problem`` what is wrong."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = _clip(problem, 1000)
        super().__init__(f"{self.path}: {self.problem}")


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = 16
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 120


def _short(value: Any, limit: int = 200) -> str:
    """``repr(value)`` in at most about ``limit`` characters, without building the whole repr (a value
    of a file can be large): what validation messages show of a value."""
    return _clip(_REPR.repr(value), limit)


def _clip(text: str, limit: int = 300) -> str:
    """``text`` cut in the middle to about ``limit`` characters (a message's head and tail stay: what the
    value is and what it must be)."""
    if len(text) <= limit:
        return text
    tail = limit // 3
    return f"{text[:limit - tail]} ...({len(text) - limit} characters)... {text[-tail:]}"


class _OutOfBounds(ValueError):
    """An entry that is valid but beyond what the runtime may trust: skipped, not fatal."""


# -- entries -----------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class EntryKey:
    """What a tuned entry is for: kernel, dtype, shape (B is a power-of-two bucket) and feature flags."""

    kernel: str
    dtype: str
    B: int
    V: int
    D: int
    has_bias: bool = False
    has_softcap: bool = False

    def to_dict(self) -> dict:
        return {
            "kernel": self.kernel, "dtype": self.dtype, "B": self.B, "V": self.V, "D": self.D,
            "has_bias": self.has_bias, "has_softcap": self.has_softcap,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "key") -> "EntryKey":
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
        names = ("kernel", "dtype", "B", "V", "D", "has_bias", "has_softcap")
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ValueError(f"{where}: " + "; ".join(
                ([f"missing {missing}"] if missing else []) + ([f"unknown {_short(unknown)}"] if unknown else [])
            ))
        if data["kernel"] not in KERNELS:
            raise ValueError(f"{where}.kernel: {_short(data['kernel'])} is not one of {sorted(KERNELS)}")
        if data["dtype"] not in DTYPES:
            raise ValueError(f"{where}.dtype: {_short(data['dtype'])} is not one of {list(DTYPES)}")
        for n in ("B", "V", "D"):
            v = data[n]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{where}.{n}: expected a positive integer, got {_short(v)}")
        for n in ("has_bias", "has_softcap"):
            if not isinstance(data[n], bool):
                raise ValueError(f"{where}.{n}: expected true or false, got {_short(data[n])}")
        return cls(**{n: data[n] for n in names})

    def describe(self) -> str:
        flags = [f for f in ("has_bias", "has_softcap") if getattr(self, f)]
        return (f"{self.kernel} {self.dtype} B={self.B} V={self.V} D={self.D}"
                + (f" [{', '.join(flags)}]" if flags else ""))


def _timing(data: Any, where: str) -> dict:
    if not isinstance(data, Mapping) or set(data) != {"median", "p20", "p80"}:
        raise ValueError(f"{where}: expected {{median, p20, p80}} in milliseconds, got {_short(data)}")
    out = {}
    for k in ("median", "p20", "p80"):
        v = data[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{where}.{k}: expected a positive number of milliseconds, got {_short(v)}")
        out[k] = float(v)
    return out


@dataclass(frozen=True)
class Entry:
    """One tuned result: the winning variant for a key, with its measurements and provenance."""

    key: EntryKey
    variant: _Variant
    timing_ms: dict  # {median, p20, p80}
    default_ms: dict | None  # the built-in default's {median, p20, p80} in the same run (None: it failed)
    template_hash: str
    tuned_on: str  # ISO 8601
    versions: dict = field(default_factory=dict)  # {torch, triton, cce_autotune}
    device_name: str = ""
    trials: int = 0
    data: dict | None = None  # what it was tuned on: {kind: lm | real} or {kind: file, name, sha256}

    @property
    def median_ms(self) -> float:
        return self.timing_ms["median"]

    @property
    def speedup(self) -> float | None:
        """Built-in default's median / this entry's median (None when the default could not run)."""
        if not self.default_ms:
            return None
        return self.default_ms["median"] / self.timing_ms["median"]

    def to_dict(self) -> dict:
        return {
            "key": self.key.to_dict(),
            "variant": self.variant.to_dict(),
            "timing_ms": dict(self.timing_ms),
            "default_ms": dict(self.default_ms) if self.default_ms else None,
            "speedup": round(self.speedup, 4) if self.default_ms else None,
            "trials": self.trials,
            "device_name": self.device_name,
            "versions": {str(k): str(v) for k, v in self.versions.items()},
            "template_hash": self.template_hash,
            "tuned_on": self.tuned_on,
            **({"data": dict(self.data)} if self.data else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "entry") -> "Entry":
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
        required = ("key", "variant", "timing_ms", "default_ms", "template_hash", "tuned_on")
        optional = ("speedup", "trials", "device_name", "versions", "data")
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"{where}: missing {missing}")
        unknown = sorted(map(str, set(data) - set(required) - set(optional)))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {_short(unknown)}")
        key = EntryKey.from_dict(data["key"], f"{where}.key")
        vdata = data["variant"]
        if not isinstance(vdata, Mapping):
            raise ValueError(f"{where}.variant: expected a mapping of knobs")
        if vdata.get("kernel", key.kernel) != key.kernel:
            raise ValueError(f"{where}.variant: kernel {_short(vdata.get('kernel'))} differs from key kernel "
                             f"{key.kernel!r}")
        try:
            variant = variant_from_dict({"kernel": key.kernel, **vdata})
            variant.validate(elem_bytes=4 if key.dtype == "fp32" else 2, smem_limit=None)
        except (VariantError, TypeError) as exc:
            raise ValueError(f"{where}.variant: {_clip(str(exc))}") from None
        for n in ("template_hash", "tuned_on"):
            if not isinstance(data[n], str) or not data[n]:
                raise ValueError(f"{where}.{n}: expected a non-empty string, got {_short(data[n])}")
        versions = data.get("versions", {}) or {}
        if not isinstance(versions, Mapping) or not all(isinstance(v, str) for v in versions.values()):
            raise ValueError(f"{where}.versions: expected a mapping of package -> version string")
        trials = data.get("trials", 0)
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 0:
            raise ValueError(f"{where}.trials: expected a non-negative integer, got {_short(trials)}")
        device_name = data.get("device_name", "") or ""
        if not isinstance(device_name, str):
            raise ValueError(f"{where}.device_name: expected a string")
        record = data.get("data")
        if record is not None and not (isinstance(record, Mapping) and isinstance(record.get("kind"), str)
                                       and all(isinstance(v, (str, int, float)) for v in record.values())):
            raise ValueError(f"{where}.data: expected a mapping with a 'kind' (lm, real or file) and plain values")
        entry = cls(
            key=key, variant=variant,
            timing_ms=_timing(data["timing_ms"], f"{where}.timing_ms"),
            default_ms=_timing(data["default_ms"], f"{where}.default_ms") if data["default_ms"] is not None else None,
            template_hash=data["template_hash"], tuned_on=data["tuned_on"], versions=dict(versions),
            device_name=device_name, trials=trials, data=dict(record) if record is not None else None,
        )
        entry.check_bounds(where)
        return entry

    def check_bounds(self, where: str = "entry") -> None:
        """Raise (a ValueError) when the entry's knobs are valid but beyond what the runtime may trust
        from a file: a backward ``filter_eps`` coarser than :data:`MAX_FILTER_EPS`. (The other knobs are
        bounded by the variants' own validation: block sizes, warps and lock pools powers of two in
        fixed ranges, stages 1-8, splits 1-4096, and the device's shared memory at lookup.)"""
        eps = getattr(self.variant, "filter_eps", None)
        if eps is not None and float(eps) > MAX_FILTER_EPS:
            raise _OutOfBounds(f"{where} ({self.key.describe()}): filter_eps={eps:g} is coarser than "
                               f"{MAX_FILTER_EPS:g} (2^-8), the coarsest filter a tuned entry may carry (the "
                               "accuracy check cannot lower it far enough)")


@dataclass
class ConfigFile:
    path: Path
    gpu: str
    entries: list  # of Entry, at most one per key
    cost_model: dict | None = None  # the planner's coefficients for this GPU (name -> number, provenance)
    skipped: list = field(default_factory=list)  # what loading left out, one message each (also warned)

    def by_key(self) -> dict:
        return {e.key: e for e in self.entries}


class _AliasRefused(yaml.YAMLError):
    """A YAML anchor or alias: refused (see _StrictLoader)."""


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a mapping with a repeated key (plain YAML keeps the last one
    silently: a hand-merged file could lose an entry's knob without a word) and any anchor or alias
    (``&a`` / ``*a``: a few hundred bytes of nested aliases expand to gigabytes; cce-tune never writes
    them). The refusal comes at the first anchor, before anything is expanded."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            mark = event.start_mark
            raise _AliasRefused(f"YAML anchors and aliases are not allowed (the {kind}{_clip(str(event.anchor), 60)} "
                                f"at line {mark.line + 1}, column {mark.column + 1}): write the values out")
        return super().compose_node(parent, index)


def _unique_mapping(loader, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            repeated = key in seen
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if repeated:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {_short(key)}", key_node.start_mark)
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


class _NoAliasDumper(yaml.SafeDumper):
    """safe_dump that writes every value out (an object met twice is never an anchor and an alias):
    what it writes, _StrictLoader reads."""

    def ignore_aliases(self, data) -> bool:
        return True


def _parse_yaml(text: str, path: str | Path):
    try:
        return _load_yaml(text)
    except _AliasRefused as exc:
        raise ConfigDBError(path, str(exc)) from None
    except yaml.YAMLError as exc:
        raise ConfigDBError(path, f"not valid YAML: {exc}") from None


def _skip(path, skipped: list, message: str) -> None:
    skipped.append(message)
    warnings.warn(f"cce_autotune: {path}: {message}", stacklevel=4)


def parse_config(text: str, path: str | Path, expect_gpu: str | None = None, *,
                 strict_cost_model: bool = True) -> ConfigFile:
    """Parse and validate the text of a config file; errors name ``path``. An entry beyond the bounds
    of :meth:`Entry.check_bounds` is skipped with a warning (the others load). ``strict_cost_model``:
    a bad ``cost_model`` section is an error; False (the runtime): it is left out with a warning."""
    data = _parse_yaml(text, path)
    if not isinstance(data, dict):
        raise ConfigDBError(path, "expected a mapping with schema_version, gpu and entries at the top")
    if "schema_version" not in data:
        raise ConfigDBError(path, f"missing schema_version (expected {SCHEMA_VERSION})")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ConfigDBError(
            path, f"schema_version {_short(data['schema_version'])} is not supported (this version reads {SCHEMA_VERSION})"
        )
    unknown = sorted(map(str, set(data) - {"schema_version", "gpu", "entries", "cost_model", "entry_count"}))
    if unknown:
        raise ConfigDBError(path, f"unknown top-level key(s) {_short(unknown)}")
    gpu = data.get("gpu")
    if not isinstance(gpu, str) or not gpu:
        raise ConfigDBError(path, "gpu: expected the GPU slug as a non-empty string")
    if expect_gpu is not None and gpu != expect_gpu:
        raise ConfigDBError(path, f"gpu: file is for {_short(gpu)} but is named for {expect_gpu!r}")
    raw = data.get("entries") or []
    if not isinstance(raw, list):
        raise ConfigDBError(path, "entries: expected a list")
    count = data.get("entry_count")
    if count is not None and count != len(raw):
        # Written above the entries by every save: a file cut short (a failed copy) keeps it.
        raise ConfigDBError(path, f"entry_count is {_short(count)} but the file holds {len(raw)} entries: "
                                  "the file was cut short or edited; restore it or fix entry_count")
    entries: dict[EntryKey, Entry] = {}
    skipped: list = []
    for i, item in enumerate(raw):
        try:
            entry = Entry.from_dict(item, f"entries[{i}]")
        except _OutOfBounds as exc:
            _skip(path, skipped, f"skipping {exc}")
            continue
        except ValueError as exc:
            raise ConfigDBError(path, str(exc)) from None
        if entry.key in entries:
            raise ConfigDBError(path, f"entries[{i}]: key {entry.key.describe()} appears twice")
        entries[entry.key] = entry
    try:
        cost_model = _cost_model(data.get("cost_model"))
    except ValueError as exc:
        if strict_cost_model:
            raise ConfigDBError(path, str(exc)) from None
        cost_model = None
        _skip(path, skipped, f"ignoring its cost_model section: {exc}")
    return ConfigFile(path=Path(path), gpu=gpu, entries=list(entries.values()), cost_model=cost_model,
                      skipped=skipped)


def _cost_model(data: Any) -> dict | None:
    """The ``cost_model`` section: known coefficient names -> positive finite numbers (positive integers
    for the counts), and the provenance strings (see :func:`cce_autotune.planning.costs.check_section`)."""
    if data is None:
        return None
    return cost_models.check_section(data, _short)


def load_file(path: str | Path, expect_gpu: str | None = None, *, strict_cost_model: bool = True) -> ConfigFile:
    """Read and validate one ``<slug>.yaml`` (``expect_gpu``: the slug its name promises;
    ``strict_cost_model``: see :func:`parse_config`)."""
    return parse_config(_read_text(Path(path)), Path(path), expect_gpu, strict_cost_model=strict_cost_model)


def _read_text(path: Path) -> str:
    """The file's UTF-8 text; :class:`ConfigDBError` naming the file when it cannot be read or is not
    UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigDBError(path, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigDBError(path, f"not UTF-8 text (byte {exc.start}: {exc.reason})") from None


# -- saving ------------------------------------------------------------------------------------
@dataclass
class MergeReport:
    added: list = field(default_factory=list)  # keys
    replaced: list = field(default_factory=list)  # keys whose entry was slower than the new one
    kept: list = field(default_factory=list)  # keys where the stored entry is at least as fast

    def __str__(self) -> str:
        return (f"{len(self.added)} added, {len(self.replaced)} replaced (faster, or tuned on the current template), "
                f"{len(self.kept)} kept (stored one as fast or faster)")


def merge_entries(existing: Iterable[Entry], new: Iterable[Entry]) -> tuple[list, MergeReport]:
    """Entries after adding ``new``: an entry tuned on the kernel's current template replaces one
    tuned on an older template (whatever their timings: the old one measured other code); then an
    entry tuned on data closer to a user's (captured activations, then real hidden states, then
    LM-like; see :func:`data_rank`) replaces one tuned on synthetic data (their timings measured
    other data); between two of the same standing a new entry replaces a stored one only if it is
    faster."""
    out = {e.key: e for e in existing}
    report = MergeReport()
    for e in new:
        old = out.get(e.key)
        if old is None:
            out[e.key] = e
            report.added.append(e.key)
            continue
        new_current, old_current = _is_current(e), _is_current(old)
        if new_current != old_current:
            better = new_current
        elif data_rank(e) != data_rank(old):
            better = data_rank(e) > data_rank(old)
        else:
            better = e.median_ms < old.median_ms
        if better:
            out[e.key] = e
            report.replaced.append(e.key)
        else:
            report.kept.append(e.key)
    return [out[k] for k in sorted(out)], report


def data_rank(entry: Entry) -> int:
    """How close an entry's tuning data is to a user's: 2 captured activations (``--data FILE``),
    1 real hidden states, 0 LM-like or unrecorded."""
    kind = (entry.data or {}).get("kind")
    return {"file": 2, "real": 1}.get(kind, 0)


def _is_current(entry: Entry) -> bool:
    """The entry was tuned on its kernel's template as it is now."""
    return entry.template_hash == template_hash(entry.key.kernel)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` (beside the file, so that every writer of a shared folder meets it) and
    remove it on release: a writer that opened the lock file before it was removed finds, once it
    holds the lock, that the path now names another file (or none) and opens it afresh."""
    lock_path = path.with_name(path.name + ".lock")
    while True:
        f = open(lock_path, "a+")
        if fcntl is None:
            break
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(lock_path).st_ino:
                break  # the lock file on disk is the one held
        except FileNotFoundError:
            pass
        f.close()
    try:
        yield
    finally:
        if fcntl is not None:
            try:
                os.unlink(lock_path)  # (while held: the next writer re-checks the path)
            except FileNotFoundError:
                pass
        f.close()


def _dump(gpu: str, entries: list, cost_model: dict | None = None) -> str:
    body = {"schema_version": SCHEMA_VERSION, "gpu": gpu}
    if cost_model:
        body["cost_model"] = dict(cost_model)
    body["entry_count"] = len(entries)  # (lets a reader notice a file cut short at an entry boundary)
    body["entries"] = [e.to_dict() for e in entries]
    return _HEADER + yaml.dump(body, Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=None, width=120)


_umask_lock = threading.Lock()


def _file_mode(path: Path) -> int:
    """The mode a rewritten file keeps: the existing file's, else what the umask gives a new file
    (``mkstemp`` would leave 0600: other users sharing a config folder could no longer read it)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        with _umask_lock:
            mask = os.umask(0)
            os.umask(mask)
        return 0o666 & ~mask


def _write_atomic(path: Path, text: str) -> None:
    mode = _file_mode(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


_KEEP = object()


def save_entries(path: str | Path, entries: Iterable[Entry], gpu: str | None = None,
                 cost_model: Any = _KEEP) -> MergeReport:
    """Merge ``entries`` into the file at ``path`` (created if absent) under an exclusive lock.

    ``gpu`` defaults to the file name's stem. A stored file that does not load is never overwritten:
    :class:`ConfigDBError` names it. The stored ``cost_model`` is kept unless ``cost_model`` is given
    (a mapping, or None for none).
    """
    path = Path(path)
    gpu = gpu or path.stem
    if cost_model is not _KEEP and cost_model is not None:
        try:  # (never write a section that loading would refuse)
            cost_model = _cost_model(cost_model)
        except ValueError as exc:
            raise ConfigDBError(path, f"not written: {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        stored = load_file(path, expect_gpu=gpu) if path.exists() else None
        merged, report = merge_entries(stored.entries if stored else [], entries)
        if cost_model is _KEEP:
            cost_model = stored.cost_model if stored else None
        _write_atomic(path, _dump(gpu, merged, cost_model))
    return report


@dataclass
class FilesMerge:
    """What :func:`merge_files` did: the result and where each part of it came from."""

    gpu: str
    out: Path
    inputs: list  # paths, in merge order (``out`` among them when it existed)
    entries: list  # the merged entries
    sources: dict  # key -> the path its entry in the result came from
    totals: dict  # path -> entries that file holds
    conflicts: list  # (key, [(path, entry), ...] in merge order, winner path, reason)
    cost_model: dict | None = None
    cost_model_from: Path | None = None
    cost_model_differs: list = field(default_factory=list)  # paths whose cost_model was not taken

    def describe(self) -> str:
        names = {p: str(p) + (" (the existing output)" if p == self.out else "") for p in self.inputs}
        lines = [f"merging {len(self.inputs)} file(s) for GPU {self.gpu!r} into {self.out}:"]
        for p in self.inputs:
            kept = sum(1 for src in self.sources.values() if src == p)
            lines.append(f"  {names[p]}: {self.totals[p]} entries, {kept} in the result")
        if self.conflicts:
            lines.append(f"{len(self.conflicts)} key(s) in several files (current template wins, then real data over LM-like, then the faster):")
        for key, contenders, winner, reason in self.conflicts:
            each = ", ".join(f"{p} {e.median_ms:.4g} ms ({'current' if _is_current(e) else 'stale'} template)"
                             for p, e in contenders)
            lines.append(f"  {key.describe()}: {each} -> {winner} ({reason})")
        if self.cost_model_differs:
            lines.append(f"cost_model: the files disagree; taking {self.cost_model_from}'s (the last file with one) "
                         f"over that of {', '.join(map(str, self.cost_model_differs))}")
        elif self.cost_model_from is not None:
            lines.append(f"cost_model: from {self.cost_model_from}")
        return "\n".join(lines)


def merge_files(paths: Iterable[str | Path], out: str | Path) -> FilesMerge:
    """Merge tuned-config files of one GPU into ``out`` with :func:`merge_entries`' rule (an existing
    ``out`` is an input too, merged first unless listed) and write it atomically. ``cost_model``: the
    last input (in order) that has one. Raises :class:`ConfigDBError` naming the file that does not load
    or is for another GPU than the first (nothing is written then)."""
    out = Path(out)
    inputs: list = []
    for p in ([out] if out.exists() else []) + [Path(p) for p in paths]:
        if not any(p.resolve() == q.resolve() for q in inputs):
            inputs.append(p)
        elif p.resolve() == out.resolve() and out in inputs:  # out listed: merge it at its place in the list
            inputs.remove(out)
            inputs.append(p)
    files = [load_file(p) for p in inputs]
    first = files[0]
    for f in files[1:]:
        if f.gpu != first.gpu:
            raise ConfigDBError(f.path, f"GPU {_short(f.gpu)}, but {first.path} is for {_short(first.gpu)}: "
                                        "merge files of one GPU only")
    merged: list = []
    sources: dict = {}
    seen: dict = {}  # key -> [(path, entry)] of distinct entries
    for f in files:
        merged, report = merge_entries(merged, f.entries)
        for key in report.added + report.replaced:
            sources[key] = f.path
        for e in f.entries:
            contenders = seen.setdefault(e.key, [])
            if all(e != other for _, other in contenders):
                contenders.append((f.path, e))
    by_key = {e.key: e for e in merged}
    conflicts = []
    for key, contenders in seen.items():
        if len(contenders) < 2:
            continue
        win = by_key[key]
        losers = [e for _, e in contenders if e is not win]
        if _is_current(win) and any(not _is_current(e) for e in losers):
            reason = "tuned on the current template"
        elif any(data_rank(e) < data_rank(win) for e in losers):
            reason = f"tuned on {win.data['kind']} data"
        elif any(e.median_ms <= win.median_ms for e in losers):
            reason = "as fast; the one merged first stays"
        else:
            reason = "faster"
        conflicts.append((key, contenders, sources[key], reason))
    conflicts.sort(key=lambda c: c[0])
    models = [(f.path, f.cost_model) for f in files if f.cost_model]
    model_from, cost_model = models[-1] if models else (None, None)
    differs = [p for p, m in models if m != cost_model]
    save_entries(out, merged, gpu=first.gpu, cost_model=cost_model)
    return FilesMerge(gpu=first.gpu, out=out, inputs=[f.path for f in files], entries=merged, sources=sources,
                      totals={f.path: len(f.entries) for f in files}, conflicts=conflicts,
                      cost_model=cost_model, cost_model_from=model_from, cost_model_differs=differs)


# -- GPU names -> slugs --------------------------------------------------------------------------
def slugify(name: str) -> str:
    """A file-name-safe slug of a device name: ``"NVIDIA GeForce RTX 4090"`` -> ``"geforce-rtx-4090"``."""
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    s = re.sub(r"^nvidia-", "", s)
    return s or "unknown"


@dataclass
class AliasTable:
    """Device name -> GPU slug: exact names first, then case-insensitive substring rules in order."""

    exact: dict = field(default_factory=dict)  # device name -> slug
    contains: list = field(default_factory=list)  # (lower-case substring, slug), first match wins
    shared_memory: dict = field(default_factory=dict)  # slug -> opt-in shared memory per block (bytes)

    @property
    def slugs(self) -> set:
        return set(self.exact.values()) | {s for _, s in self.contains} | set(self.shared_memory)

    def match(self, name: str) -> str | None:
        """The slug an alias rule gives ``name``, or None."""
        if name in self.exact:
            return self.exact[name]
        low = name.lower()
        for sub, slug in self.contains:
            if sub in low:
                return slug
        return None

    def resolve(self, name_or_slug: str) -> str:
        """Slug for a device name or a slug (a known slug maps to itself; unknown names are slugified)."""
        name_or_slug = name_or_slug.strip()
        if name_or_slug in self.slugs:
            return name_or_slug
        return self.match(name_or_slug) or slugify(name_or_slug)

    def extend(self, other: "AliasTable") -> "AliasTable":
        """``other``'s rules after this table's (this one wins on conflicts)."""
        return AliasTable(
            exact={**other.exact, **self.exact},
            contains=list(self.contains) + [r for r in other.contains if r not in self.contains],
            shared_memory={**other.shared_memory, **self.shared_memory},
        )


def _parse_aliases(path: Path) -> AliasTable:
    data = _parse_yaml(_read_text(path), path)
    if not isinstance(data, dict):
        raise ConfigDBError(path, "expected a mapping with schema_version, exact, contains")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ConfigDBError(path, f"schema_version {_short(data.get('schema_version'))} is not supported "
                                  f"(expected {SCHEMA_VERSION})")
    unknown = sorted(map(str, set(data) - {"schema_version", "exact", "contains", "shared_memory"}))
    if unknown:
        raise ConfigDBError(path, f"unknown top-level key(s) {_short(unknown)}")
    exact = data.get("exact") or {}
    if not isinstance(exact, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in exact.items()):
        raise ConfigDBError(path, "exact: expected a mapping of device name -> slug (strings)")
    contains = []
    for i, rule in enumerate(data.get("contains") or []):
        if not isinstance(rule, dict) or set(rule) != {"match", "slug"} or not all(
            isinstance(rule[k], str) and rule[k] for k in ("match", "slug")
        ):
            raise ConfigDBError(path, f"contains[{i}]: expected {{match: substring, slug: slug}}")
        contains.append((rule["match"].lower(), rule["slug"]))
    smem = data.get("shared_memory") or {}
    if not isinstance(smem, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0 for k, v in smem.items()
    ):
        raise ConfigDBError(path, "shared_memory: expected a mapping of slug -> bytes (positive integers)")
    return AliasTable(exact=dict(exact), contains=contains, shared_memory=dict(smem))


def load_aliases(paths: Iterable[str | Path]) -> AliasTable:
    """Merge the alias files that exist among ``paths`` (earlier files take precedence); a file whose
    folder cannot be searched is a :class:`ConfigDBError` naming it, as a file that cannot be read."""
    table = AliasTable()
    for p in paths:
        p = Path(p)
        try:
            exists = p.is_file()
        except OSError as exc:
            raise ConfigDBError(p, f"cannot read: {exc.strerror or exc}") from None
        if exists:
            table = table.extend(_parse_aliases(p))
    return table

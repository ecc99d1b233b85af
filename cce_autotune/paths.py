"""Where the package finds its data (templates, search spaces, shipped configs) and its caches."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["resource_dir", "cache_dir", "save_torch_atomic"]

_PKG = Path(__file__).resolve().parent


def resource_dir(name: str) -> Path:
    """``templates``, ``search_spaces`` or ``tuned_configs``.

    In a source checkout (and an editable install) these are the top-level folders beside the
    package; a built wheel carries them inside the package under ``_data/``.
    """
    for candidate in (_PKG.parent / name, _PKG / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"cce_autotune: data folder {name!r} not found beside or inside the package")


def cache_dir(create: bool = True) -> Path:
    """User cache: rendered kernels, tuning studies, tuned configs written by ``cce-tune``.

    ``CCE_AUTOTUNE_CACHE_DIR`` overrides; otherwise ``$XDG_CACHE_HOME/cce_autotune`` or
    ``~/.cache/cce_autotune``. ``create``: make the folder (for writers; an error, e.g. the path is a
    file or its parent is read-only, is raised). Readers pass ``create=False`` and get the path
    whether or not it exists (the loss, ``cce-tune show`` and ``explain`` never create or need it).
    """
    env = os.environ.get("CCE_AUTOTUNE_CACHE_DIR")
    if env:
        path = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = Path(base) / "cce_autotune"
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def save_torch_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename: readers never see half a file,
    and a failed write leaves any earlier file whole."""
    import torch

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise

"""PyTorch and Triton for the modules whose declarations are read without them.

A strategy module holds its facts and formulas (read by the variant schema, the search space, the
planner and ``cce-tune``'s commands) and its launch code (run by the loss) in one place. Importing
PyTorch takes about two seconds, which commands such as ``cce-tune --dry-run``, ``show`` and
``explain`` do without: so those modules (:mod:`cce_autotune.strategies`, :mod:`cce_autotune.tile_map`
and the planner's :mod:`~cce_autotune.planning.planner` and :mod:`~cce_autotune.planning.accuracy`)
name ``torch`` and ``triton`` through :data:`torch` and :data:`triton` below.

Each stands for its module until an attribute is first asked for; then it imports the module and
binds the module itself, in place of the stand-in, under the same name in every module of this
package that holds the stand-in (and here), so that the launch paths, which name ``torch`` hundreds of
times a call, pay nothing for the indirection afterwards.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["torch", "triton"]


class _Module:
    """Stands for the module ``name`` until it is first used (see the module docstring)."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name

    def __getattr__(self, attr: str):
        name = self.__dict__["_name"]
        module = importlib.import_module(name)
        for mod in list(sys.modules.values()):
            namespace = getattr(mod, "__dict__", None)
            if (namespace is not None and getattr(mod, "__name__", "").startswith(__package__ + ".")
                    and namespace.get(name) is self):
                namespace[name] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self.__dict__['_name']!r}, imported on first use>"


torch = _Module("torch")
triton = _Module("triton")

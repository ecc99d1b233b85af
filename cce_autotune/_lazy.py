"""PyTorch and Triton for the modules whose declarations are read without them.

A strategy module holds its facts and formulas (read by the variant schema, the search space, the
planner and ``cce-tune``'s commands) and its launch code (run by the loss) in one place. Importing
PyTorch takes about two seconds, which commands such as ``cce-tune --dry-run``, ``show`` and ``merge``
do without: so those modules (:mod:`cce_autotune.strategies`, :mod:`cce_autotune.tile_map` and the
planner's :mod:`~cce_autotune.planning.planner` and :mod:`~cce_autotune.planning.accuracy`, which
``cce-tune explain`` reads) name ``torch`` and ``triton`` through :data:`torch` and :data:`triton`
below, which import the real module on first use and then hand its attributes on.
"""

from __future__ import annotations

import importlib

__all__ = ["torch", "triton"]


class _Module:
    """Stands for the module ``name``, imported when an attribute is first asked for."""

    def __init__(self, name: str):
        self.__dict__["_name"] = name
        self.__dict__["_module"] = None

    def __getattr__(self, attr: str):
        module = self.__dict__["_module"]
        if module is None:
            module = self.__dict__["_module"] = importlib.import_module(self.__dict__["_name"])
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self.__dict__['_name']!r}, imported on first use>"


torch = _Module("torch")
triton = _Module("triton")

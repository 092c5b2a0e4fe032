"""Old import paths that keep working for one release, with a ``DeprecationWarning``.

A module that moved leaves a two-line shim at its old path::

    from labrl._deprecated import moved_module

    __getattr__ = moved_module(__name__, "labrl.lab_adapters.mock.server")

Importing the shim warns once (naming the new path); every attribute is then
looked up on the new module(s), in the order given.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved_module(old: str, *new: str) -> Callable[[str], Any]:
    """Warn that ``old`` moved to ``new`` and return the ``__getattr__`` that forwards to it."""
    warnings.warn(
        f"{old} moved to {' and '.join(new)}; the old import path will be removed in the next release",
        DeprecationWarning,
        stacklevel=3,
    )
    modules = [importlib.import_module(name) for name in new]

    def forward(name: str) -> Any:
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return forward

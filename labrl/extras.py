"""Import an optional extra's package, or fail with one line saying what to install.

The protocol packages (OpenEnv, the Open Reward Standard, MADSci) are extras of
``labrl`` (``pip install 'labrl[openenv]'``): the core never needs them, and
their pins conflict with each other, so only the modules at the edge that speak
a protocol import them, through ``import_extra``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from labrl.errors import MissingExtraError


def import_extra(module: str, extra: str) -> ModuleType:
    """``importlib.import_module(module)``, or ``MissingExtraError`` naming ``labrl[extra]``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        raise MissingExtraError(
            f"{module!r} is not installed (missing {missing!r}): pip install 'labrl[{extra}]'"
        ) from None

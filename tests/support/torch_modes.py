"""What the tests' ``TorchFunctionMode``s read off an intercepted call.

``op_name``: the call's name (``"to"``, ``"item"``, ...); torch hands a mode bound methods,
builtins and Python functions alike, and some carry no ``__name__``. ``to_host``: whether a
``Tensor.to`` call targets the host (its device as the second positional argument or ``device=``).
"""

from __future__ import annotations

from typing import Any

import torch


def op_name(func: Any) -> str:
    return getattr(func, "__name__", "")  # torch's callables are not ours to give a protocol


def to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, str | torch.device) and torch.device(target).type == "cpu"

"""What the tests' ``TorchFunctionMode``s read off an intercepted call.

``op_name``: the call's name (``"to"``, ``"item"``, ...); torch hands a mode bound methods,
builtins and Python functions alike, and some carry no ``__name__``. ``to_device``: the device a
``Tensor.to`` call names (its second positional argument or ``device=``), None for a dtype cast;
``to_host``: whether that device is the host.
"""

from __future__ import annotations

from typing import Any

import torch


def op_name(func: Any) -> str:
    return getattr(func, "__name__", "")  # torch's callables are not ours to give a protocol


def to_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a ``Tensor.to`` call names (second positional argument or ``device=``); None for a
    dtype cast, which copies nothing between host and device."""
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return torch.device(target) if isinstance(target, str | torch.device) else None


def to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = to_device(args, kwargs)
    return target is not None and target.type == "cpu"

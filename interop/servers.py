"""Protocol name -> the factory of its ASGI app: what ``labrl envs serve --protocol`` offers.

A protocol is added by one line in ``SERVERS`` (a lazy ``"module:function"``,
so the CLI imports a protocol's package only when that protocol is served).
Every factory takes the same ``ServeSettings`` and returns an ASGI app.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labrl.errors import ConfigError

SERVERS: dict[str, str] = {
    "openenv": "labrl.interop.openenv_server:create_app",
    "ors": "labrl.interop.ors_server:create_app",
}


@dataclass(frozen=True)
class ServeSettings:
    env_id: str
    #: keyword options of ``labrl.envs.make`` (``-o KEY=VALUE``), budgets included
    options: dict[str, Any] = field(default_factory=dict)
    #: sessions (one labrl env each) held at once; one more is refused with the protocol's capacity error
    max_sessions: int = 1024
    #: tasks each split lists on the task routes (labrl's splits are seed-indexed and unbounded)
    tasks_per_split: int = 1000


def app_factory(protocol: str) -> Callable[[ServeSettings], Any]:
    if protocol not in SERVERS:
        raise ConfigError(f"unknown protocol {protocol!r}: choose one of {', '.join(sorted(SERVERS))}")
    module_name, _, attr = SERVERS[protocol].partition(":")
    factory: Callable[[ServeSettings], Any] = getattr(importlib.import_module(module_name), attr)
    return factory

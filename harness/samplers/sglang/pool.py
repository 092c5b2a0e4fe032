"""Routing over several SGLang servers (data parallel) and their health.

Two policies:
- ``least_loaded``: the live server with the fewest requests in flight
  (ties: lowest index), which balances long and short generations;
- ``consistent``: rendezvous hashing of a group key (the ``rid`` up to its
  last separator, e.g. ``task-17/3`` -> ``task-17``), so every sample of one
  GRPO group lands on one server and reuses its prefix cache; when a server
  dies only its groups move.

A server is taken out after a failed call whose health check also fails
(``/health_generate``); the sampler retries its requests on the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from labrl.errors import SamplerError

RoutingPolicy = Literal["least_loaded", "consistent"]


@dataclass
class ServerState:
    url: str
    index: int
    alive: bool = True
    in_flight: int = 0
    version: str = ""  # SGLang release, from /server_info
    has_weight_update_session: bool = False  # /begin_weight_update exists (0.5.23+)
    has_routed_experts_start_len: bool = False
    routed_experts_enabled: bool = False
    world_size: int = 1  # GPUs of this server that join a weight-update group
    failures: int = 0
    info: dict = field(default_factory=dict)


def group_key(rid: str, sep: str) -> str:
    head, found, _tail = rid.rpartition(sep)
    return head if found else rid


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


class ServerPool:
    def __init__(self, urls: list[str], policy: RoutingPolicy, group_sep: str = "/") -> None:
        self.servers = [ServerState(url=u.rstrip("/"), index=i) for i, u in enumerate(urls)]
        self.policy = policy
        self.group_sep = group_sep

    @property
    def alive(self) -> list[ServerState]:
        return [s for s in self.servers if s.alive]

    def pick(self, rid: str, exclude: frozenset[str] = frozenset()) -> ServerState:
        candidates = [s for s in self.alive if s.url not in exclude] or self.alive
        if not candidates:
            dead = ", ".join(s.url for s in self.servers)
            raise SamplerError(f"no live SGLang server left (all failed health checks: {dead})")
        if self.policy == "least_loaded":
            return min(candidates, key=lambda s: (s.in_flight, s.index))
        key = group_key(rid, self.group_sep)
        return max(candidates, key=lambda s: _score(key, s.url))

    def mark_dead(self, server: ServerState) -> None:
        server.alive = False

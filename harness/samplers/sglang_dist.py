"""Both ends of SGLang's weight-update process group (``update_weights_from_distributed``).

SGLang's ``/init_weights_update_group`` makes each server GPU join a
process group named ``group_name`` through a TCP rendezvous at
``master_address:master_port`` (ranks ``rank_offset + i``); the trainer is
rank 0 and broadcasts every tensor (in the order of ``names``) while the
servers' ``/update_weights_from_distributed`` calls receive them. The group
is built the way SGLang builds it (torch's rendezvous plus
``_new_process_group_helper``, outside the default group), so the trainer's
end matches the server's on the same torch version; ``WeightReceiver`` is
the server's end, used by the fake server (gloo on CPU).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def init_custom_group(
    *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
) -> Any:
    """A process group of ``world_size`` ranks that is not the default group."""
    timeout = timedelta(seconds=300)
    store, rank, world_size = next(
        dist.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    pg = c10d._new_process_group_helper(
        world_size, rank, [], backend, store, group_name=group_name, timeout=timeout
    )
    group = pg[0] if isinstance(pg, tuple) else pg
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightBroadcaster:
    """The trainer's end (rank 0): ``SGLangSampler(..., broadcaster=WeightBroadcaster())``."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        self.device = (
            torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.group: Any = None

    def init_group(
        self, *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str
    ) -> None:
        self.group = init_custom_group(
            master_address=master_address,
            master_port=master_port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            dist.broadcast(t.detach().to(self.device).contiguous(), src=0, group=self.group)


class WeightReceiver:
    """A server's end (the fake server's; SGLang has its own)."""

    def __init__(self) -> None:
        self.group: Any = None

    def init_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        self.group = init_custom_group(
            master_address=master_address,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )

    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=self.group)
            out[name] = t
        return out

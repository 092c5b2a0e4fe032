"""One rank of the sequence-parallel all-gather test (a spawned process: imports only torch and routing)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labrl.harness.models.routing import all_gather_routes, to_megatron_layout

B, T, L, K, E = 2, 8, 3, 2, 8


def routes(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, E, (B, T, L, K), generator=gen)  # (B, T, L, K)


def rank_main(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    local = to_megatron_layout(routes(), sp_rank=rank, sp_size=world)  # what this rank's routers recorded
    whole = all_gather_routes(local, dist.group.WORLD)
    out.put((rank, [t.tolist() for t in whole]))  # plain lists: no shared-memory handle outlives us
    dist.destroy_process_group()

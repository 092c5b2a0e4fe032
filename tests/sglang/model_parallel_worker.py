"""One rank of the CPU (gloo) model-parallel tests: megatron-core's real parallel_state, no model.

Spawned processes: each initialises torch.distributed over gloo and megatron-core's
``initialize_model_parallel``, then runs the learner's collectives
(``labrl.harness.learners.model_parallel``) on what it holds, and writes its result
to ``out_dir/rank{r}.pt`` for the parent to check.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

B, T, L, K, E = 2, 8, 3, 2, 8  # routing: batch, tokens, MoE layers, top-k, experts


def _init(rank: int, world: int, port: int, tp: int, ep: int) -> None:
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def export_main(rank: int, world: int, port: int, tp: int, ep: int, shards_path: str, out_dir: str) -> None:
    """Hold the shard of (tp rank, ep rank) and export: ``gather_full_state`` over megatron's groups."""
    from megatron.core import parallel_state

    from labrl.harness.learners.model_parallel import gather_full_state, model_parallel_sizes

    _init(rank, world, port, tp, ep)
    data = torch.load(shards_path)
    mine = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank())
    full = gather_full_state(data["shards"][mine], num_experts=data["num_experts"])
    torch.save(
        {"rank": mine, "sizes": model_parallel_sizes(), "state": full}, Path(out_dir) / f"rank{rank}.pt"
    )
    dist.destroy_process_group()


def scores(seed: int = 0) -> list[torch.Tensor]:
    """Router scores per MoE layer in megatron's sequence-major layout ``[T * B, E]`` (whole sequence)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(T * B, E, generator=gen) for _ in range(L)]


def _topk(s: torch.Tensor, k: int, num_groups=None, group_topk=None):
    return torch.topk(s, k, dim=-1)


def routing_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """Record on this rank's sequence slice, gather (as ``MegatronLearner.route``), then replay the
    whole-sequence routes through ``replay_routing`` (as the learner's forward) with this rank's SP slot."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from labrl.harness.learners.model_parallel import sequence_parallel
    from labrl.harness.models import routing

    _init(rank, world, port, tp=world, ep=1)
    sp = sequence_parallel()
    replays = [RouterReplay() for _ in range(L)]
    whole_scores = scores()
    # under sequence parallelism a rank's router sees rows [r*S/tp*B, (r+1)*S/tp*B) of the [S*B, E] scores
    local_scores = [s.chunk(sp.size, dim=0)[sp.rank] for s in whole_scores]
    for r, s in zip(replays, local_scores, strict=True):
        r.set_router_replay_action(RouterReplayAction.RECORD)
        r.get_replay_topk(s, K, default_compute_topk=_topk)  # what TopKRouter calls on its tokens
    gathered = routing.from_megatron_layout(routing.recorded(replays, sp.group), B)  # [B, T, L, K]
    # replay: scores shuffled so that a router's own top-k would differ from the replayed routes
    routing.model_router_replays = lambda model: replays  # the model's routers are these replays
    replayed = []
    with routing.replay_routing(None, gathered, sp_rank=sp.rank, sp_size=sp.size):
        for r, s in zip(replays, local_scores, strict=True):
            _, idx = r.get_replay_topk(-s, K, default_compute_topk=_topk)
            replayed.append(idx)
    torch.save(
        {"sp": (sp.rank, sp.size), "gathered": gathered, "replayed": replayed},
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()

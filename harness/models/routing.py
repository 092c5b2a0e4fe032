"""Drive one model's MoE routers through megatron-core's RouterReplay.

megatron-core keeps RouterReplay instances in a process-wide list and its
static setters act on all of them; ``build_gpt_model`` detaches each model's
instances so that this module can drive one model at a time.

Layouts. megatron-core routes a ``[S, B, H]`` hidden state as ``S * B``
tokens in sequence-major order (token ``s * B + b``), one
``LongTensor[S * B, topk]`` per MoE layer. labrl's records use
``[B, T, L, K]`` (batch, token, MoE layer, top-k); the converters below move
between the two.

Sequence parallelism (TP > 1 with ``sequence_parallel=True``): each
tensor-parallel rank ``r`` routes only its slice of the sequence,
``[r * S/tp, (r+1) * S/tp)``, i.e. rows ``[r * S/tp * B, (r+1) * S/tp * B)``
of the sequence-major ``[S * B, K]`` layout. Routes are gathered across the
ranks (concatenated in rank order) before they are stored, and the stored
whole-sequence routes are scattered the same way before replay, so every
rank replays exactly the tokens it routes::

    gather_sequence_parallel([rank 0: [S/tp*B, K], rank 1: ...]) -> [S*B, K]
    scatter_sequence_parallel([S*B, K], rank, tp)                -> [S/tp*B, K] of that rank
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from labrl.errors import ConfigError


def model_router_replays(model: torch.nn.Module) -> list:
    """The RouterReplay of each MoE layer of ``model``, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    replays = [m.router_replay for m in model.modules() if isinstance(m, TopKRouter)]
    if any(r is None for r in replays):
        raise ConfigError(
            "the model was built with routing_replay=False: rebuild it with routing_replay=True"
        )
    return replays


def to_megatron_layout(
    routed_B_T_L_K: torch.Tensor, *, sp_rank: int = 0, sp_size: int = 1
) -> list[torch.Tensor]:
    """``[B, T, L, K]`` -> per layer ``[T * B, K]`` (sequence-major tokens), or rank ``sp_rank``'s slice."""
    B, T, L, K = routed_B_T_L_K.shape
    per_layer = routed_B_T_L_K.long().permute(2, 1, 0, 3)  # (L, T, B, K)
    whole = [per_layer[layer].reshape(T * B, K) for layer in range(L)]
    if sp_size == 1:
        return whole
    return [scatter_sequence_parallel(t, rank=sp_rank, size=sp_size, batch_size=B) for t in whole]


def scatter_sequence_parallel(routes: torch.Tensor, *, rank: int, size: int, batch_size: int) -> torch.Tensor:
    """Whole-sequence ``[S * B, K]`` -> the ``[S/size * B, K]`` rows sequence-parallel rank ``rank`` routes."""
    rows = routes.shape[0]
    if rows % batch_size or (rows // batch_size) % size:
        raise ConfigError(
            f"sequence length {rows // batch_size if rows % batch_size == 0 else rows / batch_size} is not "
            f"divisible by the sequence-parallel size {size}: pad sequences to a multiple of it"
        )
    if not 0 <= rank < size:
        raise ConfigError(f"sequence-parallel rank {rank} outside [0, {size})")
    return routes.chunk(size, dim=0)[rank]


def gather_sequence_parallel(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """Each sequence-parallel rank's ``[S/size * B, K]`` routes (rank order) -> ``[S * B, K]``."""
    shapes = {tuple(t.shape) for t in per_rank}
    if len(shapes) != 1:
        raise ConfigError(f"sequence-parallel ranks recorded routes of different shapes: {sorted(shapes)}")
    return torch.cat(per_rank, dim=0)


def all_gather_routes(local: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Per MoE layer, this rank's recorded routes -> the whole sequence's, over the TP (SP) ``group``."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    out = []
    for t in local:
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        out.append(gather_sequence_parallel(parts))
    return out


def from_megatron_layout(per_layer: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """Per layer ``[S * B, K]`` -> ``[B, S, L, K]``."""
    stacked = torch.stack([t.reshape(-1, batch_size, t.shape[-1]) for t in per_layer], dim=0)  # (L, S, B, K)
    return stacked.permute(2, 1, 0, 3).contiguous()


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[list]:
    """Routers of ``model`` record their top-k choice on every forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = model_router_replays(model)
    for r in replays:
        r.clear_indices()
        r.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield replays
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()


def recorded(replays: list, sp_group=None) -> list[torch.Tensor]:
    """Recorded routes per MoE layer; with sequence parallelism (``sp_group``), of the whole sequence."""
    local = [r.get_recorded_indices() for r in replays]
    return local if sp_group is None else all_gather_routes(local, sp_group)


@contextmanager
def replay_routing(
    model: torch.nn.Module, routed_B_T_L_K: torch.Tensor, *, sp_rank: int = 0, sp_size: int = 1
) -> Iterator[None]:
    """Routers of ``model`` use the given experts (probabilities from current scores).

    With sequence parallelism, rank ``sp_rank`` of ``sp_size`` replays only the
    rows of its sequence slice (``scatter_sequence_parallel``).

    Covers one forward (``REPLAY_FORWARD``); the backward pass of the local
    spec does not recompute the router, so no ``REPLAY_BACKWARD`` queue is
    consumed (it is cleared on exit).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = model_router_replays(model)
    per_layer = to_megatron_layout(routed_B_T_L_K, sp_rank=sp_rank, sp_size=sp_size)
    if len(per_layer) != len(replays):
        raise ConfigError(
            f"routed experts cover {len(per_layer)} MoE layers but the model has {len(replays)}: "
            "the sampler and learner must run the same model shape"
        )
    for r, indices in zip(replays, per_layer, strict=True):
        r.clear_indices()
        r.set_target_indices(indices)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for r in replays:
            r.clear_router_replay_action()
            r.clear_indices()

"""Drive one model's MoE routers through megatron-core's RouterReplay.

megatron-core keeps RouterReplay instances in a process-wide list and its
static setters act on all of them; ``build_gpt_model`` detaches each model's
instances so that this module can drive one model at a time.

Layouts. megatron-core routes a ``[S, B, H]`` hidden state as ``S * B``
tokens in sequence-major order (token ``s * B + b``), one
``LongTensor[S * B, topk]`` per MoE layer. labrl's records use
``[B, T, L, K]`` (batch, token, MoE layer, top-k); the converters below move
between the two.
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


def to_megatron_layout(routed_B_T_L_K: torch.Tensor) -> list[torch.Tensor]:
    """``[B, T, L, K]`` -> per layer ``[T * B, K]`` (sequence-major tokens)."""
    B, T, L, K = routed_B_T_L_K.shape
    per_layer = routed_B_T_L_K.long().permute(2, 1, 0, 3)  # (L, T, B, K)
    return [per_layer[layer].reshape(T * B, K) for layer in range(L)]


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


def recorded(replays: list) -> list[torch.Tensor]:
    return [r.get_recorded_indices() for r in replays]


@contextmanager
def replay_routing(model: torch.nn.Module, routed_B_T_L_K: torch.Tensor) -> Iterator[None]:
    """Routers of ``model`` use the given experts (probabilities from current scores).

    Covers one forward (``REPLAY_FORWARD``); the backward pass of the local
    spec does not recompute the router, so no ``REPLAY_BACKWARD`` queue is
    consumed (it is cleared on exit).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = model_router_replays(model)
    per_layer = to_megatron_layout(routed_B_T_L_K)
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

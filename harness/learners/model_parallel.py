"""The learner's collectives over megatron-core's tensor-, expert- and sequence-parallel groups.

Two jobs, both no-ops when the sizes are 1 (the CPU path):

- ``gather_full_state``: every rank's local shards of the model's state dict
  -> the TP=1/EP=1 state dict, on every rank, for the weight export. Each
  tensor is all-gathered over the group that shards it (dense weights over the
  tensor-parallel group; expert weights over the expert-tensor-parallel group,
  then the expert-parallel group), and the pure
  ``labrl.harness.models.parallel_gather.gather_model_parallel_shards`` merges
  the pieces. Every rank ends with the full state (an all-gather hands every
  rank every piece anyway, and any rank may be the one that exports), so the
  peak memory of an export is one full copy of the weights per rank.
- ``sequence_parallel``: this rank's place in the sequence-parallel group
  (megatron-core turns sequence parallelism on whenever TP > 1, see
  ``MoEModelConfig.transformer_config``), which router replay uses to gather
  recorded routes and to scatter replayed ones
  (``labrl.harness.models.routing``).

Dense (non-expert) weights are identical across expert-parallel ranks (they
are data-parallel there), so each rank contributes its own copy as EP rank 0's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from labrl.harness.models.parallel_gather import gather_model_parallel_shards, is_expert_weight


@dataclass(frozen=True)
class ModelParallelSizes:
    tp: int = 1
    ep: int = 1
    expert_tp: int = 1


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel ``rank`` of ``size`` and the process ``group`` (None: off)."""

    rank: int = 0
    size: int = 1
    group: Any = None


def model_parallel_sizes() -> ModelParallelSizes:
    """The sizes megatron-core was initialised with (all 1 before ``initialize_model_parallel``)."""
    from megatron.core import parallel_state as ps

    if not (torch.distributed.is_initialized() and ps.model_parallel_is_initialized()):
        return ModelParallelSizes()
    return ModelParallelSizes(
        tp=ps.get_tensor_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        expert_tp=ps.get_expert_tensor_parallel_world_size(),
    )


def sequence_parallel(enabled: bool = True) -> SequenceParallel:
    """This rank's sequence-parallel slot: the tensor-parallel group when TP > 1 and ``enabled``."""
    from megatron.core import parallel_state as ps

    if not enabled or model_parallel_sizes().tp == 1:
        return SequenceParallel()
    return SequenceParallel(
        rank=ps.get_tensor_model_parallel_rank(),
        size=ps.get_tensor_model_parallel_world_size(),
        group=ps.get_tensor_model_parallel_group(),
    )


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    """``tensor`` of every rank of ``group``, in group-rank order (shapes are equal across a group)."""
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor, group=group)
    return parts


def gather_full_state(local: Mapping[str, torch.Tensor], *, num_experts: int) -> dict[str, torch.Tensor]:
    """This rank's state dict -> the TP=1/EP=1 state dict (a collective: every model-parallel rank calls it).

    At TP = EP = 1 it returns ``local``'s entries unchanged.
    """
    from megatron.core import parallel_state as ps

    sizes = model_parallel_sizes()
    if sizes.tp == 1 and sizes.ep == 1:
        return dict(local)
    tp_group = ps.get_tensor_model_parallel_group() if sizes.tp > 1 else None
    ep_group = ps.get_expert_model_parallel_group() if sizes.ep > 1 else None
    etp_group = ps.get_expert_tensor_parallel_group() if sizes.expert_tp > 1 else None
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {
        (t, e): {} for t in range(sizes.tp) for e in range(sizes.ep)
    }
    for name in sorted(local):  # the same order on every rank: each tensor is one collective
        if name.endswith("_extra_state"):
            continue
        tensor = local[name]
        if is_expert_weight(name):
            for t, piece in enumerate(_all_gather(tensor, etp_group, sizes.expert_tp)):
                for e, part in enumerate(_all_gather(piece, ep_group, sizes.ep)):
                    shards[(t, e)][name] = part
        else:
            for t, piece in enumerate(_all_gather(tensor, tp_group, sizes.tp)):
                for e in range(sizes.ep):
                    shards[(t, e)][name] = piece
    return gather_model_parallel_shards(
        shards, tp=sizes.tp, ep=sizes.ep, num_experts=num_experts, expert_tp=sizes.expert_tp
    )

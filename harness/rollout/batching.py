"""Trajectories -> one padded ``TrainBatch`` on the host; ``to_device`` copies it to the model once.

Rows are right-padded to the longest trajectory (``pad_to_multiple`` rounds
T up). Padding: token ``pad_token_id``, attention/loss mask 0, behaviour
log-prob 0, version ``NO_VERSION``, routed experts ``0..K-1``. Group ids are
renumbered 0, 1, ... in order of first appearance.

Only trainable trajectories belong in a batch: one with ``reward=None``
(timeout, env_error, verifier_failed) is refused, never scored 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from labrl.errors import ConfigError
from labrl.harness.types import NO_VERSION, TrainBatch, Trajectory


def collate(trajectories: Sequence[Trajectory], pad_token_id: int, pad_to_multiple: int = 1) -> TrainBatch:
    if not trajectories:
        raise ConfigError("collate needs at least one trajectory")
    if pad_to_multiple < 1:
        raise ConfigError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    untrainable = [t.task_id for t in trajectories if t.reward is None]
    if untrainable:
        raise ConfigError(
            f"{len(untrainable)} trajectories have no reward (outcome not trainable), e.g. task {untrainable[0]!r}: "
            "filter them out before collating"
        )
    with_routing = [t.routed_experts_T_L_K is not None for t in trajectories]
    if any(with_routing) and not all(with_routing):
        raise ConfigError(
            f"{with_routing.count(False)} of {len(trajectories)} trajectories lack routed experts: "
            "router replay needs them on every trajectory of a batch (or on none)"
        )
    B = len(trajectories)
    T = max(len(t.tokens_T) for t in trajectories)
    T = -(-T // pad_to_multiple) * pad_to_multiple
    tokens = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    versions = torch.full((B, T), NO_VERSION, dtype=torch.long)
    routed = None
    if all(with_routing):
        first = trajectories[0].routed_experts_T_L_K
        assert first is not None
        _, L, K = first.shape
        routed = torch.arange(K, dtype=torch.long).expand(B, T, L, K).clone()
    group_index: dict[str, int] = {}
    groups = torch.zeros(B, dtype=torch.long)
    rewards = torch.zeros(B, dtype=torch.float32)
    for b, traj in enumerate(trajectories):
        n = len(traj.tokens_T)
        tokens[b, :n] = torch.tensor(traj.tokens_T, dtype=torch.long)
        attention[b, :n] = True
        loss_mask[b, :n] = torch.tensor(traj.loss_mask_T, dtype=torch.bool)
        logprobs[b, :n] = torch.tensor(traj.logprobs_T, dtype=torch.float32)
        versions[b, :n] = torch.tensor(traj.versions_T, dtype=torch.long)
        if routed is not None:
            arr = traj.routed_experts_T_L_K
            assert arr is not None
            if arr.shape[1:] != tuple(routed.shape[2:]):
                raise ConfigError(
                    f"trajectory {traj.task_id}: routed experts shape {arr.shape} differs from the batch's "
                    f"(T, {routed.shape[2]}, {routed.shape[3]})"
                )
            routed[b, :n] = torch.from_numpy(np.asarray(arr, dtype=np.int64))
        groups[b] = group_index.setdefault(traj.group_id, len(group_index))
        rewards[b] = float(traj.reward)  # type: ignore[arg-type]
    return TrainBatch(
        tokens_B_T=tokens,
        attention_mask_B_T=attention,
        loss_mask_B_T=loss_mask,
        behaviour_logprobs_B_T=logprobs,
        versions_B_T=versions,
        rewards_B=rewards,
        group_ids_B=groups,
        routed_experts_B_T_L_K=routed,
    )


def to_device(batch: TrainBatch, device: torch.device | str) -> TrainBatch:
    """``batch`` with every tensor on ``device``: the one host-to-device copy of a train step.

    Pinned host memory would let ``non_blocking`` overlap the copy; the batch
    is small next to a forward pass, so a plain copy is enough.
    """
    fields = {
        name: (value.to(device) if isinstance(value, torch.Tensor) else value)
        for name, value in vars(batch).items()
    }
    return TrainBatch(**fields)


def micro_batches(
    attention_mask_B_T: torch.Tensor, size: int, *, sort_by_length: bool
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Split a right-padded batch into micro-batches of at most ``size`` rows.

    Returns ``(order, spans)``: ``order`` lists the batch's rows in processing
    order and each span ``(start, stop, T)`` is one micro-batch, rows
    ``order[start:stop]`` and columns ``[:T]``.

    - ``sort_by_length=False``: rows in batch order, every micro-batch the
      full width (the padded baseline);
    - ``sort_by_length=True``: rows sorted by length (longest first, ties in
      batch order) and each micro-batch cut to its longest row. Exact: rows
      are right-padded and attention is causal, so the dropped columns never
      influence the kept ones. Padded tokens computed drop from
      ``sum_mb size * T_max`` to ``sum_mb size * T_mb``.
    """
    if size < 1:
        raise ConfigError(f"micro-batch size must be >= 1, got {size}")
    lengths = attention_mask_B_T.sum(dim=1).tolist()
    B, T = attention_mask_B_T.shape
    if not sort_by_length:
        return list(range(B)), [(s, min(s + size, B), T) for s in range(0, B, size)]
    order = sorted(range(B), key=lambda b: -lengths[b])
    spans = []
    for s in range(0, B, size):
        stop = min(s + size, B)
        spans.append((s, stop, max(2, int(max(lengths[b] for b in order[s:stop])))))
    return order, spans

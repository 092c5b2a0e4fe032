"""Sequence advantages from scalar rewards and group ids.

A group is the set of trajectories sampled for one task (same ``group_id``).
With ``R`` the rewards, ``mean_g`` / ``std_g`` the group mean and unbiased
standard deviation (Bessel-corrected, as torch.std; 0 for groups of one), and
``n_g`` the group size:

    grpo     A_i = (R_i - mean_g) / (std_g + eps)
    dr_grpo  A_i =  R_i - mean_g                               (no std: Dr.GRPO)
    rloo     A_i =  R_i - mean_{j != i in g} R_j = n_g / (n_g - 1) * (R_i - mean_g);  0 if n_g = 1
    whiten   A_i = (R_i - mean_B) / (std_B + eps)              (batch whitening, REINFORCE++)

A group whose rewards are all equal (including a group of one) carries no
learning signal under any group baseline: its advantages are exactly 0 and it is
counted in the ``adv/zero_variance_*`` diagnostics so the buffer's dynamic
sampling can be judged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch

from labrl.errors import ConfigError

from ._config import AdvantageKind


@dataclass(frozen=True)
class GroupStats:
    """Per-sequence views of the group statistics (all shape (B,)), and per group whether it is zero-variance."""

    mean_B: torch.Tensor
    std_B: torch.Tensor  # unbiased; 0 for groups of one
    size_B: torch.Tensor  # float
    zero_variance_B: torch.Tensor  # bool
    zero_variance_G: torch.Tensor  # bool, one per group (in sorted group-id order)
    num_groups: int

    @property
    def num_zero_variance_groups(self) -> int:
        """A host read: ``compute_advantages`` reads it with its other diagnostics instead."""
        return int(self.zero_variance_G.sum())


def group_stats(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> GroupStats:
    """Group mean / unbiased std / size broadcast back to each sequence."""
    rewards = rewards_B.to(torch.float64)
    groups, inverse_B = torch.unique(group_ids_B, return_inverse=True)
    num_groups = groups.numel()  # the unique ids' count: no read of a device value

    def filled_G(value: float) -> torch.Tensor:  # float64 on the rewards' device, like `rewards`
        return rewards.new_full((num_groups,), value)

    size_G = filled_G(0.0).scatter_add_(0, inverse_B, torch.ones_like(rewards))
    sum_G = filled_G(0.0).scatter_add_(0, inverse_B, rewards)
    mean_G = sum_G / size_G
    dev_B = rewards - mean_G[inverse_B]
    ss_G = filled_G(0.0).scatter_add_(0, inverse_B, dev_B.square())
    std_G = torch.where(size_G > 1, (ss_G / (size_G - 1).clamp(min=1)).sqrt(), torch.zeros_like(ss_G))
    # Exact equality of rewards, not a tolerance: 0/1 rewards are the common case.
    max_G = filled_G(-torch.inf).scatter_reduce_(0, inverse_B, rewards, "amax")
    min_G = filled_G(torch.inf).scatter_reduce_(0, inverse_B, rewards, "amin")
    zero_G = max_G == min_G
    return GroupStats(
        mean_B=mean_G[inverse_B],
        std_B=std_G[inverse_B],
        size_B=size_G[inverse_B],
        zero_variance_B=zero_G[inverse_B],
        zero_variance_G=zero_G,
        num_groups=num_groups,
    )


def _grpo(rewards_B: torch.Tensor, s: GroupStats, eps: float) -> torch.Tensor:
    adv = (rewards_B.to(torch.float64) - s.mean_B) / (s.std_B + eps)
    return torch.where(s.zero_variance_B, 0.0, adv).to(rewards_B.dtype)


def _dr_grpo(rewards_B: torch.Tensor, s: GroupStats) -> torch.Tensor:
    adv = rewards_B.to(torch.float64) - s.mean_B
    return torch.where(s.zero_variance_B, 0.0, adv).to(rewards_B.dtype)


def _rloo(rewards_B: torch.Tensor, s: GroupStats) -> torch.Tensor:
    scale = torch.where(s.size_B > 1, s.size_B / (s.size_B - 1).clamp(min=1), 0.0)
    adv = scale * (rewards_B.to(torch.float64) - s.mean_B)
    return torch.where(s.zero_variance_B, 0.0, adv).to(rewards_B.dtype)


def grpo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``A_i = (R_i - mean_g) / (std_g + eps)``; exactly 0 in zero-variance groups."""
    return _grpo(rewards_B, group_stats(rewards_B, group_ids_B), eps)


def dr_grpo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """``A_i = R_i - mean_g`` (Dr.GRPO: no std normalisation)."""
    return _dr_grpo(rewards_B, group_stats(rewards_B, group_ids_B))


def rloo_advantages(rewards_B: torch.Tensor, group_ids_B: torch.Tensor) -> torch.Tensor:
    """``A_i = R_i - mean_{j != i} R_j = n_g / (n_g - 1) * (R_i - mean_g)``; 0 for groups of one."""
    return _rloo(rewards_B, group_stats(rewards_B, group_ids_B))


def whiten_advantages(rewards_B: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``A_i = (R_i - mean_B) / (std_B + eps)`` over the whole batch (unbiased std; 0 for B = 1)."""
    rewards = rewards_B.to(torch.float64)
    if rewards.numel() < 2:
        return torch.zeros_like(rewards_B)
    adv = (rewards - rewards.mean()) / (rewards.std() + eps)
    return adv.to(rewards_B.dtype)


ADVANTAGES = get_args(AdvantageKind)


def compute_advantages(
    kind: str,
    rewards_B: torch.Tensor,
    group_ids_B: torch.Tensor,
    eps: float = 1e-6,
    *,
    metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages of the configured kind plus ``adv/*`` diagnostics (zero-variance groups).

    The group statistics are computed once for both. ``metrics=False`` skips the
    diagnostics (and their host read) for a caller that needs the advantages only;
    with them, every diagnostic is read in one host copy."""
    if kind not in ADVANTAGES:
        raise ConfigError(f"advantages must be one of {', '.join(ADVANTAGES)} (got {kind!r})")
    s = group_stats(rewards_B, group_ids_B) if kind != "whiten" or metrics else None
    if s is None or kind == "whiten":
        adv_B = whiten_advantages(rewards_B, eps)
    elif kind == "grpo":
        adv_B = _grpo(rewards_B, s, eps)
    elif kind == "dr_grpo":
        adv_B = _dr_grpo(rewards_B, s)
    else:
        adv_B = _rloo(rewards_B, s)
    if s is None or not metrics or not rewards_B.numel():
        return adv_B, {}
    adv = adv_B.double()
    mean, abs_mean, reward_mean, zero_groups, zero_seq_frac = torch.stack(
        [
            adv.mean(),
            adv.abs().mean(),
            rewards_B.double().mean(),
            s.zero_variance_G.sum().double(),
            s.zero_variance_B.double().mean(),
        ]
    ).tolist()
    return adv_B, {
        "adv/mean": mean,
        "adv/abs_mean": abs_mean,
        "adv/reward_mean": reward_mean,
        "adv/groups": float(s.num_groups),
        "adv/zero_variance_groups": zero_groups,
        "adv/zero_variance_seq_frac": zero_seq_frac,
    }

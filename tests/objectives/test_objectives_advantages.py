"""Advantage estimators on hand-computed rewards."""

from __future__ import annotations

import math

import pytest
import torch

from labrl.harness.objectives import (
    compute_advantages,
    dr_grpo_advantages,
    group_stats,
    grpo_advantages,
    rloo_advantages,
    whiten_advantages,
)

# group 0: [1, 0, 0, 1] (mean 0.5, unbiased std sqrt(1/3)); group 1: [1, 1] (zero variance)
R = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
G = torch.tensor([7, 7, 7, 7, 3, 3])


def test_group_stats() -> None:
    s = group_stats(R, G)
    assert s.num_groups == 2
    assert s.num_zero_variance_groups == 1
    assert s.mean_B.tolist() == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    assert s.std_B[0].item() == pytest.approx(math.sqrt(1 / 3), abs=1e-12)
    assert s.std_B[4].item() == 0.0
    assert s.zero_variance_B.tolist() == [False] * 4 + [True] * 2


def test_grpo() -> None:
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert grpo_advantages(R, G).tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0], abs=1e-6)
    assert a == pytest.approx(0.8660239, abs=1e-6)


def test_dr_grpo_has_no_std() -> None:
    assert dr_grpo_advantages(R, G).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0]


def test_rloo_leave_one_out() -> None:
    # R_0 = 1, mean of the others (0, 0, 1) = 1/3 -> 2/3
    assert rloo_advantages(R, G).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0], abs=1e-7)


def test_whiten_over_batch() -> None:
    # mean 2/3; unbiased var = (4 * 1/9 + 2 * 4/9) / 5 = 4/15
    std = math.sqrt(4 / 15)
    expected = [(1 - 2 / 3) / std if r == 1 else (0 - 2 / 3) / std for r in R.tolist()]
    assert whiten_advantages(R).tolist() == pytest.approx(expected, abs=1e-5)


def test_groups_of_one_get_zero() -> None:
    r, g = torch.tensor([0.3, 0.9]), torch.tensor([0, 1])
    for adv in (grpo_advantages(r, g), dr_grpo_advantages(r, g), rloo_advantages(r, g)):
        assert adv.tolist() == [0.0, 0.0]
    assert whiten_advantages(torch.tensor([0.4])).tolist() == [0.0]


def test_zero_variance_reported() -> None:
    adv, m = compute_advantages("grpo", R, G)
    assert m["adv/groups"] == 2.0
    assert m["adv/zero_variance_groups"] == 1.0
    assert m["adv/zero_variance_seq_frac"] == pytest.approx(2 / 6)
    assert m["adv/reward_mean"] == pytest.approx(4 / 6)
    assert adv[4:].tolist() == [0.0, 0.0]

"""The cascade estimator against closed forms: a proxy of known bias and noise, audited at known p.

Every statistical assertion allows ``Z`` standard errors of the Monte Carlo estimate (the draws
are seeded, so each test is deterministic; ``Z = 4`` would fail about once in 16,000 seeds).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from labrl.envs.cascade.estimator import (
    audited_proxy_variance,
    cascade_reward,
    conditional_variance,
    cumulative_probabilities,
)
from labrl.harness.objectives._advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages

Z = 4.0
N = 200_000


def _two_stage_rewards(c: np.ndarray, e: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``cascade_reward`` of each episode, the expensive stage drawn with probability ``q``."""
    ran = rng.random(len(c)) < q
    return np.array(
        [
            cascade_reward([ci, ei], [qi]) if a else cascade_reward([ci], [])
            for ci, ei, qi, a in zip(c, e, q, ran, strict=True)
        ]
    )


def _variance_se(x: np.ndarray) -> float:
    """Standard error of the sample variance: sqrt((m4 - s^4) / n)."""
    centred = x - x.mean()
    return math.sqrt((np.mean(centred**4) - np.var(x) ** 2) / len(x))


@pytest.mark.parametrize(("bias", "noise", "p"), [(0.3, 0.1, 0.2), (-0.2, 0.25, 0.5), (0.0, 0.05, 0.05)])
def test_audited_proxy_is_unbiased_with_the_closed_form_variance(bias, noise, p):
    rng = np.random.default_rng(7)
    e = rng.random(N)  # truth ~ U(0, 1): E[e] = 1/2, Var(e) = 1/12
    c = e + bias + noise * rng.standard_normal(N)
    r = _two_stage_rewards(c, e, np.full(N, p), rng)

    expected_var = audited_proxy_variance(1 / 12, p, bias**2 + noise**2)
    assert abs(r.mean() - 0.5) < Z * math.sqrt(expected_var / N)
    assert abs(r.var() - expected_var) < Z * _variance_se(r)
    if bias:  # the proxy alone inherits its bias, far outside the same error bars
        assert abs(c.mean() - 0.5) > 20 * math.sqrt(expected_var / N)


def test_gating_by_the_cheap_value_with_known_probabilities_stays_unbiased():
    """q = 1 where the proxy passes c >= 0.6, q = p elsewhere; the proxy's bias depends on e."""
    rng = np.random.default_rng(11)
    p = 0.15
    e = rng.random(N)
    c = 0.6 * e + 0.3 + 0.1 * rng.standard_normal(N)  # over-rates bad candidates, under-rates good ones
    q = np.where(c >= 0.6, 1.0, p)
    r = _two_stage_rewards(c, e, q, rng)

    # Var(r) = Var(e) + E[(1 - q) / q (e - c)^2], the expectation taken over the drawn (c, e)
    expected_var = np.var(e) + np.mean((1 - q) / q * (e - c) ** 2)
    assert abs(r.mean() - e.mean()) < Z * math.sqrt(expected_var / N)
    assert abs(r.var() - expected_var) < Z * _variance_se(r)


def test_a_gate_that_looks_at_the_expensive_outcome_is_biased():
    """The condition is needed: run the truth where it is high, but record q = p as if audited."""
    rng = np.random.default_rng(3)
    p = 0.3
    e = rng.random(N)
    c = np.full(N, 0.5)  # a constant proxy: the correction e - c is large where e is
    ran = (e > 0.5) & (rng.random(N) < 2 * p)  # P(ran) = p overall, but it depends on e
    r = np.where(ran, c + (e - c) / p, c)
    assert abs(r.mean() - e.mean()) > 20 * math.sqrt(r.var() / N)


def test_three_stages_telescope_to_the_truth_with_the_nested_variance():
    """Given all values, E[r | s] = s_K and Var(r | s) = sum_jk d_j d_k (1 / P_min(j,k) - 1)."""
    rng = np.random.default_rng(5)
    values = [0.9, 0.4, 0.7, 0.55]
    qs = [0.5, 0.3, 0.8]
    u = rng.random((N, len(qs)))
    reached = np.cumprod(u < np.array(qs), axis=1)  # stage k runs only after stage k - 1
    rewards = np.array(
        [cascade_reward(values[: 1 + int(row.sum())], qs[: int(row.sum())]) for row in reached]
    )
    expected_var = conditional_variance(values, qs)
    assert expected_var > 0
    assert abs(rewards.mean() - values[-1]) < Z * math.sqrt(expected_var / N)
    assert abs(rewards.var() - expected_var) < Z * _variance_se(rewards)


def test_full_audit_returns_the_truth_exactly():
    assert cascade_reward([0.2, 0.9, 0.4], [1.0, 1.0]) == pytest.approx(0.4)
    assert conditional_variance([0.2, 0.9, 0.4], [1.0, 1.0]) == 0.0
    assert audited_proxy_variance(0.1, 1.0, 5.0) == 0.1


def test_two_stage_closed_forms_agree():
    """Two stages, q = p: the nested formula is (1 - p) / p (e - c)^2."""
    assert conditional_variance([0.2, 0.7], [0.25]) == pytest.approx(3 * 0.5**2)
    assert cumulative_probabilities([0.5, 0.4]) == pytest.approx([0.5, 0.2])


@pytest.mark.parametrize(
    ("values", "probs"),
    [([0.1, 0.2], []), ([0.1], [0.5]), ([0.1, 0.2], [0.0]), ([0.1, 0.2], [1.5]), ([], [])],
)
def test_malformed_inputs_are_refused(values, probs):
    with pytest.raises(ValueError):
        cascade_reward(values, probs)


def test_grpo_group_advantages_linear_in_rewards_are_unbiased_and_std_normalised_are_not():
    """One group's values fixed (conditioning on s); only the audit draws vary over M repetitions."""
    rng = np.random.default_rng(13)
    e = np.array([1.0, 0.0, 0.2, 0.6])
    c = np.array([0.7, 0.3, 0.5, 0.5])  # a biased, noisy proxy of each member
    q = np.where(c >= 0.6, 1.0, 0.2)  # gated by the cheap value, audited otherwise
    m, g = 40_000, len(e)
    ran = rng.random((m, g)) < q
    r = np.where(ran, c + (e - c) / q, c)
    groups = torch.arange(m).repeat_interleave(g)
    truth_groups = torch.zeros(g, dtype=torch.long)
    rewards = torch.tensor(r.reshape(-1))
    for advantages in (dr_grpo_advantages, rloo_advantages):
        estimated = advantages(rewards, groups).reshape(m, g).numpy()
        exact = advantages(torch.tensor(e), truth_groups).numpy()
        se = estimated.std(axis=0) / math.sqrt(m)
        assert np.all(np.abs(estimated.mean(axis=0) - exact) < Z * se), advantages.__name__
    normalised = grpo_advantages(rewards, groups).reshape(m, g).numpy()
    exact = grpo_advantages(torch.tensor(e), truth_groups).numpy()
    se = normalised.std(axis=0) / math.sqrt(m)
    assert np.any(np.abs(normalised.mean(axis=0) - exact) > 10 * se)

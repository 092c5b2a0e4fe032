"""``Informative``: pay for the next stage where it could flip a group advantage's sign, unbiased under audits.

Statistical assertions allow ``Z`` standard errors of the seeded Monte Carlo estimate, as in
test_estimator.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from cascade_fakes import play_group

from labrl.envs import make
from labrl.envs.cascade import CascadeRecord, Informative
from labrl.envs.cascade.estimator import cascade_reward, conditional_variance
from labrl.envs.cascade.residuals import GapStats, shared_gaps
from labrl.errors import ConfigError

Z = 4.0


def test_members_within_the_margin_of_the_group_mean_pass():
    rule = Informative(noise=0.1, z=2.0)
    values = {0: 0.1, 1: 0.5, 2: 0.52, 3: 0.9}  # mean 0.505, margin 2 * 0.1 * sqrt(3/4) = 0.1732
    assert rule.margin(4, 0.1) == pytest.approx(0.2 * math.sqrt(0.75))
    assert rule.passing(values, 0.1) == {1, 2}
    assert rule.passing({m: v + 0.3 for m, v in values.items()}, 0.1) == {1, 2}  # a constant bias cancels
    assert rule.passing(values, 0.3) == {0, 1, 2, 3}  # a noisier proxy leaves every sign uncertain
    assert rule.passing({0: 0.4}, 0.1) == frozenset()  # a group of one has no advantage to flip


def test_the_reward_and_the_group_advantage_are_unbiased_given_the_groups_values():
    """Fixed cheap and true values of one group; only the audit draws vary. ``E[r_i | s] = e_i`` and
    ``E[r_i - mean r | s] = e_i - mean e``, with ``Var(r_i | s)`` the estimator's conditional variance."""
    rule, p, n = Informative(noise=0.1, z=2.0), 0.2, 40_000
    c = np.array([0.15, 0.48, 0.55, 0.95])
    e = np.array([0.05, 0.70, 0.30, 0.60])  # member 2's sign flips under the truth; 3 is over-rated
    passed = rule.passing(dict(enumerate(c)), 0.1)
    q = np.array([1.0 if i in passed else p for i in range(4)])
    ran = np.random.default_rng(5).random((n, 4)) < q
    r = np.array(
        [[cascade_reward([c[i], e[i]], [q[i]]) if row[i] else c[i] for i in range(4)] for row in ran]
    )
    for i in range(4):
        var = conditional_variance([c[i], e[i]], [q[i]])
        assert abs(r[:, i].mean() - e[i]) <= Z * math.sqrt(var / n) + 1e-12
        assert (var == 0) == (i in passed)  # a member that passed always runs the truth: r = e exactly
    advantage = r - r.mean(axis=1, keepdims=True)
    se = advantage.std(axis=0) / math.sqrt(n)
    assert np.all(np.abs(advantage.mean(axis=0) - (e - e.mean())) <= Z * se + 1e-12)


def test_over_random_groups_the_reward_is_unbiased_and_pays_for_fewer_truths():
    rng = np.random.default_rng(9)
    rule, p, groups, size, bias, noise = Informative(noise=0.1, z=2.0), 0.2, 40_000, 4, 0.2, 0.1
    e = rng.random((groups, size))
    c = e + bias + noise * rng.standard_normal((groups, size))
    q = np.array(
        [[1.0 if i in rule.passing(dict(enumerate(row)), noise) else p for i in range(size)] for row in c]
    )
    ran = rng.random((groups, size)) < q
    r = np.where(ran, c + (e - c) / q, c)
    expected_var = np.var(e) + np.mean((1 - q) / q * (e - c) ** 2)
    assert abs(r.mean() - e.mean()) < Z * math.sqrt(expected_var / r.size)
    assert 0.2 < ran.mean() < 0.6  # pays for the truth on a fraction of the members, never all
    # where it skips the truth, the truth would rarely have flipped the advantage's sign (0.4 % here)
    flips = np.sign(e - e.mean(axis=1, keepdims=True)) != np.sign(c - c.mean(axis=1, keepdims=True))
    assert flips[q < 1].mean() < 0.01 and flips[q == 1].mean() > 0.1


def test_the_gap_statistics_are_the_sample_mean_and_deviation():
    gaps = [0.1, -0.3, 0.25, 0.05, 0.4]
    stats = GapStats()
    for g in gaps:
        stats.add(g)
    assert stats.count == 5
    assert stats.mean == pytest.approx(np.mean(gaps))
    assert stats.std == pytest.approx(np.std(gaps, ddof=1))


async def test_the_synthetic_env_pays_the_truth_where_the_group_sign_is_uncertain():
    answers = ["0.1", "0.42", "0.47", "0.5", "0.9"]
    _, group = await play_group(
        [f"<answer>{a}</answer>" for a in answers], top_k=None, informative_z=2.0, proxy_noise=0.1
    )
    records = [CascadeRecord.model_validate(t.info["cascade"]) for t in group]
    proxy = {i: r.stages[0].value for i, r in enumerate(records)}
    expected = Informative(noise=0.1, z=2.0).passing(proxy, 0.1)
    assert 0 < len(expected) < len(answers)
    assert {i for i, r in enumerate(records) if len(r.stages) == 2} == expected
    assert all(
        r.stages[1].passed_rule and r.stages[1].run_probability == 1 for r in records if len(r.stages) == 2
    )


def test_one_rule_at_a_time():
    with pytest.raises(ConfigError, match="top_k or informative_z"):
        make("synthetic/cascade-v0", top_k=1, informative_z=2.0)


async def test_once_enough_gaps_are_measured_their_deviation_replaces_the_prior():
    gaps = shared_gaps("synthetic/cascade-v0", "proxy")  # this test's event loop: a fresh process view
    for i in range(20):
        gaps.add(1.0 if i % 2 else -1.0)  # sd ~1.03: every sign in a group is uncertain
    answers = ["0.1", "0.42", "0.47", "0.5", "0.9"]
    _, group = await play_group(
        [f"<answer>{a}</answer>" for a in answers], top_k=None, informative_z=2.0, proxy_noise=0.1
    )
    assert [len(t.info["cascade"]["stages"]) for t in group] == [2] * len(answers)
    assert gaps.count == 20 + len(answers)  # each truth paid adds its gap

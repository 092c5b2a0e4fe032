"""The unbiased multi-fidelity reward of a cascade: a control variate with inverse-probability weights.

Notation for one episode: ``s_0, ..., s_K`` the values the stages *would* give its candidate
(``e = s_K`` the expensive truth, ``c = s_0`` the cheap proxy); ``A_k = 1`` when stage ``k`` ran
(``A_0 = 1``; stage ``k`` runs only after stage ``k - 1``); ``q_k = P(A_k = 1 | A_{k-1} = 1)`` the
probability it ran with, known when it is drawn (1 where the previous stage's rule passed the
candidate on, the audit probability ``p`` where it did not); ``P_k = q_1 * ... * q_k``.

The reward the episode receives::

    r = s_0 + sum_{k=1..K} (A_k / P_k) (s_k - s_{k-1})          (only reached stages enter)

Two stages: ``r = c + (A / q)(e - c)``; with every candidate audited at ``p`` and none gated,
``r = c + (A / p)(e - c)``.

**Unbiased.** Condition: given the candidate's stage values ``s`` (and, for a group rule, its
group's), the draw ``A_k`` depends only on an independent uniform and on ``q_k``, and ``q_k`` is a
function of the earlier stages' values ``s_0..s_{k-1}`` (and of the group's), never of ``s_k`` or
later. Then ``E[A_k | s] = P_k``, so ``E[A_k / P_k (s_k - s_{k-1}) | s] = s_k - s_{k-1}`` and the
sum telescopes::

    E[r | s] = s_0 + sum_k (s_k - s_{k-1}) = s_K = e,        hence E[r] = E[e]

for every candidate, whatever the proxy's bias and noise. The proxy's bias ``E[c - e]`` is
cancelled by the audited episodes' weight ``1 / P_k``; the proxy only has to be correlated with
the truth to lower the variance (a control variate), never unbiased.

**Variance.** Conditionally on ``s``, ``Cov(A_j / P_j, A_k / P_k) = 1 / P_min(j,k) - 1`` (the draws
are nested: ``A_k = 1`` implies ``A_j = 1`` for ``j < k``), so with ``d_k = s_k - s_{k-1}``::

    Var(r | s) = sum_{j,k >= 1} d_j d_k (1 / P_min(j,k) - 1)
    Var(r)     = Var(e) + E[Var(r | s)]                           (law of total variance)

Two stages: ``Var(r | c, e) = (1 - q) / q (e - c)^2``, so ``Var(r) = Var(e) + E[(1 - q)/q (e - c)^2]``;
with ``q = p`` for all and a proxy ``c = e + b + eps`` (``eps`` independent of ``e``, mean 0,
variance ``sigma^2``): ``Var(r) = Var(e) + (1 - p) / p (b^2 + sigma^2)``. At ``p = 1`` it is
``Var(e)``: every stage runs and ``r = e``.

**A GRPO group.** Members ``i = 1..G`` of one prompt with rewards ``r_i``. Under the condition
above for every member (a member's draws depend on its own earlier values, on the group's cheap
values through a group rule, and on independent uniforms, never on any member's value at the
stage being drawn), ``E[r_i | s_1..s_G] = e_i`` for every ``i``, and every advantage *linear* in
the rewards is unbiased for the same advantage computed from the truths::

    E[r_i - mean_j r_j | s]          = e_i - mean_j e_j            (dr_grpo: the group mean)
    E[r_i - mean_{j != i} r_j | s]   = e_i - mean_{j != i} e_j     (rloo)

So the policy gradient ``sum_i (r_i - mean_j r_j) grad log pi(y_i)`` has the expectation it has
under the expensive reward, including the factor ``(1 - 1/G)`` that the group mean (which holds
``r_i``) puts on each member under either reward. What does not hold:

- ``grpo``'s division by the group's standard deviation is not linear: ``(r_i - mean) / std(r)``
  is biased for ``(e_i - mean) / std(e)`` (and audit noise inflates ``std``, shrinking it);
- dropping a group whose ``r`` are all equal, or an episode whose audited stage failed, selects
  on the outcome: unbiased only if what is dropped is independent of ``e`` given what is kept;
- a rule that looks at the stage being decided (re-run DFT when DFT "looks off"), or a ``q``
  that is not the probability actually used, breaks ``E[A_k | s] = P_k``;
- ``r`` is not bounded by the truth's range: ``c + (e - c) / p`` can leave ``[0, 1]``.

**A baseline in place of the proxy.** Nothing above used ``s_0`` but as the start of the telescoping
sum, so any ``b`` that is fixed before the draws (a function of the earlier stages, of what the env
knows of the candidate, of other episodes' paid values, never of this episode's ``A_k``) may stand
in for it::

    r = b + (A_1 / P_1)(s_1 - b) + sum_{k>=2} (A_k / P_k)(s_k - s_{k-1}),     E[r | s, b] = s_K

and the variance formula holds with ``d_1 = s_1 - b``; two stages: ``Var(r | s, b) = (1 - q)/q (e - b)^2``.
A ``b`` that predicts the truth better than the proxy does (``labrl.envs.cascade.baseline``) shrinks
the audit noise without touching the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def cumulative_probabilities(run_probabilities: Sequence[float]) -> list[float]:
    """``P_k = q_1 * ... * q_k`` for each ``q_k`` in ``run_probabilities``; every ``q_k`` in (0, 1]."""
    out, product = [], 1.0
    for q in run_probabilities:
        if not (0.0 < q <= 1.0):
            raise ValueError(f"a run probability must be in (0, 1], got {q}")
        product *= q
        out.append(product)
    return out


def cascade_reward(
    values: Sequence[float], run_probabilities: Sequence[float], baseline: float | None = None
) -> float:
    """``r = s_0 + sum_k (s_k - s_{k-1}) / P_k`` over the reached stages (module docstring).

    ``values``: ``s_0..s_m`` of the stages the episode reached; ``run_probabilities``: ``q_1..q_m``
    with which stages ``1..m`` ran (one fewer than ``values``). ``baseline``: a ``b`` fixed before
    the draws that stands in for ``s_0`` (``r = b + (s_1 - b) / P_1 + ...``; module docstring).
    """
    if not values:
        raise ValueError("a cascade reward needs the value of at least the first stage")
    if len(run_probabilities) != len(values) - 1:
        raise ValueError(
            f"{len(values)} stage values need {len(values) - 1} run probabilities, got {len(run_probabilities)}"
        )
    values = [values[0] if baseline is None else baseline, *values[1:]]
    reward = values[0]
    for k, prob in enumerate(cumulative_probabilities(run_probabilities), start=1):
        reward += (values[k] - values[k - 1]) / prob
    return reward


def conditional_variance(values: Sequence[float], run_probabilities: Sequence[float]) -> float:
    """``Var(r | s) = sum_{j,k} d_j d_k (1 / P_min(j,k) - 1)``: the audit draws' variance given all values.

    ``values``: ``s_0..s_K`` of every stage (also those not reached); ``run_probabilities``:
    ``q_1..q_K`` as the rules would set them from those values.
    """
    if len(run_probabilities) != len(values) - 1:
        raise ValueError(f"{len(values)} stage values need {len(values) - 1} run probabilities")
    gaps = [values[k] - values[k - 1] for k in range(1, len(values))]
    probs = cumulative_probabilities(run_probabilities)
    total = 0.0
    for j, d_j in enumerate(gaps):
        for k, d_k in enumerate(gaps):
            total += d_j * d_k * (1.0 / probs[min(j, k)] - 1.0)
    return total


def audited_proxy_variance(truth_variance: float, audit_probability: float, mean_square_gap: float) -> float:
    """``Var(r) = Var(e) + (1 - p) / p * E[(e - c)^2]``: two stages, every candidate audited at ``p``.

    For a proxy ``c = e + b + eps`` with noise of variance ``sigma^2`` independent of ``e``,
    ``E[(e - c)^2] = b^2 + sigma^2``.
    """
    if not (0.0 < audit_probability <= 1.0):
        raise ValueError(f"the audit probability must be in (0, 1], got {audit_probability}")
    if truth_variance < 0 or mean_square_gap < 0 or not math.isfinite(truth_variance + mean_square_gap):
        raise ValueError("variances and the mean square gap must be finite and non-negative")
    return truth_variance + (1.0 - audit_probability) / audit_probability * mean_square_gap

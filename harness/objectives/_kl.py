"""Per-token KL estimators (Schulman, "Approximating KL divergence").

Tokens are sampled from ``q``; ``p`` is the other policy. With the log-ratio
``l = log p(x) - log q(x)`` (clamped to ``[-clamp, clamp]`` before ``exp``), each
estimator's mean over samples estimates ``KL(q || p)``:

    k1 = -l                  unbiased, high variance, can be negative
    k2 = l^2 / 2             biased, low variance, >= 0
    k3 = exp(l) - 1 - l      unbiased (E_q[exp(l)] = 1), low variance, >= 0
    k3_clamped = clamp(k3, -kl_clamp, kl_clamp)
                             verl's ``low_var_kl`` (kl_clamp = 10): a token far from the
                             reference contributes at most kl_clamp, and no gradient beyond it

Mismatch KL between sampler and learner: tokens come from the behaviour policy
``mu``, so ``q = mu`` and ``p = pi_old``: ``l = log w`` with ``w = pi_old / mu``.
Reference KL (GRPO's penalty): tokens come from the policy, ``q = pi``, ``p = ref``.
"""

from __future__ import annotations

import torch

from labrl.errors import ConfigError


def kl_estimate(
    logp_sampled: torch.Tensor,
    logp_other: torch.Tensor,
    kind: str,
    clamp: float = 20.0,
    kl_clamp: float = 10.0,
) -> torch.Tensor:
    """Elementwise k1 / k2 / k3 / k3_clamped of ``KL(q || p)``, ``q`` = sampling policy; same shape as the inputs.

    ``clamp`` bounds the log-ratio before ``exp``; ``kl_clamp`` bounds the k3_clamped value.
    """
    return kl_of_log_ratio((logp_other - logp_sampled).clamp(-clamp, clamp), kind, kl_clamp)


def kl_of_log_ratio(log_r: torch.Tensor, kind: str, kl_clamp: float = 10.0) -> torch.Tensor:
    """``kl_estimate`` from the log-ratio ``l`` itself (already clamped where it needs to be): for a
    caller that holds ``l`` and takes several estimators of it, one subtraction and clamp fewer each."""
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    if kind == "k3_clamped":
        return (torch.expm1(log_r) - log_r).clamp(-kl_clamp, kl_clamp)
    raise ConfigError(f"kl estimator must be one of k1, k2, k3, k3_clamped (got {kind!r})")

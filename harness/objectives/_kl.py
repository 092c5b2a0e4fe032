"""Per-token KL estimators (Schulman, "Approximating KL divergence").

Tokens are sampled from ``q``; ``p`` is the other policy. With the log-ratio
``l = log p(x) - log q(x)`` (clamped to ``[-clamp, clamp]`` before ``exp``), each
estimator's mean over samples estimates ``KL(q || p)``:

    k1 = -l                  unbiased, high variance, can be negative
    k2 = l^2 / 2             biased, low variance, >= 0
    k3 = exp(l) - 1 - l      unbiased (E_q[exp(l)] = 1), low variance, >= 0

Mismatch KL between sampler and learner: tokens come from the behaviour policy
``mu``, so ``q = mu`` and ``p = pi_old``: ``l = log w`` with ``w = pi_old / mu``.
Reference KL (GRPO's penalty): tokens come from the policy, ``q = pi``, ``p = ref``.
"""

from __future__ import annotations

import torch

from labrl.errors import ConfigError


def kl_estimate(
    logp_sampled: torch.Tensor, logp_other: torch.Tensor, kind: str, clamp: float = 20.0
) -> torch.Tensor:
    """Elementwise k1 / k2 / k3 of ``KL(q || p)``, ``q`` = sampling policy; same shape as the inputs."""
    log_r = (logp_other - logp_sampled).clamp(-clamp, clamp)
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ConfigError(f"kl estimator must be one of k1, k2, k3 (got {kind!r})")

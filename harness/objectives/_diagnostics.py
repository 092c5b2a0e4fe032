"""Batch diagnostics of the behaviour mismatch and staleness (global batch, no grad).

Over the valid tokens, with ``l_t = log w_t = logp_old_t - logp_mu_t``:

    mismatch k1   mean(-l_t)                 estimates KL(mu || pi_old) (can be < 0)
    mismatch k3   mean(w_t - 1 - l_t)        unbiased, >= 0 (tokens are sampled from mu)
    ESS           (sum w)^2 / (n * sum w^2)  in (0, 1]; 1 = on-policy; computed in log space
    quantiles     of w_t (linear interpolation between order statistics)
    staleness     learner_version - version_t: mean, max, and token fractions in
                  power-of-two buckets 0, 1, 2-3, 4-7, ..., 256+

Statistics that need at least one token are omitted when there is none (the
``tokens/valid`` count says why), so every value returned is finite.
"""

from __future__ import annotations

import math

import torch

from ._kl import kl_estimate

RATIO_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
STALENESS_BUCKETS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 255))


def mismatch_kl(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> dict[str, float]:
    """Mean k1 / k2 / k3 of KL(mu || pi_old) over valid tokens (samples from mu, ``l = log w``)."""
    lw = log_w_B_T[valid_B_T].double()
    if lw.numel() == 0:
        return {}
    zero = lw.new_zeros(())  # log-prob of the sampling policy relative to itself
    return {
        f"mismatch/kl_{k}": float(kl_estimate(zero, lw, k, clamp=math.inf).mean()) for k in ("k1", "k2", "k3")
    }


def effective_sample_size(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> float | None:
    """Normalised ESS ``(sum w)^2 / (n sum w^2)`` over valid tokens, via logsumexp; None if empty."""
    lw = log_w_B_T[valid_B_T].double()
    if lw.numel() == 0:
        return None
    log_ess = 2 * torch.logsumexp(lw, 0) - math.log(lw.numel()) - torch.logsumexp(2 * lw, 0)
    return float(torch.exp(log_ess).item())


def quantiles(values: torch.Tensor, qs: tuple[float, ...] = RATIO_QUANTILES) -> list[float]:
    """Linear-interpolated quantiles of a 1-D tensor (sort based: no size limit, unlike torch.quantile)."""
    v = values.sort().values
    n = v.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, n - 1)
        a, b = float(v[lo]), float(v[hi])
        out.append(a + (b - a) * (pos - lo))
    return out


def ratio_stats(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> dict[str, float]:
    """Behaviour-ratio quantiles, min, max and ESS over valid tokens."""
    lw = log_w_B_T[valid_B_T]
    if lw.numel() == 0:
        return {}
    w = torch.exp(lw.double())
    out = {f"ratio/q{round(q * 100):02d}": val for q, val in zip(RATIO_QUANTILES, quantiles(w), strict=True)}
    out["ratio/min"] = float(w.min())
    out["ratio/max"] = float(w.max())
    out["ratio/mean"] = float(w.mean())
    ess = effective_sample_size(log_w_B_T, valid_B_T)
    if ess is not None:
        out["mismatch/ess"] = ess
    return out


def _bucket_name(lo: int, hi: int) -> str:
    return f"staleness/frac_{lo}" if lo == hi else f"staleness/frac_{lo}_{hi}"


def staleness_stats(
    versions_B_T: torch.Tensor, valid_B_T: torch.Tensor, learner_version: int
) -> dict[str, float]:
    """Per-token staleness ``learner_version - version`` over valid tokens: mean, max, bucket fractions."""
    s = learner_version - versions_B_T[valid_B_T]
    n = s.numel()
    if n == 0:
        return {}
    out = {"staleness/mean": float(s.double().mean()), "staleness/max": float(s.max())}
    # bucket b holds staleness in [edges[b-1], edges[b]); the last bucket is open-ended
    edges = torch.tensor([hi + 1 for _, hi in STALENESS_BUCKETS], device=s.device)
    counts = torch.bincount(torch.bucketize(s, edges, right=True), minlength=len(STALENESS_BUCKETS) + 1)
    for (lo, hi), c in zip(STALENESS_BUCKETS, counts.tolist(), strict=False):
        out[_bucket_name(lo, hi)] = c / n
    last = STALENESS_BUCKETS[-1][1] + 1
    out[f"staleness/frac_{last}_plus"] = counts[-1].item() / n
    return out

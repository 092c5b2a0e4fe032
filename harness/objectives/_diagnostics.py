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


KL_ESTIMATORS = ("k1", "k2", "k3")


def mismatch_kl(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> dict[str, float]:
    """Mean k1 / k2 / k3 of KL(mu || pi_old) over valid tokens (samples from mu, ``l = log w``), one host read."""
    lw = log_w_B_T[valid_B_T].double()
    if lw.numel() == 0:
        return {}
    zero = lw.new_zeros(())  # log-prob of the sampling policy relative to itself
    means = torch.stack([kl_estimate(zero, lw, k, clamp=math.inf).mean() for k in KL_ESTIMATORS]).tolist()
    return {f"mismatch/kl_{k}": v for k, v in zip(KL_ESTIMATORS, means, strict=True)}


def _log_ess(lw: torch.Tensor) -> torch.Tensor:
    """``log((sum w)^2 / (n sum w^2))`` of the log-weights ``lw`` (1-D, non-empty), as a 0-d tensor."""
    return 2 * torch.logsumexp(lw, 0) - math.log(lw.numel()) - torch.logsumexp(2 * lw, 0)


def effective_sample_size(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> float | None:
    """Normalised ESS ``(sum w)^2 / (n sum w^2)`` over valid tokens, via logsumexp; None if empty."""
    lw = log_w_B_T[valid_B_T].double()
    if lw.numel() == 0:
        return None
    return float(torch.exp(_log_ess(lw)).item())


def _order_statistics(n: int, qs: tuple[float, ...]) -> tuple[list[int], list[float]]:
    """For each quantile ``q`` of ``n`` sorted values: the lower order statistic's index and the
    interpolation weight toward the next, ``q (n - 1) = lo + frac``."""
    positions = [q * (n - 1) for q in qs]
    lows = [math.floor(pos) for pos in positions]
    return lows, [pos - lo for pos, lo in zip(positions, lows, strict=True)]


def _interpolate(fracs: list[float], at_lo: list[float], at_hi: list[float]) -> list[float]:
    return [a + (b - a) * f for a, b, f in zip(at_lo, at_hi, fracs, strict=True)]


def _quantile_gather(sorted_values: torch.Tensor, lows: list[int]) -> torch.Tensor:
    """The order statistics at ``lows`` and at the index after each (capped at the last), concatenated."""
    n = sorted_values.numel()
    index = torch.tensor(lows + [min(lo + 1, n - 1) for lo in lows], device=sorted_values.device)
    return sorted_values[index]


def quantiles(values: torch.Tensor, qs: tuple[float, ...] = RATIO_QUANTILES) -> list[float]:
    """Linear-interpolated quantiles of a 1-D tensor (sort based: no size limit, unlike torch.quantile),
    read in one host copy."""
    lows, fracs = _order_statistics(values.numel(), qs)
    got = _quantile_gather(values.sort().values, lows).tolist()
    return _interpolate(fracs, got[: len(qs)], got[len(qs) :])


def ratio_stats(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> dict[str, float]:
    """Behaviour-ratio quantiles, min, max, mean and ESS over valid tokens, in one host read."""
    lw = log_w_B_T[valid_B_T].double()
    if lw.numel() == 0:
        return {}
    w = torch.exp(lw)
    lows, fracs = _order_statistics(w.numel(), RATIO_QUANTILES)
    summary = torch.stack([w.min(), w.max(), w.mean(), torch.exp(_log_ess(lw))])
    got = torch.cat([_quantile_gather(w.sort().values, lows), summary]).tolist()
    k = len(RATIO_QUANTILES)
    qs = _interpolate(fracs, got[:k], got[k : 2 * k])
    out = {f"ratio/q{round(q * 100):02d}": val for q, val in zip(RATIO_QUANTILES, qs, strict=True)}
    out["ratio/min"], out["ratio/max"], out["ratio/mean"], out["mismatch/ess"] = got[2 * k :]
    return out


EMPTY_SPAN = (
    2**62,
    -1,
)  # the span of no token: [above any version, below any] (not the token tag NO_VERSION)


def version_span(versions_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
    """``[min, max]`` (int64, on the device) of the versions on ``mask_B_T``'s tokens; ``EMPTY_SPAN`` if none.

    Left on the device, for a caller that reads it with its other values in one host copy."""
    versions = versions_B_T.to(torch.int64)
    if versions.numel() == 0:
        return torch.tensor(EMPTY_SPAN, dtype=torch.int64, device=versions.device)
    low, high = EMPTY_SPAN
    return torch.stack(
        [versions.masked_fill(~mask_B_T, low).amin(), versions.masked_fill(~mask_B_T, high).amax()]
    )


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
    # bucket b holds staleness in [edges[b-1], edges[b]); the last bucket is open-ended
    edges = s.new_tensor([hi + 1 for _, hi in STALENESS_BUCKETS])  # int64 on the device of s
    counts = torch.bincount(torch.bucketize(s, edges, right=True), minlength=len(STALENESS_BUCKETS) + 1)
    # one host read: mean, max, then the bucket counts
    mean, top, *bucket_counts = torch.cat(
        [torch.stack([s.double().mean(), s.max().double()]), counts.double()]
    ).tolist()
    out = {"staleness/mean": mean, "staleness/max": top}
    for (lo, hi), c in zip(STALENESS_BUCKETS, bucket_counts, strict=False):
        out[_bucket_name(lo, hi)] = c / n
    last = STALENESS_BUCKETS[-1][1] + 1
    out[f"staleness/frac_{last}_plus"] = bucket_counts[-1] / n
    return out

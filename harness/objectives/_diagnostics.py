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

``prepare`` takes the behaviour statistics with ``behaviour_diagnostics`` on the device: means as masked
sums over the known count of valid tokens, order statistics from one sort of the whole (B, T) ratio
with the invalid tokens sorted last, so no boolean indexing waits for the device, and the values
join the step's other metrics in one host read (``MetricSums``).
"""

from __future__ import annotations

import math

import torch

from ._kl import kl_of_log_ratio
from ._metrics import MetricSums

RATIO_QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
STALENESS_BUCKETS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127), (128, 255))


KL_ESTIMATORS = ("k1", "k2", "k3")


def mismatch_kl(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> dict[str, float]:
    """Mean k1 / k2 / k3 of KL(mu || pi_old) over valid tokens (samples from mu, ``l = log w``), one host read."""
    n = int(valid_B_T.sum())
    if n == 0:
        return {}
    sums = MetricSums(valid_B_T)
    _mismatch_kl(sums, log_w_B_T.double(), n)
    return sums.build().to_host()


def _mismatch_kl(sums: MetricSums, lw_B_T: torch.Tensor, n_valid: int) -> None:
    # tokens sampled from mu, the other policy pi_old: the log-ratio is l = log w itself, unclamped
    for k in KL_ESTIMATORS:
        sums.mean(f"mismatch/kl_{k}", kl_of_log_ratio(lw_B_T, k), n_valid)


def behaviour_diagnostics(
    sums: MetricSums, log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, n_valid: int
) -> None:
    """Add to ``sums`` (over ``valid_B_T``) the behaviour-to-proximal statistics of ``prepare``: the
    mismatch KLs, ``mismatch/abs_log_ratio_mean``, the ratio's quantiles, min, max and mean, and the
    ESS; ``n_valid`` is ``valid_B_T``'s count (known on the host), and with none only the mean
    ``|log w|`` (0). No host read: ``sums.build()`` holds them all."""
    sums.mean("mismatch/abs_log_ratio_mean", log_w_B_T.abs(), n_valid)
    if n_valid == 0:
        return
    lw = log_w_B_T.double()
    _mismatch_kl(sums, lw, n_valid)
    w = torch.exp(lw)
    sums.mean("ratio/mean", w, n_valid)
    # the valid tokens' ratios sorted first: order statistic i of them is position i
    ranked = torch.where(valid_B_T, w, math.inf).flatten().sort().values
    names = (*(f"ratio/q{round(q * 100):02d}" for q in RATIO_QUANTILES), "ratio/min", "ratio/max")
    sums.values(names, _quantiles_of_ranked(ranked, n_valid, (*RATIO_QUANTILES, 0.0, 1.0)))
    sums.value("mismatch/ess", torch.exp(_log_ess(torch.where(valid_B_T, lw, -math.inf).flatten(), n_valid)))


def _log_ess(lw: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``log((sum w)^2 / (n sum w^2))`` of the log-weights ``lw`` (1-D, non-empty), as a 0-d tensor;
    ``n`` (default ``lw.numel()``) counts the weights when ``lw`` also holds ``-inf``s, weights of 0."""
    n = lw.numel() if n is None else n
    return 2 * torch.logsumexp(lw, 0) - math.log(n) - torch.logsumexp(2 * lw, 0)


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


def _quantiles_of_ranked(ranked: torch.Tensor, n: int, qs: tuple[float, ...]) -> torch.Tensor:
    """Linear-interpolated quantiles ``qs`` of the ``n`` values that open the sorted 1-D ``ranked``, on its
    device (``q = 0`` and ``q = 1`` are the min and the max exactly: a weight of 0)."""
    lows, fracs = _order_statistics(n, qs)
    highs = [min(lo + 1, n - 1) for lo in lows]
    picked = ranked[torch.tensor(lows + highs, device=ranked.device)]
    k = len(qs)
    return torch.lerp(picked[:k], picked[k:], torch.tensor(fracs, dtype=picked.dtype, device=ranked.device))


def quantiles(values: torch.Tensor, qs: tuple[float, ...] = RATIO_QUANTILES) -> list[float]:
    """Linear-interpolated quantiles of a 1-D tensor (sort based: no size limit, unlike torch.quantile),
    read in one host copy."""
    return _quantiles_of_ranked(values.sort().values, values.numel(), qs).tolist()


def ratio_stats(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor) -> dict[str, float]:
    """Behaviour-ratio quantiles, min, max, mean and ESS over valid tokens, in one host read."""
    n = int(valid_B_T.sum())
    if n == 0:
        return {}
    sums = MetricSums(valid_B_T)
    behaviour_diagnostics(sums, log_w_B_T, valid_B_T, n)
    keep = {f"ratio/q{round(q * 100):02d}" for q in RATIO_QUANTILES} | {
        "ratio/min", "ratio/max", "ratio/mean", "mismatch/ess"
    }  # fmt: skip
    return {k: v for k, v in sums.build().to_host().items() if k in keep}


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

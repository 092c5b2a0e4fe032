"""Behaviour-policy corrections: weights and masks computed once per global batch, no grad.

All work on the behaviour log-ratio ``l_t = log w_t = logp_old_t - logp_mu_t``
(learner at batch start vs the sampler that generated the token, which folds in
both staleness and train/inference mismatch) over the ``valid`` tokens (loss
mask and finite sampler log-prob). Comparisons happen in log space so extreme
ratios never overflow.

    TIS token     weight_t = min(w_t, C)                                   (stop-grad)
    TIS sequence  weight_i = min(exp(sum_t l_t), C)                        on every token of i
    token mask    keep_t   = low <= w_t <= high                            ("MIS": mask only)
    IcePop        weight_t = w_t * [low <= w_t <= high]                   (mask AND weight; stop-grad)
    geo mask      keep_i   = low <= exp(mean_t l_t) <= high                (whole sequence)
    veto          keep_i   = not any_t (w_t < floor)                       (whole sequence)
    M2PO          among the active tokens, (A > 0, w > 1) or (A < 0, w < 1), drop those with
                  the largest l_t^2 until their second moment mean_{kept active} l_t^2 <= tau
    OPSM          keep_i   = not (A_i < 0 and mean_t (logp_mu_t - logp_t) > delta)   (DeepSeek-V3.2)
                  with ``logp`` the CURRENT policy: unlike the others it is evaluated at every
                  optimizer step (``opsm_mask``, called from ``policy_loss``), not once per batch

A masked token contributes nothing to the numerator but stays in the loss
denominator (masking acts as an importance weight of 0), so the step size does
not grow when a correction rejects many tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def tis_token_weights(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, c: float) -> torch.Tensor:
    """``weight_t = min(w_t, C)`` on valid tokens (1 elsewhere)."""
    weight = torch.exp(log_w_B_T.clamp(max=math.log(c)))
    return torch.where(valid_B_T, weight, 1.0)


def tis_token_truncated(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, c: float) -> torch.Tensor:
    """The valid tokens ``tis_token_weights`` caps (``w_t > C``): its diagnostic, apart, so a caller
    that does not report it launches nothing for it."""
    return valid_B_T & (log_w_B_T > math.log(c))


def tis_sequence_weights(
    log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, c: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight_i = min(prod_t w_t, C)`` broadcast to the sequence's valid tokens; returns (weight_B_T, truncated_B)."""
    log_c = math.log(c)
    log_seq_B = torch.where(valid_B_T, log_w_B_T, 0.0).sum(dim=1)
    weight_B = torch.exp(log_seq_B.clamp(max=log_c))
    truncated_B = valid_B_T.any(dim=1) & (log_seq_B > log_c)
    return torch.where(valid_B_T, weight_B[:, None], 1.0), truncated_B


def token_mask(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``keep_t = valid_t and low <= w_t <= high``."""
    return valid_B_T & (log_w_B_T >= math.log(low)) & (log_w_B_T <= math.log(high))


def icepop_weights(
    log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop ``weight_t = w_t`` inside ``[low, high]``, else 0; returns (weight_B_T, keep_B_T).

    ``weight`` is 1 off the valid tokens (they are dropped by ``valid`` anyway);
    ``keep`` is the band test alone (the token mask), so masked tokens also show
    up in the keep mask and the masked-fraction diagnostics.
    """
    keep = token_mask(log_w_B_T, valid_B_T, low, high)
    weight = torch.where(keep, torch.exp(log_w_B_T), 0.0)
    return torch.where(valid_B_T, weight, 1.0), keep


def opsm_mask(
    logp_B_T: torch.Tensor,
    behaviour_logp_B_T: torch.Tensor,
    adv_B: torch.Tensor,
    valid_B_T: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """Per-sequence keep (B,) of off-policy sequence masking (no grad).

    ``kl_i = mean_{t valid} (logp_mu_t - logp_t)`` (the k1 estimate of
    ``KL(mu || pi)`` on the sequence's tokens, which were sampled from ``mu``);
    a sequence is dropped when ``A_i < 0 and kl_i > delta``. Rows without valid
    tokens are kept.
    """
    diff = torch.where(valid_B_T, behaviour_logp_B_T - logp_B_T.detach(), 0.0)
    kl_B = diff.sum(dim=1) / valid_B_T.sum(dim=1).clamp(min=1)
    return ~((adv_B < 0) & (kl_B > delta) & valid_B_T.any(dim=1))


def geo_mask(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Per-sequence keep (B,): ``low <= exp(mean_{t valid} l_t) <= high``; rows without valid tokens are kept."""
    n_B = valid_B_T.sum(dim=1)
    mean_B = torch.where(valid_B_T, log_w_B_T, 0.0).sum(dim=1) / n_B.clamp(min=1)
    inside = (mean_B >= math.log(low)) & (mean_B <= math.log(high))
    return inside | (n_B == 0)


def veto_mask(log_w_B_T: torch.Tensor, valid_B_T: torch.Tensor, floor: float) -> torch.Tensor:
    """Per-sequence keep (B,): false when any valid token has ``w_t < floor``."""
    return ~(valid_B_T & (log_w_B_T < math.log(floor))).any(dim=1)


class M2POResult(NamedTuple):
    keep_B_T: torch.Tensor  # bool: the input keep mask minus the M2PO-masked tokens
    masked_B_T: torch.Tensor  # bool: tokens M2PO removed
    active_B_T: torch.Tensor  # bool: kept tokens in the active quadrants (before masking)
    second_moment_before: torch.Tensor  # 0-d float64: mean l^2 over the active tokens
    second_moment_after: torch.Tensor  # 0-d float64: mean l^2 over the active tokens still kept (0 if none)


def m2po_mask(
    log_w_B_T: torch.Tensor, keep_B_T: torch.Tensor, adv_B_T: torch.Tensor, tau: float
) -> M2POResult:
    """M2PO second-moment mask over the global batch (Algorithm 1 of arXiv 2510.01161).

    The trust region acts where PPO's clip would: the active tokens are the kept
    tokens with ``(A > 0, l > 0)`` or ``(A < 0, l < 0)``. With their ``l_t^2``
    sorted descending, ``S`` their sum, ``n`` their count and ``P_k`` the sum of
    the ``k`` largest, removing the top ``k`` leaves ``M2_k = (S - P_k) / (n - k)``
    (``M2_n = 0``). M2PO removes the smallest ``k`` with ``M2_k <= tau``.
    Removing the largest value never raises the mean, so ``M2_k`` is
    non-increasing and the bound always holds afterwards. Inactive tokens (zero
    advantage, or a ratio moving the loss toward the trust region) are never
    masked. Computed in float64.

    On the device throughout, with no host read: every token is sorted, the
    inactive ones last (a key of -1 below any square), so ``n``, ``S = P_n`` and
    ``k`` stay device values, and ``k`` is the first position where the bound
    holds (``M2_n = 0``: one always does). The active tokens' order and prefix
    sums are those of sorting them alone, so the mask is the same.
    """
    active = keep_B_T & (((adv_B_T > 0) & (log_w_B_T > 0)) | ((adv_B_T < 0) & (log_w_B_T < 0)))  # (B, T)
    flat_active = active.flatten()
    squares = log_w_B_T.double().square().flatten()
    desc, order = torch.sort(torch.where(flat_active, squares, -1.0), descending=True, stable=True)
    num = desc.numel()
    n = flat_active.sum()  # 0-d int64 on the device
    prefix = torch.cat([desc.new_zeros(1), desc.clamp(min=0).cumsum(0)])  # P_0 .. P_num (inactive: + 0)
    total = prefix.index_select(0, n.reshape(1))  # S = P_n
    remaining = n - torch.arange(num + 1, dtype=torch.float64, device=desc.device)
    m2_k = torch.where(remaining > 0, (total - prefix) / remaining.clamp(min=1), 0.0)
    # Tolerance for round-off in the prefix sums when a k fits tau exactly.
    k = (m2_k <= tau * (1 + 1e-12)).to(torch.uint8).argmax()  # the first k that fits
    ranks = torch.arange(num, device=desc.device)
    masked_flat = torch.zeros(num, dtype=torch.bool, device=desc.device).scatter(0, order, ranks < k)
    masked = masked_flat.view_as(keep_B_T)
    return M2POResult(
        keep_B_T & ~masked, masked, active, m2_k[0], m2_k.index_select(0, k.reshape(1)).reshape(())
    )

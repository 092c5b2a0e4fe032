"""Per-token policy-gradient losses (to be minimised), before corrections and aggregation.

``logp`` carries grad, ``logp_old`` is the learner's log-prob at batch start
(no grad), ``A`` the sequence advantage broadcast over tokens. The policy ratio
is ``r = exp(clamp(logp - logp_old, -c, c))``; clamping before ``exp`` keeps
the ratio finite whatever the inputs (its gradient is 0 beyond the clamp,
where PPO would clip anyway).

    reinforce  l_t = -A * logp_t
    ppo        l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)         (clip-higher: eps_high > eps_low)
    cispo      l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logp_t
    gspo       l_t = -min(s_t A, clip(s_t, 1 - eps_low, 1 + eps_high) A),
               s_t = sg(s_i) * exp(logp_t - sg(logp_t)),  s_i = exp(mean_{t in i} (logp_t - logp_old_t))
    sapo       l_t = -(4 / tau_t) * sigmoid(tau_t (r_t - 1)) * A,   tau_t = tau_pos if A > 0 else tau_neg
               (Soft Adaptive Policy Optimization, arXiv 2511.20347). Its gradient is
               -g_t A grad logp_t with the soft gate g_t = 4 sigmoid(.) (1 - sigmoid(.)) r_t: 1 at r = 1,
               decaying smoothly as r leaves 1 (faster for the larger tau) instead of a hard cut.

Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; ``dual_clip_c = c > 1 + eps_high``)
bounds the PPO / GSPO loss of a negative-advantage token from above:

    A < 0:  l_t = min(l_t^ppo, -c A)          (= |A| * min(max(r, clip(r)), c))

so a token whose ratio exploded (r > c) while its advantage is negative stops
pushing (its gradient is 0) instead of contributing ``r |A|``.

All five have the same gradient on-policy (``r = 1``, nothing clipped):
``-A * grad logp_t``. They differ off-policy: PPO zeroes the gradient of a token
whose clipped term is active; CISPO only caps the token's weight, so every token
keeps a gradient; GSPO clips the whole sequence on its length-normalised ratio.
GSPO's per-token value equals the sequence loss, so mean-of-token-means
aggregation reproduces GSPO's sequence-mean objective exactly, and a one-token
sequence reproduces token-level PPO.

Where ``logp_old`` is ``sg(logp)`` itself (one optimizer step per batch, the proximal log-probs taken
from the loss forward), ``r = 1`` exactly and ``proximal_is_current_loss`` gives each loss's value at
``r = 1`` with that gradient, without computing a ratio or a clip.

Each function returns a ``TokenLoss``: the per-token loss and the tokens where
a clip bound is active (``clipped_low`` / ``clipped_high``): for PPO and GSPO
those tokens get no gradient; for CISPO their weight is capped. ``dual_clipped``
marks the tokens cut by the dual clip, ``gate`` SAPO's soft gate ``g_t``
(None for the other losses).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from labrl.errors import ConfigError


class TokenLoss(NamedTuple):
    loss_B_T: torch.Tensor
    ratio_B_T: torch.Tensor  # detached policy ratio (sequence ratio for gspo)
    clipped_low_B_T: torch.Tensor  # bool
    clipped_high_B_T: torch.Tensor  # bool
    dual_clipped_B_T: torch.Tensor | None = None  # bool, only when a dual clip is set
    gate_B_T: torch.Tensor | None = None  # SAPO's soft gate g_t (detached)


def _ratio(logp_B_T: torch.Tensor, logp_old_B_T: torch.Tensor, clamp: float) -> torch.Tensor:
    return torch.exp((logp_B_T - logp_old_B_T).clamp(-clamp, clamp))


def reinforce_loss(
    logp_B_T: torch.Tensor, logp_old_B_T: torch.Tensor, adv_B_T: torch.Tensor, clamp: float = 20.0
) -> TokenLoss:
    """``l_t = -A * logp_t`` (plain policy gradient; no ratio, never clips)."""
    never = torch.zeros_like(logp_B_T, dtype=torch.bool)
    ratio = _ratio(logp_B_T.detach(), logp_old_B_T, clamp)
    return TokenLoss(-adv_B_T * logp_B_T, ratio, never, never)


def _clipped_surrogate(
    ratio_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None = None,
) -> TokenLoss:
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    unclipped = ratio_B_T * adv_B_T
    clipped = ratio_B_T.clamp(lo, hi) * adv_B_T
    loss = -torch.minimum(unclipped, clipped)
    r = ratio_B_T.detach()
    # The clipped branch is the minimum (gradient 0) exactly in these two quadrants.
    clipped_low = (adv_B_T < 0) & (r < lo)
    clipped_high = (adv_B_T > 0) & (r > hi)
    if dual_clip_c is None:
        return TokenLoss(loss, r, clipped_low, clipped_high)
    # With c > 1 + eps_high, the bound -c A is below the PPO loss of an A < 0 token exactly when r > c.
    dual = (adv_B_T < 0) & (r > dual_clip_c)
    loss = torch.where(dual, -dual_clip_c * adv_B_T, loss)
    return TokenLoss(loss, r, clipped_low, clipped_high, dual)


def ppo_loss(
    logp_B_T: torch.Tensor,
    logp_old_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    clamp: float = 20.0,
    dual_clip_c: float | None = None,
) -> TokenLoss:
    """``l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)``, ``r_t = exp(logp_t - logp_old_t)``;
    with ``dual_clip_c``, ``l_t = min(l_t, -c A)`` where ``A < 0``."""
    return _clipped_surrogate(_ratio(logp_B_T, logp_old_B_T, clamp), adv_B_T, eps_low, eps_high, dual_clip_c)


def cispo_loss(
    logp_B_T: torch.Tensor,
    logp_old_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    clamp: float = 20.0,
) -> TokenLoss:
    """``l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * logp_t``: the weight is capped, the gradient kept."""
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    r = _ratio(logp_B_T.detach(), logp_old_B_T, clamp)
    weight = r.clamp(lo, hi)
    loss = -weight * adv_B_T * logp_B_T
    return TokenLoss(loss, r, r < lo, r > hi)


def sequence_log_ratio(
    logp_B_T: torch.Tensor, logp_old_B_T: torch.Tensor, valid_B_T: torch.Tensor
) -> torch.Tensor:
    """``log s_i = mean_{t valid} (logp_t - logp_old_t)`` per row, shape (B,); 0 for rows without valid tokens."""
    diff = torch.where(valid_B_T, logp_B_T - logp_old_B_T, 0.0)
    n = valid_B_T.sum(dim=1).clamp(min=1)
    return diff.sum(dim=1) / n


def gspo_loss(
    logp_B_T: torch.Tensor,
    logp_old_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    valid_B_T: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    clamp: float = 20.0,
    dual_clip_c: float | None = None,
) -> TokenLoss:
    """GSPO-token: PPO clip on ``s_t = sg(s_i) * exp(logp_t - sg(logp_t))``, ``s_i`` the length-normalised
    sequence ratio ``exp(mean_t (logp_t - logp_old_t))``; ``dual_clip_c`` as in ``ppo_loss``."""
    log_s_B = sequence_log_ratio(logp_B_T.detach(), logp_old_B_T, valid_B_T).clamp(-clamp, clamp)
    # Value s_i on every token; gradient s_i * grad logp_t per token.
    log_s_B_T = log_s_B[:, None] + (logp_B_T - logp_B_T.detach())
    return _clipped_surrogate(torch.exp(log_s_B_T), adv_B_T, eps_low, eps_high, dual_clip_c)


def sapo_loss(
    logp_B_T: torch.Tensor,
    logp_old_B_T: torch.Tensor,
    adv_B_T: torch.Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    clamp: float = 20.0,
) -> TokenLoss:
    """SAPO: ``l_t = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A``, ``tau_t = tau_pos if A > 0 else tau_neg``.

    No token is hard-clipped (``clipped_low`` / ``clipped_high`` are all false);
    ``gate`` holds the soft gate ``g_t = 4 sigmoid(x)(1 - sigmoid(x)) r_t``,
    ``x = tau_t (r_t - 1)``, the factor SAPO puts on the REINFORCE gradient.
    """
    r = _ratio(logp_B_T, logp_old_B_T, clamp)
    tau = torch.full_like(r.detach(), tau_neg).masked_fill(adv_B_T > 0, tau_pos)
    sig = torch.sigmoid(tau * (r - 1.0))
    loss = -(4.0 / tau) * sig * adv_B_T
    r_d, sig_d = r.detach(), sig.detach()
    never = torch.zeros_like(r_d, dtype=torch.bool)
    return TokenLoss(loss, r_d, never, never, gate_B_T=4.0 * sig_d * (1.0 - sig_d) * r_d)


def proximal_is_current_loss(
    loss: str, logp_B_T: torch.Tensor, adv_B_T: torch.Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> torch.Tensor:
    """The per-token ``loss`` where ``logp_old = sg(logp)``: ``r = exp(0) = 1`` on every token, nothing
    clips, and each loss is its value at ``r = 1`` with the gradient ``-A grad logp_t``:

        reinforce, cispo   l_t = -A logp_t                       (clip(1) = 1: CISPO's weight is 1)
        ppo, gspo          l_t = -A (1 + logp_t - sg(logp_t))    (min(A, clip(1) A) = A; s_i = 1;
                                                                   a dual clip needs r > c > 1)
        sapo               l_t = -A (2 / tau_t + logp_t - sg(logp_t))   (4 sigmoid(0) / tau_t = 2 / tau_t;
                                                                   its gate g_t = 1)

    Values and gradients equal the loss functions' with ``logp_old = sg(logp)``, up to the order of
    their products (bit-equal for reinforce and cispo), in two to six launches where those take nine
    to fifteen (the ratio, its clamps, the clip flags)."""
    if loss in ("reinforce", "cispo"):
        return -adv_B_T * logp_B_T
    step = logp_B_T - logp_B_T.detach()  # 0, with the gradient of logp
    if loss in ("ppo", "gspo"):
        return -adv_B_T * (step + 1.0)
    if loss == "sapo":
        tau = torch.where(adv_B_T > 0, tau_pos, tau_neg)
        return -adv_B_T * (step + 2.0 / tau)
    raise ConfigError(f"loss must be reinforce, ppo, cispo, gspo or sapo (got {loss!r})")

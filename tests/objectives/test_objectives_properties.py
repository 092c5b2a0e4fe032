"""Property tests: extreme log-ratios (+-50), non-finite sampler log-probs and empty masks stay finite."""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labrl.harness.objectives import (
    M2PO,
    TIS,
    GeoMask,
    ObjectiveConfig,
    ObjectiveInputs,
    TokenMask,
    Veto,
    m2po_mask,
    policy_loss,
    prepare,
)

CORRECTIONS = [TIS(c=2.0), TIS(level="sequence"), TokenMask(), GeoMask(), Veto(), M2PO()]
LOG_RATIO = st.floats(min_value=-50.0, max_value=50.0, allow_nan=False)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    n = B * T
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    old = draw(st.lists(st.floats(-30.0, 0.0), min_size=n, max_size=n))
    log_w = draw(st.lists(LOG_RATIO, min_size=n, max_size=n))
    policy_shift = draw(st.lists(LOG_RATIO, min_size=n, max_size=n))
    special = draw(st.lists(st.sampled_from([None, math.nan, -math.inf, math.inf]), min_size=n, max_size=n))
    rewards = draw(st.lists(st.floats(-1e3, 1e3), min_size=B, max_size=B))
    groups = draw(st.lists(st.integers(0, 2), min_size=B, max_size=B))
    old_t = torch.tensor(old).view(B, T)
    mu = old_t - torch.tensor(log_w).view(B, T)
    for i, s in enumerate(special):  # sampler log-probs that are sometimes nan / inf
        if s is not None and i % 3 == 0:
            mu.view(-1)[i] = s
    mask_t = torch.tensor(mask).view(B, T)
    inputs = ObjectiveInputs(
        loss_mask_B_T=mask_t,
        old_logprobs_B_T=old_t,
        behaviour_logprobs_B_T=mu,
        versions_B_T=torch.where(mask_t, 0, -1),
        rewards_B=torch.tensor(rewards),
        group_ids_B=torch.tensor(groups),
        learner_version=3,
        ref_logprobs_B_T=old_t - torch.tensor(log_w).view(B, T),
    )
    return inputs, old_t + torch.tensor(policy_shift).view(B, T)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=batches(),
    loss=st.sampled_from(["reinforce", "ppo", "cispo", "gspo"]),
    agg=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_sum_constant"]),
    advantages=st.sampled_from(["grpo", "dr_grpo", "rloo", "whiten"]),
    corrections=st.lists(st.sampled_from(CORRECTIONS), unique_by=lambda c: c.name, max_size=6),
)
def test_loss_grad_and_metrics_are_finite(data, loss, agg, advantages, corrections) -> None:
    inputs, logp = data
    cfg = ObjectiveConfig(
        loss=loss,
        aggregation=agg,
        aggregation_constant=16.0 if agg == "seq_sum_constant" else None,
        advantages=advantages,
        corrections=corrections,
        kl_coef=0.01,
    )
    prepared = prepare(cfg, inputs)
    logp = logp.clone().requires_grad_(True)
    out, metrics = policy_loss(cfg, logp, prepared)
    out.backward()
    assert torch.isfinite(out)
    assert torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in prepared.metrics.values()), prepared.metrics
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if not prepared.valid_B_T.any():  # empty mask: nothing to learn, exactly zero
        assert out.item() == 0.0 and (logp.grad == 0).all()
    assert not (logp.grad[~prepared.valid_B_T] != 0).any()  # nothing leaks off the mask


@settings(max_examples=60, deadline=None)
@given(
    log_w=st.lists(LOG_RATIO, min_size=1, max_size=24),
    adv=st.lists(st.floats(-5, 5), min_size=1, max_size=24),
    keep=st.lists(st.booleans(), min_size=1, max_size=24),
    tau=st.floats(1e-4, 10.0),
)
def test_m2po_bound_and_quadrants(log_w, adv, keep, tau) -> None:
    n = min(len(log_w), len(adv), len(keep))
    lw = torch.tensor(log_w[:n], dtype=torch.float64)[None]
    a = torch.tensor(adv[:n], dtype=torch.float64)[None]
    k = torch.tensor(keep[:n])[None]
    res = m2po_mask(lw, k, a, tau)
    active_kept = res.active_B_T & res.keep_B_T
    m2 = lw[active_kept].square().mean().item() if active_kept.any() else 0.0
    assert m2 <= tau * (1 + 1e-9)
    assert not (res.masked_B_T & ~res.active_B_T).any()
    assert not (res.masked_B_T & ~k).any()
    if res.second_moment_before <= tau:
        assert not res.masked_B_T.any()

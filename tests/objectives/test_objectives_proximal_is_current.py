"""``policy_loss(..., proximal_is_current=True)``: where ``pi_prox`` is the loss forward itself, the same
loss, gradient and metrics as the general path, without the ratio and clip terms."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labrl.errors import ConfigError
from labrl.harness.objectives import (
    M2PO,
    OPSM,
    TIS,
    ObjectiveConfig,
    TokenMask,
    combine_metrics,
    policy_loss,
    prepare,
    proximal_is_current_loss,
    proximal_is_current_metrics,
)

RATIO_METRICS = {
    "policy/clip_low_frac",
    "policy/clip_high_frac",
    "policy/clip_frac",
    "policy/ratio_mean",
    "policy/abs_log_ratio_mean",
    "policy/dual_clip_frac",
    "policy/sapo_gate_mean",
}

CONFIGS = {
    "reinforce": ObjectiveConfig(loss="reinforce"),
    "cispo-tis (the default)": ObjectiveConfig(),
    "cispo-m2po-kl (the quickstart's)": ObjectiveConfig(corrections=[M2PO(tau=0.04)], kl_coef=0.1),
    "ppo-dual-seqmean-opsm": ObjectiveConfig(
        loss="ppo", dual_clip_c=3.0, aggregation="seq_mean_token_mean", corrections=[TIS(), OPSM(delta=0.05)]
    ),
    "gspo-dual-tokenmask": ObjectiveConfig(
        loss="gspo", dual_clip_c=2.0, corrections=[TokenMask(low=0.8, high=1.25)]
    ),
    "sapo-seqsum": ObjectiveConfig(loss="sapo", aggregation="seq_sum_constant", aggregation_constant=16.0),
}
BIT_EQUAL = {"reinforce", "cispo"}  # -A logp in both paths: same products in the same order


def _prepared(cfg: ObjectiveConfig, make_batch, seed: int = 3):
    """A batch whose ``old`` is exactly what ``batch.logprobs(batch.param())`` computes, as the learner's
    loss forward fills it in."""
    batch = make_batch(B=7, T=6, seed=seed, log_w_scale=0.4)
    inputs = batch.inputs
    if cfg.kl_coef > 0:
        ref = inputs.old_logprobs_B_T - 0.2 * torch.rand(7, 6, generator=torch.Generator().manual_seed(9))
        inputs = dataclasses.replace(inputs, ref_logprobs_B_T=ref)
    prepared = prepare(cfg, inputs)
    assert torch.equal(batch.logprobs(batch.param()), inputs.old_logprobs_B_T)  # pi_prox is the forward
    return batch, prepared


def _run(cfg, batch, prepared, rows=slice(None), **kw):
    logits = batch.param()
    loss, metrics = policy_loss(cfg, batch.logprobs(logits, rows), prepared.select(rows), **kw)
    loss.backward()
    return loss.detach(), logits.grad, metrics


@pytest.mark.parametrize("name", CONFIGS)
def test_the_loss_gradient_and_metrics_are_the_general_paths(name, make_batch):
    cfg = CONFIGS[name]
    batch, prepared = _prepared(cfg, make_batch)
    loss_g, grad_g, metrics_g = _run(cfg, batch, prepared)
    loss_c, grad_c, metrics_c = _run(cfg, batch, prepared, proximal_is_current=True)
    assert grad_g.abs().max() > 1e-3  # not vacuous
    if cfg.loss in BIT_EQUAL:
        assert torch.equal(loss_c, loss_g) and torch.equal(grad_c, grad_g)
    else:
        torch.testing.assert_close(loss_c, loss_g, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad_c, grad_g, rtol=1e-6, atol=1e-8)
    # the ratio and clip metrics are left out, and are the constants the general path computes
    assert not set(metrics_c) & RATIO_METRICS
    constants = proximal_is_current_metrics(cfg, prepared.num_valid_tokens)
    assert set(metrics_c) | set(constants) == set(metrics_g)
    assert constants["policy/ratio_mean"] == 1.0
    assert {k: metrics_g[k] for k in constants} == pytest.approx(constants, abs=1e-12)
    for key, value in metrics_c.items():
        assert value == pytest.approx(metrics_g[key], rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("name", ["cispo-tis (the default)", "ppo-dual-seqmean-opsm", "sapo-seqsum"])
def test_micro_batches_sum_to_the_whole_batch_with_the_constants_added_once(name, make_batch):
    cfg = CONFIGS[name]
    batch, prepared = _prepared(cfg, make_batch, seed=5)
    _, grad_whole, whole_micro = _run(cfg, batch, prepared)
    whole = combine_metrics(prepared, [whole_micro])  # the general path, one micro-batch
    logits = batch.param()
    micro = []
    for rows in (torch.tensor([4, 0]), torch.tensor([6]), torch.tensor([1, 2, 3, 5])):
        loss, m = policy_loss(
            cfg, batch.logprobs(logits, rows), prepared.select(rows), proximal_is_current=True
        )
        loss.backward()
        micro.append(m)
    torch.testing.assert_close(logits.grad, grad_whole, rtol=0, atol=1e-6)
    combined = combine_metrics(prepared, micro) | proximal_is_current_metrics(cfg, prepared.num_valid_tokens)
    assert set(combined) == set(whole)
    for key, value in whole.items():
        assert combined[key] == pytest.approx(value, abs=1e-6), key


def test_a_batch_without_valid_tokens_has_a_ratio_mean_of_zero_as_the_general_path():
    assert proximal_is_current_metrics(ObjectiveConfig(), 0)["policy/ratio_mean"] == 0.0
    assert "policy/dual_clip_frac" not in proximal_is_current_metrics(ObjectiveConfig(), 5)  # cispo: none
    assert (
        proximal_is_current_metrics(ObjectiveConfig(loss="ppo", dual_clip_c=3.0), 5)["policy/dual_clip_frac"]
        == 0
    )


def test_an_unknown_loss_is_refused():
    with pytest.raises(ConfigError, match="loss must be reinforce, ppo, cispo, gspo or sapo"):
        proximal_is_current_loss("dpo", torch.zeros(2, 3), torch.zeros(2, 3))

"""Autograd checks: on-policy equivalence to REINFORCE, aggregation values, micro-batch invariance."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labrl.harness.objectives import (
    M2PO,
    TIS,
    GeoMask,
    ObjectiveConfig,
    TokenMask,
    Veto,
    aggregate,
    combine_metrics,
    global_denominator,
    policy_loss,
    prepare,
    valid_counts,
)

LOSSES = ["reinforce", "ppo", "cispo", "gspo"]
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_sum_constant"]
ALL_CORRECTIONS = [
    TIS(c=2.0),
    TokenMask(low=0.5, high=5.0),
    GeoMask(low=0.5, high=2.0),
    Veto(floor=1e-4),
    M2PO(tau=0.04),
]


def _cfg(loss: str, agg: str, corrections: list | None = None, **kw) -> ObjectiveConfig:
    const = {"aggregation_constant": 8.0} if agg == "seq_sum_constant" else {}
    return ObjectiveConfig(loss=loss, aggregation=agg, corrections=corrections or [], **const, **kw)


def test_aggregation_hand_values() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
    valid = torch.tensor([[True, True, True], [True, False, False]])
    assert valid_counts(valid) == (4, 2)
    assert global_denominator("token_mean", *valid_counts(valid)) == 4.0
    assert aggregate("token_mean", loss, valid, 4.0).item() == 2.5  # 10 / 4
    assert global_denominator("seq_mean_token_mean", *valid_counts(valid)) == 2.0
    assert aggregate("seq_mean_token_mean", loss, valid, 2.0).item() == 3.0  # (6/3 + 4/1) / 2
    assert global_denominator("seq_sum_constant", *valid_counts(valid), 4.0) == 8.0
    assert aggregate("seq_sum_constant", loss, valid, 8.0).item() == 1.25  # 10 / (4 * 2)


def _on_policy(make_batch):
    sb = make_batch(seed=5)
    # behaviour == learner at batch start: every ratio is 1
    inputs = dataclasses.replace(sb.inputs, behaviour_logprobs_B_T=sb.inputs.old_logprobs_B_T.clone())
    return sb, inputs


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_on_policy_every_loss_has_the_reinforce_gradient(make_batch, agg: str) -> None:
    sb, inputs = _on_policy(make_batch)
    grads = {}
    for loss in LOSSES:
        # all corrections enabled: with every ratio at 1 none of them may act
        cfg = _cfg(loss, agg, ALL_CORRECTIONS)
        prepared = prepare(cfg, inputs)
        assert prepared.metrics["corrections/kept_frac"] == 1.0
        theta = sb.param()
        out, m = policy_loss(cfg, sb.logprobs(theta), prepared)
        out.backward()
        assert m["policy/clip_frac"] == 0.0
        grads[loss] = theta.grad
    # explicit -A * grad(logp) under the same aggregation
    theta = sb.param()
    logp = sb.logprobs(theta)
    valid = prepared.valid_B_T
    per_token = -prepared.advantages_B[:, None] * logp
    if agg == "seq_mean_token_mean":
        per_token = per_token / valid.sum(1, keepdim=True).clamp(min=1)
    (torch.where(valid, per_token, 0.0).sum() / prepared.denominator).backward()
    assert theta.grad.abs().max() > 1e-3  # the check is not vacuous
    for loss in LOSSES:
        torch.testing.assert_close(grads[loss], theta.grad, atol=1e-7, rtol=1e-5, msg=f"{loss} / {agg}")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batches_give_the_whole_batch_gradient(make_batch, loss: str, agg: str) -> None:
    sb = make_batch(B=7, T=6, seed=11, log_w_scale=0.4)
    cfg = _cfg(loss, agg, ALL_CORRECTIONS, kl_coef=0.05)
    inputs = dataclasses.replace(sb.inputs, ref_logprobs_B_T=sb.inputs.old_logprobs_B_T - 0.1)
    prepared = prepare(cfg, inputs)
    assert 0 < prepared.metrics["corrections/kept_frac"] < 1  # corrections act on this batch
    # the learner has moved since batch start, so policy ratios differ from 1 and clipping happens
    shift = 0.3 * torch.randn(sb.logits_B_T_V.shape, generator=torch.Generator().manual_seed(2))
    start = sb.logits_B_T_V + shift

    theta = start.clone().requires_grad_(True)
    whole, whole_m = policy_loss(cfg, sb.logprobs(theta), prepared)
    whole.backward()
    grad_whole = theta.grad.clone()

    theta = start.clone().requires_grad_(True)
    parts = [torch.tensor([4, 0]), torch.tensor([6]), torch.tensor([1, 2, 3, 5])]  # any order, any sizes
    total = 0.0
    micro_metrics = []
    for rows in parts:
        out, m = policy_loss(cfg, sb.logprobs(theta, rows), prepared.select(rows))
        out.backward()
        total += out.item()
        micro_metrics.append(m)
    torch.testing.assert_close(theta.grad, grad_whole, atol=1e-6, rtol=0)
    assert total == pytest.approx(whole.item(), abs=1e-6)
    combined = combine_metrics(prepared, micro_metrics)
    for key, value in whole_m.items():
        assert combined[key] == pytest.approx(value, abs=1e-6), key
    if loss != "reinforce":
        assert whole_m["policy/clip_frac"] > 0


def test_per_microbatch_denominator_would_differ(make_batch) -> None:
    # The reason for the global denominator: normalising each micro-batch by its own count changes the gradient.
    sb = make_batch(B=6, T=5, seed=4)
    cfg = _cfg("cispo", "token_mean")
    prepared = prepare(cfg, sb.inputs)
    theta = sb.param()
    policy_loss(cfg, sb.logprobs(theta), prepared)[0].backward()
    grad_whole = theta.grad.clone()
    theta = sb.param()
    for rows in (torch.tensor([0]), torch.tensor([1, 2, 3, 4, 5])):
        micro = prepared.select(rows)
        local = dataclasses.replace(micro, denominator=float(micro.valid_B_T.sum()))
        (policy_loss(cfg, sb.logprobs(theta, rows), local)[0] / 2).backward()
    assert (theta.grad - grad_whole).abs().max() > 1e-4


def test_masked_tokens_get_no_gradient(make_batch) -> None:
    sb = make_batch(seed=8, log_w_scale=1.5)
    cfg = _cfg("cispo", "token_mean", [TokenMask(low=0.5, high=2.0)])
    prepared = prepare(cfg, sb.inputs)
    dropped = prepared.valid_B_T & ~prepared.keep_B_T
    assert dropped.any()
    logp = sb.logprobs(sb.logits_B_T_V).clone().requires_grad_(True)
    policy_loss(cfg, logp, prepared)[0].backward()
    assert (logp.grad[dropped] == 0).all()
    assert (logp.grad[prepared.keep_B_T & (prepared.advantages_B[:, None] != 0)] != 0).all()


def test_reference_kl_term(make_batch) -> None:
    sb = make_batch(seed=9)
    inputs = dataclasses.replace(sb.inputs, ref_logprobs_B_T=sb.inputs.old_logprobs_B_T - 0.5)
    base = _cfg("reinforce", "token_mean")
    with_kl = _cfg("reinforce", "token_mean", kl_coef=0.1, kl_estimator="k1")
    logp = sb.logprobs(sb.logits_B_T_V)
    l0, _ = policy_loss(base, logp, prepare(base, inputs))
    l1, m1 = policy_loss(with_kl, logp, prepare(with_kl, inputs))
    # k1 = logp - ref = 0.5 on every valid token; token mean 0.5; times 0.1
    assert (l1 - l0).item() == pytest.approx(0.05, abs=1e-6)
    assert m1["loss/ref_kl"] == pytest.approx(0.05, abs=1e-6)
    assert m1["ref_kl/k1"] == pytest.approx(0.5, abs=1e-6)
    assert "loss/ref_kl" not in policy_loss(base, logp, prepare(base, inputs))[1]  # off by default


def test_nonfinite_behaviour_logprobs_are_dropped(make_batch) -> None:
    sb = make_batch(seed=6)
    mu = sb.inputs.behaviour_logprobs_B_T.clone()
    mu[0, 0], mu[2, 0] = float("nan"), float("-inf")
    bad = dataclasses.replace(sb.inputs, behaviour_logprobs_B_T=mu)
    mask = sb.inputs.loss_mask_B_T.clone()
    mask[0, 0] = mask[2, 0] = False
    clean = dataclasses.replace(sb.inputs, loss_mask_B_T=mask)
    cfg = _cfg("ppo", "token_mean", [TIS()])
    pb, pc = prepare(cfg, bad), prepare(cfg, clean)
    assert pb.metrics["tokens/nonfinite_behaviour"] == 2.0
    assert pb.denominator == pc.denominator == float(mask.sum())
    logp = sb.logprobs(sb.logits_B_T_V + 0.1)
    torch.testing.assert_close(policy_loss(cfg, logp, pb)[0], policy_loss(cfg, logp, pc)[0])

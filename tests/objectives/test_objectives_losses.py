"""Policy losses: hand-computed values and gradients, clipping behaviour, KL estimators."""

from __future__ import annotations

import math

import pytest
import torch

from labrl.harness.objectives import (
    cispo_loss,
    gspo_loss,
    kl_estimate,
    ppo_loss,
    reinforce_loss,
    sequence_log_ratio,
)

# Four tokens covering the four (sign A, r vs 1) quadrants: r = 1.5, 1.5, 0.5, 0.5.
OLD = torch.zeros(1, 4)
DIFF = torch.tensor([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)]])
ADV = torch.tensor([[1.0, -1.0, 1.0, -1.0]])


def _grad(fn, diff: torch.Tensor = DIFF) -> tuple[torch.Tensor, torch.Tensor]:
    logp = (OLD + diff).clone().requires_grad_(True)
    out = fn(logp)
    out.loss_B_T.sum().backward()
    return out.loss_B_T.detach(), logp.grad


def test_reinforce_values_and_grad() -> None:
    loss, grad = _grad(lambda lp: reinforce_loss(lp, OLD, ADV))
    assert loss.tolist()[0] == pytest.approx([-math.log(1.5), math.log(1.5), -math.log(0.5), math.log(0.5)])
    assert grad.tolist()[0] == [-1.0, 1.0, -1.0, 1.0]


def test_ppo_clip_higher_values_and_grads() -> None:
    out = ppo_loss((OLD + DIFF), OLD, ADV, eps_low=0.2, eps_high=0.28)
    # A>0, r=1.5 -> clipped at 1.28; A<0, r=1.5 -> unclipped 1.5; A>0, r=0.5 -> 0.5; A<0, r=0.5 -> clipped 0.8
    assert out.loss_B_T.tolist()[0] == pytest.approx([-1.28, 1.5, -0.5, 0.8], abs=1e-6)
    assert out.clipped_high_B_T.tolist()[0] == [True, False, False, False]
    assert out.clipped_low_B_T.tolist()[0] == [False, False, False, True]
    _, grad = _grad(lambda lp: ppo_loss(lp, OLD, ADV, 0.2, 0.28))
    # d/dlogp of -r*A is -A*r; clipped tokens get exactly 0
    assert grad.tolist()[0] == pytest.approx([0.0, 1.5, -0.5, 0.0], abs=1e-6)


def test_cispo_keeps_gradient_where_ppo_zeroes_it() -> None:
    out = cispo_loss((OLD + DIFF), OLD, ADV, eps_low=0.2, eps_high=0.28)
    assert out.clipped_high_B_T.tolist()[0] == [True, True, False, False]
    assert out.clipped_low_B_T.tolist()[0] == [False, False, True, True]
    _, grad_cispo = _grad(lambda lp: cispo_loss(lp, OLD, ADV, 0.2, 0.28))
    _, grad_ppo = _grad(lambda lp: ppo_loss(lp, OLD, ADV, 0.2, 0.28))
    # weight sg(clip(r, 0.8, 1.28)) * A, gradient -w*A: never zero
    assert grad_cispo.tolist()[0] == pytest.approx([-1.28, 1.28, -0.8, 0.8], abs=1e-6)
    clipped = torch.tensor([True, False, False, True])
    assert (grad_cispo[0][clipped] != 0).all()
    assert (grad_ppo[0][clipped] == 0).all()


def test_cispo_default_has_no_lower_bound() -> None:
    _, grad = _grad(lambda lp: cispo_loss(lp, OLD, ADV))  # eps_low=1.0: weight floor 0
    assert grad.tolist()[0] == pytest.approx([-1.28, 1.28, -0.5, 0.5], abs=1e-6)


def test_gspo_sequence_ratio_values_and_grads() -> None:
    old = torch.zeros(2, 2)
    diff = torch.tensor([[math.log(1.2), math.log(0.9)], [math.log(1.0002), math.log(1.0002)]])
    adv = torch.tensor([[-1.0, -1.0], [1.0, 1.0]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    s0 = math.sqrt(1.2 * 0.9)  # exp(mean log) = geometric mean = 1.03923
    assert sequence_log_ratio(old + diff, old, valid).exp().tolist() == pytest.approx([s0, 1.0002], abs=1e-6)
    logp = (old + diff).clone().requires_grad_(True)
    out = gspo_loss(logp, old, adv, valid, eps_low=3e-4, eps_high=4e-4)
    # row 0: A<0, s=1.039 > 1+eps: unclipped branch s*|A|, grad s per token; row 1: inside the band
    expected = torch.tensor([[s0, s0], [-1.0002, -1.0002]])
    torch.testing.assert_close(out.loss_B_T, expected, atol=1e-6, rtol=0)
    out.loss_B_T.sum().backward()
    torch.testing.assert_close(logp.grad, expected, atol=1e-5, rtol=0)


def test_gspo_clips_whole_sequence() -> None:
    old = torch.zeros(1, 3)
    logp = torch.tensor([[0.01, 0.0, 0.0]], requires_grad=True)  # s = exp(0.01/3) = 1.00334 > 1.0004
    out = gspo_loss(logp, old, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool))
    out.loss_B_T.sum().backward()
    assert out.clipped_high_B_T.tolist() == [[True, True, True]]
    assert logp.grad.tolist() == [[0.0, 0.0, 0.0]]
    assert out.loss_B_T.tolist()[0] == pytest.approx([-1.0004] * 3, abs=1e-6)


def test_gspo_on_one_token_sequences_equals_token_ppo() -> None:
    old = -torch.linspace(0.1, 2.0, 8)[:, None]
    diff = torch.tensor([-0.8, -0.3, -0.1, 0.0, 0.1, 0.3, 0.8, -0.5])[:, None]
    adv = torch.tensor([-1.0, 1.0, -0.5, 2.0, 1.0, -1.0, 0.7, 1.5])[:, None]
    valid = torch.ones(8, 1, dtype=torch.bool)
    lp1 = (old + diff).clone().requires_grad_(True)
    lp2 = (old + diff).clone().requires_grad_(True)
    a = gspo_loss(lp1, old, adv, valid, eps_low=0.2, eps_high=0.28)
    b = ppo_loss(lp2, old, adv, eps_low=0.2, eps_high=0.28)
    a.loss_B_T.sum().backward()
    b.loss_B_T.sum().backward()
    torch.testing.assert_close(a.loss_B_T, b.loss_B_T)
    torch.testing.assert_close(lp1.grad, lp2.grad)
    assert torch.equal(a.clipped_high_B_T, b.clipped_high_B_T)
    assert b.clipped_high_B_T.any() and b.clipped_low_B_T.any()  # the data exercises both clips


def test_ratio_clamped_before_exp() -> None:
    old = torch.zeros(1, 2)
    logp = torch.tensor([[100.0, -100.0]], requires_grad=True)
    out = ppo_loss(logp, old, torch.tensor([[-1.0, 1.0]]), clamp=20.0)
    assert out.ratio_B_T.tolist()[0] == pytest.approx([math.exp(20), math.exp(-20)], rel=1e-6)
    out.loss_B_T.sum().backward()
    assert torch.isfinite(out.loss_B_T).all() and torch.isfinite(logp.grad).all()


def test_kl_estimators_hand_values() -> None:
    sampled, other = torch.tensor([0.0]), torch.tensor([math.log(0.5)])  # log r = -log 2
    assert kl_estimate(sampled, other, "k1").item() == pytest.approx(math.log(2), abs=1e-7)
    assert kl_estimate(sampled, other, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2, abs=1e-7)
    assert kl_estimate(sampled, other, "k3").item() == pytest.approx(0.5 - 1 + math.log(2), abs=1e-7)


def test_kl_estimators_unbiased_on_a_known_distribution() -> None:
    # q = (0.5, 0.5), p = (0.8, 0.2): KL(q||p) = 0.5 log(0.5/0.8) + 0.5 log(0.5/0.2)
    q, p = torch.tensor([0.5, 0.5]).log(), torch.tensor([0.8, 0.2]).log()
    exact = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    for kind in ("k1", "k3"):  # expectation under q = mean over the two equally likely outcomes
        assert kl_estimate(q, p, kind).mean().item() == pytest.approx(exact, abs=1e-6)
    assert (kl_estimate(q, p, "k3") >= 0).all()

"""MegatronLearner: objective decreases, checkpoints resume exactly, LR schedule, bad input."""

import math
import re

import pytest
import torch

from labrl.errors import ConfigError, LearnerError
from labrl.harness import objectives
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig


def _objective(learner, batch, prepared):
    logp = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
    loss, _ = objectives.policy_loss(learner.config.objective, logp, prepared)
    return float(loss)


def test_one_step_lowers_the_objective(h):
    # REINFORCE's loss value is the surrogate the gradient descends (CISPO's re-evaluates its
    # stop-gradient weights at the new point); Adam's first step moves each weight by ~lr.
    learner = MegatronLearner(
        LearnerConfig(
            micro_batch_size=3,
            optimizer=OptimizerConfig(lr=1e-4),
            objective=objectives.ObjectiveConfig(loss="reinforce"),
        )
    )
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=8, max_new=12, seed=11)
    old = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
    prepared = objectives.prepare(
        learner.config.objective, objectives.ObjectiveInputs.from_train_batch(batch, old, learner.version)
    )
    before = _objective(learner, batch, prepared)
    version = learner.version
    metrics = learner.train_step(batch)
    after = _objective(learner, batch, prepared)
    assert after < before, (before, after)
    assert learner.version == version + 1
    assert metrics["learner/grad_norm"] > 0 and metrics["learner/tokens_per_s"] > 0
    assert metrics["learner/router_replay"] == 1.0
    assert metrics["tokens/valid"] == float(batch.loss_mask_B_T.sum())
    assert metrics["mismatch/kl_k3"] < 1e-8  # fp32 sampler, same weights


def test_checkpoint_resume_gives_the_identical_next_step(learner, h, tmp_path):
    batch_a = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=21)
    learner.train_step(batch_a)
    path = str(tmp_path / "ckpt" / "learner.pt")
    learner.save_checkpoint(path)
    batch_b = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=22)
    m1 = learner.train_step(batch_b)
    w1 = learner.export_weights()
    resumed = MegatronLearner(learner.config.model_copy(update={"seed": 99}))
    resumed.load_checkpoint(path)
    assert (resumed.step, resumed.version) == (learner.step - 1, learner.version - 1)
    m2 = resumed.train_step(batch_b)
    w2 = resumed.export_weights()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    for key in ("loss/total", "learner/grad_norm", "learner/lr"):
        assert m1[key] == m2[key]
    with pytest.raises(LearnerError, match=re.escape("cannot read checkpoint")):
        resumed.load_checkpoint(str(tmp_path / "missing.pt"))


def test_lr_schedule_warmup_then_cosine():
    opt = OptimizerConfig(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=10, min_lr_ratio=0.1)
    factor = opt.lr_factor
    assert [factor(0), factor(1)] == [1 / 3, 2 / 3]
    assert factor(2) == pytest.approx(1.0)
    assert factor(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factor(10) == pytest.approx(0.1) and factor(50) == pytest.approx(0.1)
    with pytest.raises(ValueError, match=re.escape("schedule='cosine' needs total_steps")):
        OptimizerConfig(schedule="cosine")


def test_bad_routed_experts_are_refused(learner, h):
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=2, max_new=4, seed=3)
    batch.routed_experts_B_T_L_K = batch.routed_experts_B_T_L_K[:, :, :3]
    T = batch.tokens_B_T.shape[1]
    with pytest.raises(ConfigError, match=re.escape(f"has shape (2, {T}, 3, 2), expected (2, {T}, 4, 2)")):
        learner.train_step(batch)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_the_logits_over_the_temperature(learner, temperature):
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    learner.config = learner.config.model_copy(update={"temperature": temperature})
    try:
        with torch.no_grad():
            got = learner.logprobs(tokens)
            logits = learner._logits(tokens).float()
    finally:
        learner.config = learner.config.model_copy(update={"temperature": 1.0})
    want = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert got[:, 0].eq(0).all()
    assert torch.equal(got[:, 1:], want)  # bit for bit: skipping the division at 1.0 changes nothing


@pytest.mark.parametrize("clip", [None, 1e-3])
def test_grad_norm_is_the_global_l2_norm_and_clipping_scales_to_it(h, clip):
    learner = MegatronLearner(
        LearnerConfig(
            micro_batch_size=4,
            optimizer=OptimizerConfig(lr=1e-4, grad_clip=clip),
            objective=objectives.ObjectiveConfig(loss="reinforce"),
        )
    )
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=8, max_new=12, seed=5)
    metrics = learner.train_step(batch)
    # the gradients stay on the parameters until the next step: their norm after any clipping
    left = math.sqrt(
        sum(float(p.grad.double().square().sum()) for p in learner.model.parameters() if p.grad is not None)
    )
    if clip is None:
        assert left == pytest.approx(metrics["learner/grad_norm"], rel=1e-9)
    else:
        assert metrics["learner/grad_norm"] > 10 * clip  # clipped: scaled down to the bound
        assert left == pytest.approx(clip, rel=1e-4)

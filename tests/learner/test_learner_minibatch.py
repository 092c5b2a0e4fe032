"""Mini-batches and epochs per batch, non-finite skips, and the policy versions in checkpoints."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from labrl.errors import ConfigError, LearnerError
from labrl.harness import objectives
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig


def _reference_single_step(learner: MegatronLearner, batch) -> None:
    """The one-step-per-batch algorithm as it was before mini-batching, written out with public pieces."""
    cfg = learner.config
    old = learner.logprobs(batch.tokens_B_T, batch.routed_experts_B_T_L_K)
    prepared = objectives.prepare(
        cfg.objective, objectives.ObjectiveInputs.from_train_batch(batch, old, learner.version)
    )
    learner.optimizer.zero_grad(set_to_none=True)
    for start in range(0, batch.batch_size, cfg.micro_batch_size):
        rows = torch.arange(start, min(start + cfg.micro_batch_size, batch.batch_size))
        logp = learner._logprobs_with_grad(batch.tokens_B_T[rows], batch.routed_experts_B_T_L_K[rows])
        loss, _ = objectives.policy_loss(cfg.objective, logp, prepared.select(rows))
        loss.backward()
    learner._clip_gradients(float(learner._grad_norm_squared().sqrt()))
    learner.optimizer.step()
    learner.scheduler.step()
    learner._version += 1


def _weights_equal(a: MegatronLearner, b: MegatronLearner) -> bool:
    wa, wb = a.export_weights(), b.export_weights()
    return all(torch.equal(wa[k], wb[k]) for k in wa)


def test_defaults_take_exactly_the_old_single_step(h):
    cfg = LearnerConfig(micro_batch_size=3, optimizer=OptimizerConfig(lr=1e-3))
    assert (cfg.minibatches, cfg.epochs) == (1, 1)
    a, b = MegatronLearner(cfg), MegatronLearner(cfg)
    assert _weights_equal(a, b)
    for seed in (5, 6):
        batch = h.sampled_batch(h.make_sampler(a, "fp32"), n=7, max_new=10, seed=seed)
        m = a.train_step(batch)
        _reference_single_step(b, batch)
        assert _weights_equal(a, b)
        assert m["learner/optimizer_steps"] == 1.0 and m["learner/skipped_steps"] == 0.0
        assert (
            m["policy/clip_frac"] == 0.0 and m["policy/abs_log_ratio_mean"] == 0.0
        )  # r = 1 at the only step
    assert a.version == 2 and a.step == 2 and a.optimizer_steps == 2


def test_several_steps_per_batch_make_the_clip_act_and_publish_one_version(h):
    cfg = LearnerConfig(
        micro_batch_size=4,
        minibatches=2,
        epochs=3,
        optimizer=OptimizerConfig(lr=2e-2),
        objective=objectives.ObjectiveConfig(loss="ppo", corrections=[]),
    )
    learner = MegatronLearner(cfg)
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=8, max_new=12, seed=31)
    m = learner.train_step(batch)
    assert m["learner/optimizer_steps"] == 6.0 and learner.optimizer_steps == 6
    assert learner.version == 1 and m["learner/version"] == 1.0 and m["learner/proximal_version"] == 0.0
    assert m["policy/clip_frac"] > 0, m  # the later steps see pi_theta != pi_prox
    assert m["policy/abs_log_ratio_mean"] > 0
    assert m["policy/clip_frac"] == pytest.approx(m["policy/clip_low_frac"] + m["policy/clip_high_frac"])
    assert learner.policy_versions == {"proximal": 0, "published": 1, "behaviour_min": 0, "behaviour_max": 0}


def test_minibatch_split_is_seeded_and_covers_every_row():
    learner = MegatronLearner(LearnerConfig(minibatches=3, epochs=2))
    parts = learner._minibatch_rows(10)
    assert len(parts) == 6
    for epoch in (parts[:3], parts[3:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(10))
        assert sorted(len(p) for p in epoch) == [3, 3, 4]
    assert [p.tolist() for p in parts] == [p.tolist() for p in learner._minibatch_rows(10)]
    with pytest.raises(ConfigError, match=re.escape("learner.minibatches=3 needs at least that many")):
        learner._minibatch_rows(2)


def _nan_in_grad_pass(learner: MegatronLearner) -> list[int]:
    """Make every log-prob computed with grad NaN; returns a call counter."""
    calls = [0]
    real = learner._logprobs_with_grad

    def patched(tokens, routed, model=None):
        out = real(tokens, routed, model)
        if torch.is_grad_enabled():
            calls[0] += 1
            return out * float("nan")
        return out

    learner._logprobs_with_grad = patched
    return calls


def test_nan_log_probs_skip_the_step_and_stop_after_the_limit(h):
    learner = MegatronLearner(LearnerConfig(micro_batch_size=8, max_consecutive_skips=2))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=41)
    before = learner.export_weights()
    adam_state = len(learner.optimizer.state)
    calls = _nan_in_grad_pass(learner)
    m = learner.train_step(batch)
    assert calls[0] == 1
    assert m["learner/skipped_steps"] == 1.0 and m["learner/optimizer_steps"] == 0.0
    assert m["learner/consecutive_skips"] == 1.0
    assert learner.version == 0 and learner.step == 0 and learner.optimizer_steps == 0
    after = learner.export_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert len(learner.optimizer.state) == adam_state  # no optimizer step ran on NaN
    with pytest.raises(LearnerError, match=re.escape("2 consecutive learner steps skipped")):
        learner.train_step(batch)


def test_nan_proximal_log_probs_skip_the_batch_and_a_good_step_resets_the_count(h):
    # the separate no-grad forward; test_learner_proximal_forward covers the skip without it
    learner = MegatronLearner(
        LearnerConfig(micro_batch_size=8, max_consecutive_skips=2, proximal_forward="separate")
    )
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=42)
    real = learner._no_grad_logprobs

    def nan_proximal(*args, **kwargs):
        old, ref = real(*args, **kwargs)
        return old * float("nan"), ref

    learner._no_grad_logprobs = nan_proximal
    m = learner.train_step(batch)
    assert m["learner/skipped_steps"] == 1.0 and learner.version == 0
    learner._no_grad_logprobs = real
    m = learner.train_step(batch)
    assert m["learner/skipped_steps"] == 0.0 and learner.version == 1 and learner.consecutive_skips == 0


def test_checkpoint_records_the_policy_versions(h, tmp_path):
    learner = MegatronLearner(LearnerConfig(micro_batch_size=8, minibatches=2))
    sampler = h.make_sampler(learner, "fp32")
    batch_a = h.sampled_batch(sampler, n=4, max_new=8, seed=51)  # sampled at version 0
    learner.train_step(batch_a)
    learner.train_step(batch_a)  # trained at version 1 on version-0 samples
    assert learner.policy_versions == {"proximal": 1, "published": 2, "behaviour_min": 0, "behaviour_max": 0}
    path = str(tmp_path / "learner.pt")
    learner.save_checkpoint(path)
    state = torch.load(path, weights_only=False)
    assert state["policy_versions"] == learner.policy_versions
    assert state["optimizer_steps"] == 4
    resumed = MegatronLearner(learner.config)
    resumed.load_checkpoint(path)
    assert resumed.policy_versions == learner.policy_versions
    assert (resumed.version, resumed.optimizer_steps) == (2, 4)


def test_policy_versions_span_the_behaviour_versions_of_trained_tokens_only(h):
    learner = MegatronLearner(LearnerConfig(micro_batch_size=4, optimizer=OptimizerConfig(lr=1e-3)))
    for seed in (1, 2, 3):  # version 3: the batch below may carry versions 1-3
        learner.train_step(h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=6, seed=seed))
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=6, seed=4)
    mask = batch.loss_mask_B_T
    versions = torch.where(mask, 2 + (torch.arange(mask.shape[0])[:, None] % 2), 0)  # rows alternate 2, 3
    versions[0, mask[0].nonzero()[0, 0]] = 1  # the oldest trained token
    versions[~mask] = 7  # prompt and padding: not trained, so not counted (newer than the learner, even)
    learner.train_step(dataclasses.replace(batch, versions_B_T=versions))
    assert learner.policy_versions == {"proximal": 3, "published": 4, "behaviour_min": 1, "behaviour_max": 3}

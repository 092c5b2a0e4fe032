"""Reference-KL end to end: learner.reference=initial produces ref log-probs for objective.kl_coef > 0."""

import re

import pytest
import torch
from pydantic import ValidationError

from labrl.errors import ConfigError, LearnerError
from labrl.harness.config import build_run_config
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig

KL_COEF = 0.1


def ref_learner(**kw) -> MegatronLearner:
    return MegatronLearner(
        LearnerConfig(
            micro_batch_size=4,
            reference="initial",
            optimizer=OptimizerConfig(lr=1e-3),
            objective={"loss": "cispo", "corrections": [], "kl_coef": KL_COEF, "kl_estimator": "k3"},
            **kw,
        )
    )


def test_ref_kl_is_zero_at_the_first_step_then_positive_and_matches_k3_by_hand(h):
    learner = ref_learner()
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=6, max_new=8, seed=31)
    routed = batch.routed_experts_B_T_L_K
    initial = learner.logprobs(batch.tokens_B_T, routed)  # the reference, routing replayed
    m1 = learner.train_step(batch)
    assert learner.reference_frozen and m1["learner/reference"] == 1.0
    assert m1["loss/ref_kl"] == 0.0 and m1["ref_kl/k3"] == 0.0  # reference == policy at RL start

    old, ref = learner.logprobs_with_reference(batch.tokens_B_T, routed)
    assert torch.equal(ref, initial)  # frozen: the update moved the policy only
    assert not torch.equal(old, initial)
    m2 = learner.train_step(batch)
    # k3 per token with l = ref - logp; logp at the start of step 2 is `old` (the forward with grad
    # computes the same values); token_mean over the valid tokens of the global batch
    valid = batch.loss_mask_B_T
    log_r = (ref - old)[valid]
    k3 = float((torch.expm1(log_r) - log_r).mean())
    assert k3 > 0
    assert m2["ref_kl/k3"] == pytest.approx(k3, rel=1e-5)
    assert m2["loss/ref_kl"] == pytest.approx(KL_COEF * k3, rel=1e-5)
    assert m2["loss/total"] == pytest.approx(m2["loss/policy"] + m2["loss/ref_kl"], rel=1e-6)
    # the reference never enters the optimizer or the exported weights
    assert all(not p.requires_grad for p in learner.reference_model.parameters())
    assert set(learner.export_weights()) == {
        k for k in learner.model.state_dict() if not k.endswith("_extra_state")
    }


def test_checkpoint_resume_keeps_the_reference_and_gives_the_identical_next_step(h, tmp_path):
    learner = ref_learner()
    batch_a = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=41)
    learner.train_step(batch_a)
    path = str(tmp_path / "learner.pt")
    learner.save_checkpoint(path)
    batch_b = h.sampled_batch(h.make_sampler(learner, "fp32"), n=4, max_new=8, seed=42)
    m1 = learner.train_step(batch_b)
    w1 = learner.export_weights()

    resumed = ref_learner(seed=99)  # other init: everything must come from the checkpoint
    resumed.load_checkpoint(path)
    assert resumed.reference_frozen
    m2 = resumed.train_step(batch_b)
    w2 = resumed.export_weights()
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert m1["loss/ref_kl"] > 0
    for key in ("loss/ref_kl", "ref_kl/k3", "loss/policy", "loss/total", "learner/grad_norm"):
        assert m1[key] == m2[key], key


def test_a_checkpoint_without_reference_weights_cannot_resume_with_one(learner, h, tmp_path):
    batch = h.sampled_batch(h.make_sampler(learner, "fp32"), n=2, max_new=4, seed=5)
    learner.train_step(batch)
    path = str(tmp_path / "plain.pt")
    learner.save_checkpoint(path)
    with pytest.raises(
        LearnerError,
        match=re.escape(
            f"checkpoint {path} (step {learner.step}) holds no reference weights: it was written with "
            "learner.reference=none"
        ),
    ):
        ref_learner().load_checkpoint(path)


def test_kl_coef_and_reference_must_agree():
    with pytest.raises(
        ValidationError,
        match=re.escape(
            "objective.kl_coef=0.1 needs a reference policy: set reference=initial "
            "(the weights frozen when RL starts), or objective.kl_coef=0"
        ),
    ):
        LearnerConfig(objective={"kl_coef": 0.1})
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "invalid run config: objective.kl_coef=0.05 needs a reference policy: set learner.reference=initial "
            "(the weights frozen when RL starts), or objective.kl_coef=0"
        ),
    ):
        build_run_config({"env": {"id": "a/b-v0"}, "objective": {"kl_coef": 0.05}})
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "invalid run config: learner.reference=initial is only used by the reference-KL term, which "
            "objective.kl_coef=0 turns off: set objective.kl_coef > 0, or learner.reference=none"
        ),
    ):
        build_run_config({"env": {"id": "a/b-v0"}, "learner": {"reference": "initial"}})
    cfg = build_run_config(
        {"env": {"id": "a/b-v0"}, "learner": {"reference": "initial"}, "objective": {"kl_coef": 0.05}}
    )
    assert cfg.learner.reference == "initial" and cfg.objective.kl_coef == 0.05

"""bf16 parameters with fp32 master weights, run on CPU (learner.precision=bf16 is honoured there)."""

from __future__ import annotations

import torch

from labrl.harness import objectives
from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig
from labrl.harness.models import get_preset
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig

SMALL = get_preset("tiny-moe").model_copy(
    update={"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "moe_ffn_hidden_size": 32}
)


def test_default_precision_on_cpu_is_fp32_without_master_copies(learner):
    assert learner.device == torch.device("cpu") and learner.dtype == torch.float32
    assert learner.master is None
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())


def test_bf16_learner_steps_fp32_master_weights_and_resumes_them(h, tmp_path):
    cfg = LearnerConfig(
        model=SMALL,
        precision="bf16",
        micro_batch_size=3,
        optimizer=OptimizerConfig(lr=1e-4),
        objective=objectives.ObjectiveConfig(loss="reinforce"),
    )
    learner = MegatronLearner(cfg)
    assert all(p.dtype == torch.bfloat16 for p in learner.model.parameters())
    assert learner.master is not None
    assert all(m.dtype == torch.float32 for m in learner.master.master_params)
    assert {id(p) for g in learner.optimizer.param_groups for p in g["params"]} == {
        id(m) for m in learner.master.master_params
    }
    sampler = LocalSampler(
        SMALL, LocalSamplerConfig(precision="bf16"), weights=learner.export_weights(), version=0
    )
    batch = h.sampled_batch(sampler, n=6, max_new=8, seed=5)
    before = [m.detach().clone() for m in learner.master.master_params]
    metrics = learner.train_step(batch)
    assert metrics["learner/grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss/total"]))
    moved = [
        float((m.detach() - b).abs().max()) for m, b in zip(learner.master.master_params, before, strict=True)
    ]
    # Adam's first step moves each weight with a gradient by ~lr: far below bf16's resolution at
    # weights of ~0.02, so only the fp32 master weights keep such steps
    assert max(moved) > 0.5e-4 and max(moved) < 2e-4
    for p, m in zip(learner.model.parameters(), learner.master.master_params, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))  # the model holds the rounded master weights
        assert p.grad is None  # gradients went to the master copies (fp32 accumulation)
    logp = learner.logprobs(batch.tokens_B_T)
    assert logp.dtype == torch.float32  # log-probs are fp32 whatever the parameters

    path = str(tmp_path / "bf16.pt")
    learner.save_checkpoint(path)
    resumed = MegatronLearner(cfg.model_copy(update={"seed": 7}))
    resumed.load_checkpoint(path)
    for a, b in zip(learner.master.master_params, resumed.master.master_params, strict=True):
        assert torch.equal(a, b)  # the fp32 master weights, not their bf16 rounding
    m1, m2 = learner.train_step(batch), resumed.train_step(batch)
    assert m1["loss/total"] == m2["loss/total"] and m1["learner/grad_norm"] == m2["learner/grad_norm"]

"""The compiled objective on CUDA (inductor's Triton kernels) against eager, and the learner with it.

The CPU suite (tests/objectives/test_compiled_objective.py, tests/learner/test_learner_compiled_objective.py)
checks the same on inductor's C++ kernels; here Triton generates them.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_builders import as_trajectories, random_requests
from torch._dynamo.utils import counters

from labrl.harness.learners import LearnerConfig, MegatronLearner, OptimizerConfig
from labrl.harness.models import device as dev
from labrl.harness.models import get_preset
from labrl.harness.objectives import M2PO, ObjectiveConfig, ObjectiveInputs, batch_terms, policy_loss, prepare
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig

pytestmark = pytest.mark.gpu
OBJECTIVES = {
    "default": ObjectiveConfig(),
    "quickstart": ObjectiveConfig(corrections=[M2PO(tau=0.04)], kl_coef=0.1),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _inputs(B: int, T: int, seed: int, device: torch.device) -> tuple[ObjectiveInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    mask = torch.rand(B, T, generator=g) > 0.2
    inputs = ObjectiveInputs(
        loss_mask_B_T=mask,
        old_logprobs_B_T=old,
        behaviour_logprobs_B_T=old - 0.3 * torch.randn(B, T, generator=g),
        versions_B_T=torch.where(mask, 3, -1),
        rewards_B=torch.rand(B, generator=g),
        group_ids_B=torch.arange(B) // 2,
        learner_version=4,
        ref_logprobs_B_T=old - 0.1 * torch.rand(B, T, generator=g),
    )
    logp = old + 0.2 * torch.randn(B, T, generator=g)
    return inputs.to(device), logp.to(device)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_compiled_equals_eager_on_cuda_in_one_graph(name):
    assert dev.detect_capabilities().triton, "torch.compile on CUDA needs Triton"
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = OBJECTIVES[name]
    for B, T, seed in ((8, 64, 0), (6, 200, 1), (16, 33, 2)):
        inputs, logp0 = _inputs(B, T, seed, device)
        prepared = prepare(cfg, inputs, batch_terms(cfg, inputs.batch))
        got = []
        for compiled in (True, False):
            logp = logp0.clone().requires_grad_(True)
            loss, metrics = policy_loss(cfg, logp, prepared, device_metrics=True, compiled=compiled)
            loss.backward()
            got.append((loss.detach(), logp.grad, metrics.vector))
        for c, e in zip(*got, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-7)
    assert counters["stats"]["unique_graphs"] == 1


def _batch(learner: MegatronLearner, seed: int):
    sampler = LocalSampler(
        get_preset("tiny-moe"),
        LocalSamplerConfig(precision="bf16"),
        weights=learner.export_weights(),
        version=0,
    )
    reqs = random_requests(8, prompt_len=16, seed=seed)
    results = asyncio.run(sampler.generate(reqs))
    return collate(as_trajectories(reqs, results), pad_token_id=256)


def test_the_learner_trains_with_the_compiled_objective_on_cuda():
    """bf16 on CUDA, the quickstart's objective: compiled and eager learners agree after two steps."""
    learners = [
        MegatronLearner(
            LearnerConfig(
                precision="bf16",
                micro_batch_size=4,
                optimizer=OptimizerConfig(lr=1e-3),
                objective=ObjectiveConfig(corrections=[M2PO(tau=0.04)]),
                objective_kernel=kernel,
            )
        )
        for kernel in ("compiled", "eager")
    ]
    assert [learner.compiled_objective for learner in learners] == [True, False]
    assert learners[0].device.type == "cuda"
    for seed in (1, 2):
        batch = _batch(learners[1], seed)
        m_compiled, m_eager = (learner.train_step(batch) for learner in learners)
        for k in ("loss/total", "policy/ratio_mean", "learner/grad_norm"):
            assert m_compiled[k] == pytest.approx(m_eager[k], rel=2e-2, abs=1e-4), k
    assert counters["stats"]["unique_graphs"] >= 1

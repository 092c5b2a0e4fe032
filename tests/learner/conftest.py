"""Shared fixtures: one tiny MoE learner and fp32/bf16 samplers per test module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from labrl.harness.batching import collate
from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import get_preset
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams, TrainBatch, Trajectory

torch.set_num_threads(2)

TINY = get_preset("tiny-moe")


@pytest.fixture(scope="module")
def learner() -> MegatronLearner:
    return MegatronLearner(LearnerConfig(micro_batch_size=8))


def make_sampler(learner: MegatronLearner, precision: str) -> LocalSampler:
    return LocalSampler(
        TINY,
        LocalSamplerConfig(precision=precision),
        weights=learner.export_weights(),
        version=learner.version,
    )


def requests(n: int, max_new: int = 12, seed: int = 0) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [
        GenerateRequest(
            rid=f"r{i}",
            input_ids=tuple(torch.randint(0, 256, (20 + 3 * i,), generator=gen).tolist()),
            sampling=SamplingParams(max_new_tokens=max_new, seed=seed + i),
            return_routed_experts=True,
        )
        for i in range(n)
    ]


def as_trajectories(reqs: list[GenerateRequest], results: list[GenerateResult]) -> list[Trajectory]:
    out = []
    for i, (r, o) in enumerate(zip(reqs, results, strict=True)):
        n = len(r.input_ids)
        out.append(
            Trajectory(
                env_id="test/fixture-v0",
                task_id=r.rid,
                group_id=f"g{i // 4}",
                tokens_T=[*r.input_ids, *o.output_ids],
                loss_mask_T=[0] * n + [1] * len(o.output_ids),
                logprobs_T=[0.0] * n + o.logprobs_T,
                versions_T=[-1] * n + o.versions_T,
                reward=float(i % 2),
                outcome="ok",
                finish_reason=o.finish_reason,
                num_turns=1,
                routed_experts_T_L_K=o.routed_experts_T_L_K,
            )
        )
    return out


def sampled_batch(sampler: LocalSampler, n: int = 8, max_new: int = 12, seed: int = 0) -> TrainBatch:
    reqs = requests(n, max_new, seed)
    results = asyncio.run(sampler.generate(reqs))
    return collate(as_trajectories(reqs, results), pad_token_id=256)


class Helpers:
    tiny = TINY
    make_sampler = staticmethod(make_sampler)
    requests = staticmethod(requests)
    as_trajectories = staticmethod(as_trajectories)
    sampled_batch = staticmethod(sampled_batch)


@pytest.fixture(scope="session")
def h() -> type[Helpers]:
    return Helpers

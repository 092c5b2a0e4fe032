"""Shared fixtures: one tiny MoE learner and fp32/bf16 samplers per test module."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from rollout_builders import as_trajectories, random_requests

from labrl.harness.learners import LearnerConfig, MegatronLearner
from labrl.harness.models import get_preset
from labrl.harness.rollout.batching import collate
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.types import GenerateRequest, TrainBatch

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
    return random_requests(n, prompt_len=20, max_new=max_new, seed=seed)


def sampled_batch(sampler: LocalSampler, n: int = 8, max_new: int = 12, seed: int = 0) -> TrainBatch:
    reqs = requests(n, max_new, seed)
    results = asyncio.run(sampler.generate(reqs))
    return collate(as_trajectories(reqs, results), pad_token_id=256)


def nan_on_call(learner: MegatronLearner, n: int) -> Callable[[], None]:
    """Make the ``n``-th (1-based) log-prob forward of ``learner`` return NaN; returns what undoes it."""
    real = learner._logprobs_with_grad
    calls = [0]

    def forward(tokens, routed, model=None):
        out = real(tokens, routed, model)
        calls[0] += 1
        return out * float("nan") if calls[0] == n else out

    learner._logprobs_with_grad = forward

    def restore() -> None:
        learner._logprobs_with_grad = real

    return restore


class Helpers:
    tiny = TINY
    make_sampler = staticmethod(make_sampler)
    requests = staticmethod(requests)
    as_trajectories = staticmethod(as_trajectories)
    sampled_batch = staticmethod(sampled_batch)
    nan_on_call = staticmethod(nan_on_call)


@pytest.fixture(scope="session")
def h() -> type[Helpers]:
    return Helpers

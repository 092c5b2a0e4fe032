"""A multi-turn episode that outgrows the context ends truncated; the run goes on (local sampler)."""

from __future__ import annotations

import numpy as np
import pytest
from labrl_test_envs import EndlessToolEnv

from labrl.harness.pipeline.overlong import OverlongSection, process_overlong
from labrl.harness.rollout.play import rollout, rollout_group
from labrl.harness.samplers import LocalSampler, LocalSamplerConfig
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import SamplingParams

CONTEXT = 480  # the ByteTokenizer prompt with the tool schema is ~290 tokens


@pytest.fixture(scope="module")
def sampler(h):
    return LocalSampler(h.tiny.model_copy(update={"max_sequence_length": CONTEXT}), LocalSamplerConfig())


def _check_consistent(traj):
    n = len(traj.tokens_T)
    assert n <= CONTEXT
    assert len(traj.loss_mask_T) == len(traj.logprobs_T) == len(traj.versions_T) == n
    assert traj.routed_experts_T_L_K is not None and traj.routed_experts_T_L_K.shape[0] == n


async def test_episode_outgrowing_context_ends_truncated(sampler):
    env = EndlessToolEnv()
    traj = await rollout(
        env, env.make_task("train", 0), sampler, ByteTokenizer(),
        SamplingParams(max_new_tokens=16, seed=0), return_routed_experts=True,
    )  # fmt: skip
    assert traj.outcome == "ok" and traj.reward == 0.0
    assert traj.finish_reason == "length"  # the overlong policy treats it as an over-long episode
    assert 1 < traj.num_turns < 50
    assert traj.num_model_tokens > 0
    _check_consistent(traj)
    filtered, flags = process_overlong(traj, OverlongSection(mode="filter"), 16)
    assert flags["overlong"] == 1 and sum(filtered.loss_mask_T) == 0


async def test_group_of_episodes_outgrowing_context_all_finish(sampler):
    """Concurrent members share the continuous batch: rows aborted for room must not break it."""
    env_task = EndlessToolEnv().make_task("train", 1)
    trajs = await rollout_group(
        EndlessToolEnv, env_task, sampler, ByteTokenizer(), SamplingParams(max_new_tokens=16, seed=3), 4,
        return_routed_experts=True,
    )  # fmt: skip
    assert len(trajs) == 4
    for traj in trajs:
        assert traj.outcome == "ok" and traj.finish_reason == "length"
        _check_consistent(traj)


async def test_first_prompt_longer_than_context_is_env_error(sampler):
    env = EndlessToolEnv(prompt="x" * (CONTEXT + 10))
    traj = await rollout(
        env, env.make_task("train", 2), sampler, ByteTokenizer(),
        SamplingParams(max_new_tokens=16), return_routed_experts=True,
    )  # fmt: skip
    assert traj.outcome == "env_error" and traj.reward is None
    assert "does not fit" in traj.info["error"] and f"context of {CONTEXT}" in traj.info["error"]
    assert traj.num_model_tokens == 0 and traj.tokens_T == []
    assert np.asarray(traj.loss_mask_T).sum() == 0

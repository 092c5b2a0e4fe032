"""SGLang's context-length refusal: the sampler learns the length, clamps, and a full context ends the episode."""

from __future__ import annotations

import pytest
from labrl_test_envs import EndlessToolEnv
from sglang_toy import MOE_LAYERS, NUM_HIDDEN_LAYERS, TOPK, make_server

from labrl.harness.rollout.play import rollout
from labrl.harness.samplers.sglang.sampler import SGLangSampler, SGLangSamplerConfig, context_length_in
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.timeout(60)
CONTEXT = 400  # the ByteTokenizer prompt with the tool schema is ~290 tokens


def _sampler(url, tmp_path) -> SGLangSampler:
    cfg = SGLangSamplerConfig(
        urls=(url,), num_hidden_layers=NUM_HIDDEN_LAYERS, moe_layers=MOE_LAYERS, topk=TOPK,
        export_dir=str(tmp_path / "exports"), retry_backoff_s=0.0,
    )  # fmt: skip
    return SGLangSampler(cfg, weight_writer=lambda weights, path: None)


def test_context_length_is_read_from_both_refusals():
    server = make_server(context_length=CONTEXT)
    assert context_length_in(server._context_problem(CONTEXT, 1)) == CONTEXT
    assert context_length_in(server._context_problem(CONTEXT - 5, 5)) == CONTEXT
    assert server._context_problem(CONTEXT - 6, 5) is None
    assert context_length_in("max_new_tokens must be at least 0, got -1.") is None


async def test_generation_near_the_limit_is_clamped_not_refused(served, tmp_path):
    url = served(make_server(context_length=CONTEXT))
    async with _sampler(url, tmp_path) as sampler:
        near = GenerateRequest(
            rid="a/0", input_ids=tuple([1] * (CONTEXT - 4)), sampling=SamplingParams(max_new_tokens=16)
        )
        (res,) = await sampler.generate([near])
        assert res.finish_reason == "length" and len(res.output_ids) == 3  # input + new < context
        full = GenerateRequest(
            rid="a/1", input_ids=tuple([1] * (CONTEXT - 1)), sampling=SamplingParams(max_new_tokens=16)
        )
        (res,) = await sampler.generate([full])
        assert res.finish_reason == "abort" and res.output_ids == [] and "no room" in res.info["error"]


async def test_multi_turn_episode_outgrowing_sglang_context_ends_truncated(served, tmp_path):
    url = served(make_server(context_length=CONTEXT))
    env = EndlessToolEnv()
    async with _sampler(url, tmp_path) as sampler:
        traj = await rollout(
            env, env.make_task("train", 0), sampler, ByteTokenizer(),
            SamplingParams(max_new_tokens=16), return_routed_experts=True,
        )  # fmt: skip
    assert traj.outcome == "ok" and traj.reward == 0.0 and traj.finish_reason == "length"
    assert 1 < traj.num_turns < 50
    assert len(traj.tokens_T) < CONTEXT
    assert traj.routed_experts_T_L_K.shape[0] == len(traj.tokens_T)

"""A model context that cannot hold the env's opening prompt is refused before anything is written."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from labrl.envs import make
from labrl.errors import ConfigError
from labrl.harness.config import build_run_config
from labrl.harness.pipeline.orchestrator import task_seed
from labrl.harness.pipeline.prompt_fit import check_opening_prompts_fit
from labrl.harness.pipeline.runner import train
from labrl.harness.rollout.play import opening_prompt, rollout
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams

TOOLS_ENV = "xrd/phase-id-tools-v0"


def config(run_dir, context: int, **env_options):
    tiny = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64,
            "moe_ffn_hidden_size": 32, "num_experts": 2, "moe_router_topk": 2, "max_sequence_length": context}  # fmt: skip
    return build_run_config(
        {
            "env": {"id": TOOLS_ENV, "options": env_options},
            "model": {"preset": "tiny-moe", "overrides": tiny},
            "sampler": {"max_new_tokens": 64},
            "pipeline": {"batch_groups": 2, "group_size": 2, "total_steps": 1, "progress": False},
            "run_dir": str(run_dir),
        }
    )


async def test_a_context_shorter_than_the_first_prompt_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        await train(config(run, 1024))
    # the first train task of seed 0 (group 0) opens with 1366 byte tokens (the rollout's chat template)
    assert str(err.value) == (
        f"the first prompt does not fit the policy: {TOOLS_ENV}'s train task 0 opens with a prompt of 1366 "
        "tokens, which leaves no room in the model's context of 1024 tokens, so every episode would fail; set "
        "model.overrides.max_sequence_length to at least 1430 (the prompt plus sampler.max_new_tokens = 64), "
        "or give the env a shorter prompt"
    )
    assert not run.exists()


class FirstRequest:
    """A sampler that records the first request it is sent and answers that it has no room."""

    version = 0

    def __init__(self) -> None:
        self.input_ids: tuple[int, ...] | None = None

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        (request,) = requests
        self.input_ids = request.input_ids
        return [
            GenerateResult(
                rid=request.rid, output_ids=[], logprobs_T=[], versions_T=[], finish_reason="abort"
            )
        ]


async def test_the_measured_prompt_is_what_the_rollout_sends_and_a_long_enough_context_passes():
    env, tokenizer = make(TOOLS_ENV), ByteTokenizer()
    task = env.make_task("train", task_seed(0, 1))
    sampler = FirstRequest()
    await rollout(env, task, sampler, tokenizer, SamplingParams(max_new_tokens=8))  # type: ignore[arg-type]
    measured = await opening_prompt(env, task, tokenizer)
    assert measured is not None and tuple(measured) == sampler.input_ids and len(measured) == 1371
    await check_opening_prompts_fit(
        lambda: make(TOOLS_ENV), tokenizer, context=1372, run_seed=0, max_new_tokens=8
    )
    with pytest.raises(ConfigError, match="train task 1 opens with a prompt of 1371 tokens"):
        await check_opening_prompts_fit(
            lambda: make(TOOLS_ENV), tokenizer, context=1371, run_seed=0, max_new_tokens=8
        )


async def test_an_env_whose_reset_is_not_cheap_is_not_reset():
    # a simulated instrument wait of 60 s: the env does not opt in, so the check neither waits nor refuses
    slow = make(TOOLS_ENV, instrument_latency_s=60.0)
    assert not slow.unwrapped.reset_is_cheap() and make(TOOLS_ENV).unwrapped.reset_is_cheap()
    started = time.perf_counter()
    await check_opening_prompts_fit(
        lambda: make(TOOLS_ENV, instrument_latency_s=60.0), ByteTokenizer(), context=1024, run_seed=0,
        max_new_tokens=8,
    )  # fmt: skip
    assert time.perf_counter() - started < 30

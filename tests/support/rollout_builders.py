"""Sampled-rollout builders shared by the learner, device-discipline and GPU tests.

``random_requests`` makes seeded prompts of growing length (``prompt_len + 3 * i``
tokens); ``as_trajectories`` turns each request and its sampled result into a
single-turn ``Trajectory`` (prompt tokens masked out, alternating 0/1 rewards,
``group_size`` consecutive trajectories per group). ``pause_after_decode_steps`` pauses a
running sampler once it has taken that many decode steps, for in-flight weight updates.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams, Trajectory


def random_requests(n: int, *, prompt_len: int, max_new: int = 12, seed: int = 0) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    return [
        GenerateRequest(
            rid=f"r{i}",
            input_ids=tuple(torch.randint(0, 256, (prompt_len + 3 * i,), generator=gen).tolist()),
            sampling=SamplingParams(max_new_tokens=max_new, seed=seed + i),
            return_routed_experts=True,
        )
        for i in range(n)
    ]


def as_trajectories(
    reqs: list[GenerateRequest], results: list[GenerateResult], *, group_size: int = 4
) -> list[Trajectory]:
    out = []
    for i, (r, o) in enumerate(zip(reqs, results, strict=True)):
        n = len(r.input_ids)
        out.append(
            Trajectory(
                env_id="test/fixture-v0",
                task_id=r.rid,
                group_id=f"g{i // group_size}",
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


async def pause_after_decode_steps(sampler: Any, steps: int) -> None:
    """Wait until ``sampler`` (a local sampler generating) has taken ``steps`` decode steps, pause it and
    wait until its generation has stopped at the pause."""
    while sampler.decode_steps < steps:
        await asyncio.sleep(0.001)
    await sampler.pause()
    while not sampler.waiting_on_pause:
        await asyncio.sleep(0.001)

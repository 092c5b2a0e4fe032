"""Any exception escaping an env, verifier or judge is an episode error with its traceback, never a crash."""

from __future__ import annotations

import pytest
from labrl_test_envs import CrashingEnv

from labrl.envs import Outcome, make, run_episode, scripted_policy
from labrl.harness.rollout.play import rollout
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateResult, SamplingParams


@pytest.mark.parametrize(
    ("where", "raised"), [("reset", "KeyError"), ("step", "ZeroDivisionError")], ids=["reset", "step"]
)
async def test_unwrapped_env_exception_is_recorded_not_raised(where, raised):
    env = CrashingEnv(where=where)  # not wrapped in BudgetedEnv: nothing catches it but the runner
    episode = await run_episode(env, env.make_task("train", 0), scripted_policy(["ANSWER: x"]))
    assert episode.outcome is Outcome.ENV_ERROR and episode.reward is None
    assert episode.error.startswith(raised)
    assert f"{raised}:" in episode.traceback and "labrl_test_envs.py" in episode.traceback


@pytest.mark.parametrize(
    ("env_id", "options", "outcome", "frame"),
    [
        ("test/crashing-v0", {"where": "step"}, Outcome.ENV_ERROR, "in step"),
        ("test/crashing-v0", {"where": "reset"}, Outcome.ENV_ERROR, "in reset"),
        ("test/broken-verifier-v0", {"mode": "raise"}, Outcome.VERIFIER_FAILED, "in broken"),
    ],
    ids=["env_step", "env_reset", "verifier"],
)
async def test_wrapped_env_failure_keeps_its_traceback(env_id, options, outcome, frame):
    env = make(env_id, **options)
    episode = await run_episode(env, env.make_task("train", 0), scripted_policy(["ANSWER: quartz"]))
    assert episode.outcome is outcome and episode.reward is None
    assert frame in episode.traceback and "Traceback (most recent call last)" in episode.traceback


class _FixedSampler:
    """Answers every request with the same bytes (ByteTokenizer ids)."""

    version = 0

    def __init__(self, text: str) -> None:
        self.ids = list(text.encode())

    async def generate(self, requests):
        return [
            GenerateResult(
                rid=r.rid,
                output_ids=self.ids,
                logprobs_T=[0.0] * len(self.ids),
                versions_T=[0] * len(self.ids),
                finish_reason="stop",
            )
            for r in requests
        ]


async def test_rollout_trajectory_carries_the_traceback():
    env = make("test/crashing-v0", where="step")
    traj = await rollout(
        env,
        env.make_task("train", 0),
        _FixedSampler("ANSWER: x"),
        ByteTokenizer(),
        SamplingParams(max_new_tokens=8),
    )
    assert traj.outcome == "env_error" and traj.reward is None
    assert traj.info["error"].startswith("ZeroDivisionError")
    assert "ZeroDivisionError: division by zero in the env" in traj.info["traceback"]

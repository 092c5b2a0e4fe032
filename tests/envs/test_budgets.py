"""Every budget and every outcome, proved with the fixture envs."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from labrl_test_envs import CalculatorEnv

from labrl.envs import Action, Budgets, Outcome, format_tool_call, make, parse_action
from labrl.envs.registry import registered_ids, registration
from labrl.errors import EnvError, EnvTimeoutError
from labrl.resilience import Backoff


async def _start(env_id: str, **kwargs):
    env = make(env_id, **kwargs)
    task = env.make_task("train", 0)
    await env.reset(task)
    return env, task


async def test_ok_and_wrong_answers_are_scored():
    env, task = await _start("test/echo-v0")
    right = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert (right.outcome, right.reward, right.done) == (Outcome.OK, 1.0, True)
    await env.reset(task)
    wrong = await env.step(Action(text="ANSWER: nope"))
    assert (wrong.outcome, wrong.reward) == (Outcome.OK, 0.0)


async def test_invalid_action_is_data_with_a_message():
    env, _ = await _start("test/echo-v0")
    result = await env.step(Action(text="rutile?"))
    assert result.outcome is Outcome.INVALID_ACTION
    assert result.reward == 0.0 and result.done
    assert result.observation.messages[0].content == "Invalid action: reply with 'ANSWER: <word>'"


async def test_slow_step_times_out_at_the_deadline():
    env, task = await _start("test/slow-v0", delay=5.0)
    t0 = time.perf_counter()
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    elapsed = time.perf_counter() - t0
    assert result.outcome is Outcome.TIMEOUT and result.reward is None and result.done
    assert 0.5 <= elapsed < 0.9
    assert result.info["error"] == "EnvTimeoutError: test/slow-v0: step did not finish within 0.5 s"


async def test_budget_override_through_make():
    env, task = await _start("test/slow-v0", delay=0.2, budgets={"step_timeout_s": 2.0})
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert result.outcome is Outcome.OK and result.reward == 1.0


async def test_transient_errors_are_retried_within_budget():
    env, task = await _start("test/flaky-v0", failures=2, max_retries=2)
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert result.outcome is Outcome.OK and result.reward == 1.0
    assert env.unwrapped.calls == 3


async def test_transient_errors_beyond_budget_are_env_errors():
    env, task = await _start("test/flaky-v0", failures=5, max_retries=2)
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert result.outcome is Outcome.ENV_ERROR and result.reward is None
    assert env.unwrapped.calls == 3
    assert result.info["error"] == "TransientEnvError: backend busy (call 3)"


async def test_retries_wait_the_shared_capped_backoff(monkeypatch):
    """``min(retry_backoff_cap_s, retry_backoff_s * 2**attempt)``: the waits stop doubling at the cap."""
    waits: list[float] = []
    real_delay = Backoff.delay

    def recording_delay(self, attempt, rng=None, retry_after=None):
        waits.append(real_delay(self, attempt, rng, retry_after))
        return waits[-1]

    monkeypatch.setattr(Backoff, "delay", recording_delay)
    env, task = await _start(
        "test/flaky-v0", failures=6, budgets={"max_retries": 6, "retry_backoff_cap_s": 0.04}
    )
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert result.outcome is Outcome.OK and env.unwrapped.calls == 7
    assert waits == [0.01, 0.02, 0.04, 0.04, 0.04, 0.04]
    assert Budgets().retry_backoff_cap_s == 30.0  # the documented default cap


async def test_invalid_actions_are_never_retried():
    env, _ = await _start("test/flaky-v0", failures=0)
    await env.step(Action(text="garbage"))
    assert env.unwrapped.calls == 1


async def test_crash_in_step_is_env_error():
    env, task = await _start("test/crashing-v0", where="step")
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert result.outcome is Outcome.ENV_ERROR and result.reward is None
    assert result.info["error"] == "ZeroDivisionError: division by zero in the env"


async def test_crash_in_reset_raises_env_error():
    env = make("test/crashing-v0", where="reset")
    with pytest.raises(
        EnvError,
        match=re.escape("test/crashing-v0: reset failed: KeyError: 'missing instrument calibration'"),
    ):
        await env.reset(env.make_task("train", 0))


@pytest.mark.parametrize(
    ("mode", "outcome"),
    [("raise", Outcome.VERIFIER_FAILED), ("nan", Outcome.VERIFIER_FAILED), ("hang", Outcome.TIMEOUT)],
)
async def test_broken_verifier_is_never_a_zero(mode, outcome):
    env, task = await _start("test/broken-verifier-v0", mode=mode)
    result = await env.step(Action(text=f"ANSWER: {task.answer}"))
    assert result.outcome is outcome and result.reward is None and result.done
    if mode == "raise":
        assert (
            result.info["error"]
            == "VerifierError: test/broken-verifier-v0: scoring failed: ValueError: phase library missing"
        )
    if mode == "hang":
        assert (
            result.info["error"]
            == "EnvTimeoutError: test/broken-verifier-v0: scoring did not finish within 0.3 s"
        )


async def test_max_turns_truncates_the_episode():
    env, _ = await _start("test/calculator-v0", max_turns=2)
    add = parse_action(format_tool_call("add", {"a": 1, "b": 2}))
    first = await env.step(add)
    assert not first.done and not first.truncated and first.observation.messages[0].content == "3"
    second = await env.step(add)
    assert second.truncated and not second.done and second.info["max_turns_reached"]
    with pytest.raises(EnvError, match="step\\(\\) called with no episode running"):
        await env.step(add)


async def test_step_before_reset_and_foreign_task_are_errors():
    env = make("test/echo-v0")
    with pytest.raises(EnvError, match="no episode running"):
        await env.step(Action(text="x"))
    other = make("test/calculator-v0").make_task("train", 0)
    with pytest.raises(EnvError, match="belongs to 'test/calculator-v0', not 'test/echo-v0'"):
        await env.reset(other)


async def test_concurrency_pool_is_shared_across_episodes():
    CalculatorEnv.max_in_pool = 0
    add = parse_action(format_tool_call("add", {"a": 1, "b": 2}))

    async def episode(seed: int) -> None:
        env = make("test/calculator-v0", tool_delay=0.05)
        await env.reset(env.make_task("train", seed))
        await env.step(add)

    await asyncio.gather(*(episode(s) for s in range(10)))
    assert CalculatorEnv.max_in_pool == 2


async def test_reset_timeout_raises_typed_error():
    env = make("test/echo-v0", budgets={"reset_timeout_s": 0.1})

    async def slow_reset(task):
        await asyncio.sleep(5)

    env.unwrapped.reset = slow_reset
    with pytest.raises(EnvTimeoutError, match=re.escape("test/echo-v0: reset did not finish within 0.1 s")):
        await env.reset(env.make_task("train", 0))


@pytest.mark.parametrize("env_id", [i for i in registered_ids() if registration(i).source == "labrl"])
async def test_every_builtin_env_refuses_step_before_reset(env_id):
    """The rule lives once, in ``Env.episode_task()``; each env's own ``step`` reaches it unwrapped."""
    env = make(env_id).unwrapped
    with pytest.raises(EnvError, match=f"^{re.escape(env_id)}: step\\(\\) called with no episode running"):
        await env.step(Action(text="x"))

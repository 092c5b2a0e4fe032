from __future__ import annotations

import asyncio
import re
import time

import pytest
from labrl_test_envs import die_with_exit_code_3, hang_forever, raise_value_error, slow_square

from labrl.envs import Action, Outcome, make, run_cpu, run_killable
from labrl.errors import EnvError, EnvTimeoutError


async def test_cpu_work_runs_off_the_event_loop():
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    await run_cpu(slow_square, 1, 0.0)  # warm the pool
    task = asyncio.create_task(ticker())
    assert await run_cpu(slow_square, 7, 0.5) == 49
    task.cancel()
    assert ticks >= 20  # the loop kept running while the worker slept 0.5 s


async def test_killable_subprocess_is_killed_at_deadline():
    t0 = time.perf_counter()
    with pytest.raises(EnvTimeoutError, match=re.escape("hang_forever did not finish within 0.5 s; killed")):
        await run_killable(hang_forever, timeout=0.5)
    assert time.perf_counter() - t0 < 3.0


async def test_killable_returns_results_and_reraises_errors():
    assert await run_killable(slow_square, 5, 0.0, timeout=10) == 25
    with pytest.raises(ValueError, match="bad structure"):
        await run_killable(raise_value_error, timeout=10)
    with pytest.raises(EnvError, match=re.escape("die_with_exit_code_3 died without a result (exit code 3)")):
        await run_killable(die_with_exit_code_3, timeout=10)


async def test_env_using_offload_helpers():
    env = make("test/offload-v0", mode="cpu")
    task = env.make_task("train", 0)
    await env.reset(task)
    result = await env.step(Action(text="ANSWER: x"))
    assert result.outcome is Outcome.OK and result.info["value"] == 9
    env = make("test/offload-v0", mode="hang")
    await env.reset(task)
    result = await env.step(Action(text="ANSWER: x"))
    assert result.outcome is Outcome.TIMEOUT

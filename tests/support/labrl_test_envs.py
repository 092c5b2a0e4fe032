"""Fixture envs that exercise every budget and outcome of the Env contract.

They live outside the test modules so that process-pool workers and
subprocesses can import them (pytest's pythonpath, which tests/conftest.py exports to child processes).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from typing import Any, ClassVar

from labrl.envs import Action, Budgets, Env, EnvSpec, Message, Observation, StepResult, Task, ToolSpec
from labrl.errors import InvalidActionError, TransientEnvError, VerifierError
from labrl.offload import run_cpu, run_killable

WORDS = (
    "quartz",
    "rutile",
    "anatase",
    "calcite",
    "halite",
    "corundum",
    "spinel",
    "perovskite",
    "wurtzite",
    "zircon",
)


def _word(split: str, seed: int) -> str:
    digest = hashlib.sha256(f"{split}:{seed}".encode()).digest()
    return WORDS[digest[0] % len(WORDS)] + str(digest[1] % 100) + ("" if split == "train" else "t")


def _answer(text: str) -> str:
    text = text.strip()
    if not text.startswith("ANSWER:"):
        raise InvalidActionError("reply with 'ANSWER: <word>'")
    return text.removeprefix("ANSWER:").strip()


def slow_square(x: int, delay: float) -> int:
    """CPU-pool work: sleeps (stands in for a blocking C call), then squares."""
    time.sleep(delay)
    return x * x


def raise_value_error() -> None:
    raise ValueError("bad structure")


def die_with_exit_code_3() -> None:
    import os

    os._exit(3)


def hang_forever() -> None:
    while True:
        time.sleep(1)


def seeded_task(env: Env, prefix: str, split: Any, seed: int, **fields: Any) -> Task:
    """A task of ``env`` with the id ``{prefix}-{split}-{seed}``, unique per split and seed."""
    return Task(env_id=env.spec.id, split=split, seed=seed, task_id=f"{prefix}-{split}-{seed}", **fields)


class EchoEnv(Env):
    """Single turn: repeat the secret word as 'ANSWER: word'. Reward 1 if right, else 0."""

    def __init__(self, step_delay: float = 0.0) -> None:
        self.spec = EnvSpec(id="test/echo-v0", description="repeat the word", has_gold_answer=True)
        self.step_delay = step_delay
        self.task: Task | None = None

    def make_task(self, split: Any, seed: int) -> Task:
        word = _word(split, seed)
        return seeded_task(self, "echo", split, seed, prompt={"word": word}, answer=word)

    async def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(
            messages=(Message(role="user", content=f"Say {task.prompt['word']} as 'ANSWER: <word>'"),)
        )

    async def step(self, action: Action) -> StepResult:
        assert self.task is not None
        if self.step_delay:
            await asyncio.sleep(self.step_delay)
        answer = _answer(action.text)
        reward = await self.score(lambda: float(answer == self.task.answer))
        return StepResult(reward=reward, done=True)

    def gold_actions(self, task: Task) -> list[Action]:
        return [Action(text=f"ANSWER: {task.answer}")]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        return Action(text=f"ANSWER: {rng.choice(WORDS)}")


class SlowEnv(EchoEnv):
    """Echo with a step that sleeps ``delay`` seconds."""

    def __init__(self, delay: float = 5.0) -> None:
        super().__init__(step_delay=delay)
        self.spec = EnvSpec(id="test/slow-v0", budgets=Budgets(step_timeout_s=0.5))


class FlakyEnv(EchoEnv):
    """Echo whose step raises ``TransientEnvError`` the first ``failures`` times per instance."""

    def __init__(self, failures: int = 2, max_retries: int = 2) -> None:
        super().__init__()
        self.spec = EnvSpec(
            id="test/flaky-v0", budgets=Budgets(max_retries=max_retries, retry_backoff_s=0.01)
        )
        self.failures = failures
        self.calls = 0

    async def step(self, action: Action) -> StepResult:
        self.calls += 1
        if self.calls <= self.failures:
            raise TransientEnvError(f"backend busy (call {self.calls})")
        return await super().step(action)


class CrashingEnv(EchoEnv):
    """Echo that crashes in ``where`` ('reset' or 'step') with a plain bug."""

    def __init__(self, where: str = "step") -> None:
        super().__init__()
        self.spec = EnvSpec(id="test/crashing-v0")
        self.where = where

    async def reset(self, task: Task) -> Observation:
        if self.where == "reset":
            raise KeyError("missing instrument calibration")
        return await super().reset(task)

    async def step(self, action: Action) -> StepResult:
        if self.where == "step":
            raise ZeroDivisionError("division by zero in the env")
        return await super().step(action)


class BrokenVerifierEnv(EchoEnv):
    """Echo whose scorer raises (mode='raise'), returns garbage (mode='nan') or hangs (mode='hang')."""

    def __init__(self, mode: str = "raise") -> None:
        super().__init__()
        self.spec = EnvSpec(id="test/broken-verifier-v0", budgets=Budgets(scoring_timeout_s=0.3))
        self.mode = mode

    async def step(self, action: Action) -> StepResult:
        _answer(action.text)

        def broken() -> float:
            if self.mode == "raise":
                raise ValueError("phase library missing")
            return float("nan")

        async def hang() -> float:
            await asyncio.sleep(30)
            return 1.0

        reward = await self.score(hang if self.mode == "hang" else broken)
        if reward != reward:  # NaN
            raise VerifierError("scorer returned NaN")
        return StepResult(reward=reward, done=True)


class CalculatorEnv(Env):
    """Multi-turn with tools: add(a, b) returns the sum; submit(answer) ends the episode.

    The task is to compute a + b + c. Tool calls run in the shared pool "calc"
    (size 2); ``max_in_pool`` records the most concurrent users ever seen.
    """

    max_in_pool: ClassVar[int] = 0
    in_pool: ClassVar[int] = 0
    TOOLS = (
        ToolSpec(
            name="add",
            description="add two numbers",
            parameters={"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        ),
        ToolSpec(
            name="submit",
            description="submit the final answer",
            parameters={"type": "object", "properties": {"answer": {"type": "number"}}},
        ),
    )

    def __init__(self, tool_delay: float = 0.0, max_turns: int = 4) -> None:
        self.spec = EnvSpec(
            id="test/calculator-v0",
            budgets=Budgets(max_turns=max_turns, pools={"calc": 2}),
            tools=self.TOOLS,
            has_gold_answer=True,
        )
        self.tool_delay = tool_delay
        self.task: Task | None = None

    def make_task(self, split: Any, seed: int) -> Task:
        rng = random.Random(f"{split}:{seed}")
        numbers = [rng.randint(1, 99) for _ in range(3)]
        return seeded_task(self, "calc", split, seed, prompt={"numbers": numbers}, answer=sum(numbers))

    async def reset(self, task: Task) -> Observation:
        self.task = task
        a, b, c = task.prompt["numbers"]
        return Observation(
            messages=(Message(role="user", content=f"Compute {a} + {b} + {c}."),), tools=self.TOOLS
        )

    async def step(self, action: Action) -> StepResult:
        assert self.task is not None
        if action.parse_error:
            raise InvalidActionError(action.parse_error)
        if not action.tool_calls:
            raise InvalidActionError("call a tool: add(a, b) or submit(answer)")
        replies = []
        for call in action.tool_calls:
            if call.name == "submit":
                answer = call.arguments.get("answer")
                if not isinstance(answer, int | float):
                    raise InvalidActionError("submit needs a numeric 'answer'")
                return StepResult(reward=float(answer == self.task.answer), done=True)
            if call.name != "add":
                raise InvalidActionError(f"unknown tool {call.name!r}; tools: add, submit")
            async with self.pool("calc"):
                type(self).in_pool += 1
                type(self).max_in_pool = max(type(self).max_in_pool, type(self).in_pool)
                try:
                    await asyncio.sleep(self.tool_delay)
                    total = call.arguments.get("a", 0) + call.arguments.get("b", 0)
                finally:
                    type(self).in_pool -= 1
            replies.append(Message(role="tool", content=str(total), tool_call_id=call.id))
        return StepResult(observation=Observation(messages=tuple(replies)))

    def gold_actions(self, task: Task) -> list[Action]:
        from labrl.envs import parse_action
        from labrl.envs.actions import format_tool_call

        a, b, c = task.prompt["numbers"]
        return [
            parse_action(format_tool_call("add", {"a": a, "b": b})),
            parse_action(format_tool_call("submit", {"answer": a + b + c})),
        ]

    def random_action(self, task: Task, rng: random.Random) -> Action:
        from labrl.envs import parse_action
        from labrl.envs.actions import format_tool_call

        return parse_action(format_tool_call("add", {"a": rng.randint(0, 9), "b": rng.randint(0, 9)}))


class OffloadEnv(EchoEnv):
    """Echo whose scoring runs in the process pool (mode='cpu') or a killable subprocess that hangs (mode='hang')."""

    def __init__(self, mode: str = "cpu", cpu_delay: float = 0.2) -> None:
        super().__init__()
        self.spec = EnvSpec(id="test/offload-v0", budgets=Budgets(step_timeout_s=5.0))
        self.mode = mode
        self.cpu_delay = cpu_delay

    async def step(self, action: Action) -> StepResult:
        _answer(action.text)
        if self.mode == "hang":
            await run_killable(hang_forever, timeout=0.5)
        value = await run_cpu(slow_square, 3, self.cpu_delay)
        return StepResult(reward=float(value == 9), done=True, info={"value": value})


class PoolHangEnv(EchoEnv):
    """Echo whose scoring runs in the process pool and never returns: each step times out and the
    pool stays busy (the all-failing run whose exit hung at ``concurrent.futures``' atexit join)."""

    def __init__(self) -> None:
        super().__init__()
        self.spec = EnvSpec(id="test/pool-hang-v0", budgets=Budgets(step_timeout_s=0.5))

    async def step(self, action: Action) -> StepResult:
        await run_cpu(hang_forever)
        raise AssertionError("hang_forever returned")


class BlockingEnv(EchoEnv):
    """Echo whose step computes synchronously for ``block_s`` seconds: it stalls the event loop."""

    def __init__(self, block_s: float = 1.0) -> None:
        super().__init__()
        self.spec = EnvSpec(id="test/blocking-v0", description="blocks the loop", has_gold_answer=True)
        self.block_s = block_s

    async def step(self, action: Action) -> StepResult:
        time.sleep(self.block_s)  # the bug under test: a blocking call inside a coroutine
        return await super().step(action)


class NaNRewardEnv(EchoEnv):
    """Echo whose scorer returns NaN for a wrong answer (a 0/0 in a metric)."""

    def __init__(self) -> None:
        super().__init__()
        self.spec = EnvSpec(
            id="test/nan-reward-v0", description="NaN for wrong answers", has_gold_answer=True
        )

    async def step(self, action: Action) -> StepResult:
        result = await super().step(action)
        return result if result.reward == 1.0 else result.model_copy(update={"reward": float("nan")})


FIXTURES = {
    "test/echo-v0": EchoEnv,
    "test/slow-v0": SlowEnv,
    "test/flaky-v0": FlakyEnv,
    "test/crashing-v0": CrashingEnv,
    "test/broken-verifier-v0": BrokenVerifierEnv,
    "test/calculator-v0": CalculatorEnv,
    "test/offload-v0": OffloadEnv,
    "test/blocking-v0": BlockingEnv,
    "test/nan-reward-v0": NaNRewardEnv,
}


class EndlessToolEnv(Env):
    """Every reply gets a tool message back and the episode never finishes by itself (max_turns 50):
    a conversation that grows until it outgrows the policy's context."""

    TOOLS = (ToolSpec(name="measure", description="measure a sample"),)

    def __init__(self, prompt: str = "go") -> None:
        self.spec = EnvSpec(id="test/endless-tools-v0", budgets=Budgets(max_turns=50), tools=self.TOOLS)
        self.prompt = prompt

    def make_task(self, split: Any, seed: int) -> Task:
        return Task(env_id=self.spec.id, split=split, seed=seed, task_id=f"endless{seed}")

    async def reset(self, task: Task) -> Observation:
        return Observation(messages=(Message(role="user", content=self.prompt),), tools=self.TOOLS)

    async def step(self, action: Action) -> StepResult:
        reply = Message(role="tool", content="reading: 42.0 counts")
        return StepResult(observation=Observation(messages=(reply,)), reward=0.0)

"""The env ``benchmarks/serve.py`` serves: every step waits a set time, as a remote instrument does.

``bench/wait-v0`` (options ``wait_s``, ``turns``): an episode is ``turns`` steps, each an
``asyncio.sleep(wait_s)`` (latency, no CPU) answered with one short message; the last step ends
the episode with reward 1. Its one tool is ``wait`` (no arguments): ORS calls it by name, the
other paths send the same ``<tool_call>`` text (``WAIT_CALL``).

Run as a script it is the benchmark's server: it registers the env in that process and hands its
arguments to the ``labrl`` CLI, so ``python benchmarks/_serve_env.py envs serve bench/wait-v0
--protocol openenv --port 8000 -o wait_s=1`` is ``labrl envs serve`` of this env.
"""

from __future__ import annotations

import asyncio
import random
import sys

from labrl.envs import (
    Action,
    Budgets,
    Env,
    EnvSpec,
    Message,
    Observation,
    StepResult,
    Task,
    ToolSpec,
    format_tool_call,
    register,
)
from labrl.envs.registry import registered_ids

ENV_ID = "bench/wait-v0"
TOOL = "wait"
WAIT_CALL = format_tool_call(TOOL, {})


class WaitEnv(Env):
    """``turns`` steps per episode, each waiting ``wait_s`` seconds; reward 1 at the last."""

    def __init__(self, wait_s: float = 1.0, turns: int = 2) -> None:
        self.wait_s = wait_s
        self.turns = turns
        self.spec = EnvSpec(
            id=ENV_ID,
            description="every step waits wait_s seconds (asyncio.sleep); turns steps per episode",
            budgets=Budgets(max_turns=turns, step_timeout_s=wait_s + 60.0),
            tools=(ToolSpec(name=TOOL, description="wait for the instrument"),),
        )
        self._steps = 0

    def reset_is_cheap(self) -> bool:
        return True

    def make_task(self, split: str, seed: int) -> Task:
        return Task(env_id=ENV_ID, split=split, seed=seed, task_id=f"wait-{split}-{seed}")  # type: ignore[arg-type]

    async def reset(self, task: Task) -> Observation:
        self._task, self._steps = task, 0
        return Observation(messages=(Message(role="user", content=f"call {TOOL} {self.turns} times"),))

    async def step(self, action: Action) -> StepResult:
        self.episode_task()
        await asyncio.sleep(self.wait_s)
        self._steps += 1
        done = self._steps >= self.turns
        reply = Observation(messages=(Message(role="tool", content=f"waited {self.wait_s:g} s"),))
        return StepResult(observation=reply, reward=1.0 if done else None, done=done)

    async def close(self) -> None:
        self._task = None

    def gold_actions(self, task: Task) -> list[Action]:
        return [Action(text=WAIT_CALL)] * self.turns

    def random_action(self, task: Task, rng: random.Random) -> Action:
        return Action(text=WAIT_CALL)


def register_wait_env() -> None:
    """Register ``bench/wait-v0`` in this process (once)."""
    if ENV_ID not in registered_ids():
        register(ENV_ID, WaitEnv, source="benchmarks")


if __name__ == "__main__":
    from labrl.cli import main

    register_wait_env()
    sys.exit(main(sys.argv[1:]))

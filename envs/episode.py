"""Drive one episode of any env with a policy.

A policy is an async callable ``(messages, tools) -> str | Action``: a
scripted answer, a random baseline, a chat model behind HTTP, or the
harness's token-recording sampler wrapper. The runner owns the loop::

    obs = reset(task); messages = obs.messages
    repeat: text = policy(messages, tools); result = step(parse(text));
            messages += [assistant text, *result.observation.messages]
    until done or truncated (or the policy raises EpisodeTruncated: context full)

and returns an ``Episode`` record: transcript, per-turn results, the final
outcome and reward, and timings split into policy time and env time (the
split the pipeline's metrics need).

Failures of the env are data (outcome ``timeout`` / ``env_error`` /
``verifier_failed`` with ``reward=None``), whatever the env, its verifier or
its judge raised, wrapped in ``BudgetedEnv`` or not: ``Episode.error`` holds
one line and ``Episode.traceback`` the full traceback. The exception is an
error that says the setup is wrong (``budgets.STOPS_THE_RUN``: a lab or a judge
refusing our key), which propagates and stops the run. Failures of the policy
(the sampler) are the caller's and propagate.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from labrl.envs.actions import parse_action
from labrl.envs.base import Env
from labrl.envs.budgets import STOPS_THE_RUN, format_traceback, outcome_of_error
from labrl.envs.types import Action, Message, Outcome, StepResult, Task, ToolSpec
from labrl.errors import EnvError

Policy = Callable[[Sequence[Message], Sequence[ToolSpec]], Awaitable[str | Action]]


class EpisodeTruncated(Exception):
    """Raised by a policy that cannot reply (its context window is full): the episode ends truncated.

    After at least one turn the episode is an ordinary truncated one (outcome
    of the last step, reward as scored so far, ``truncated=True``); before the
    first reply there is nothing to train on, so it is an ``env_error`` (the
    env's prompt does not fit the policy's context).
    """


class Turn(BaseModel):
    model_config = ConfigDict(frozen=True)

    action: Action
    result: StepResult
    policy_s: float
    env_s: float


class Episode(BaseModel):
    """What happened in one episode (JSON round-trips)."""

    model_config = ConfigDict(frozen=True)

    env_id: str
    task: Task
    messages: tuple[Message, ...]
    turns: tuple[Turn, ...]
    outcome: Outcome
    reward: float | None = Field(description="sum of step rewards; None if the outcome is not trainable")
    done: bool
    truncated: bool
    timings: dict[str, float]
    error: str | None = None
    traceback: str | None = Field(
        default=None, description="full traceback of the error, when one was raised"
    )

    @property
    def num_turns(self) -> int:
        return len(self.turns)


async def run_episode(env: Env, task: Task, policy: Policy, *, max_turns: int | None = None) -> Episode:
    """Play ``task`` on ``env`` (ideally a ``BudgetedEnv`` from ``make``) with ``policy``."""
    started = time.perf_counter()
    try:
        observation = await env.reset(task)
    except STOPS_THE_RUN:
        raise
    except Exception as exc:  # any env bug is this episode's env_error, never a crashed run
        outcome = outcome_of_error(exc)
        elapsed = time.perf_counter() - started
        return Episode(
            env_id=env.spec.id, task=task, messages=(), turns=(), outcome=outcome, reward=None,
            done=True, truncated=False, timings={"reset_s": elapsed, "policy_s": 0.0, "env_s": elapsed},
            error=f"{type(exc).__name__}: {exc}", traceback=format_traceback(exc),
        )  # fmt: skip
    reset_s = time.perf_counter() - started
    messages = list(observation.messages)
    tools: Sequence[ToolSpec] = observation.tools or env.spec.tools
    turns: list[Turn] = []
    limit = max_turns if max_turns is not None else env.spec.budgets.max_turns
    result = StepResult()
    while len(turns) < limit:
        t0 = time.perf_counter()
        try:
            reply = await policy(tuple(messages), tuple(tools))
        except EpisodeTruncated as stop:
            if not turns:
                return Episode(
                    env_id=env.spec.id, task=task, messages=tuple(messages), turns=(),
                    outcome=Outcome.ENV_ERROR, reward=None, done=False, truncated=True,
                    timings={"reset_s": reset_s, "policy_s": time.perf_counter() - t0, "env_s": reset_s},
                    error=f"the first prompt does not fit the policy: {stop}",
                )  # fmt: skip
            result = result.model_copy(update={"info": {**result.info, "truncated_by_policy": str(stop)}})
            break
        t1 = time.perf_counter()
        action = reply if isinstance(reply, Action) else parse_action(reply)
        try:
            result = await env.step(action)
        except STOPS_THE_RUN:
            raise
        except Exception as exc:  # an env not wrapped in BudgetedEnv, or a bug in the wrapper
            outcome = outcome_of_error(exc)
            info = {"error": f"{type(exc).__name__}: {exc}", "traceback": format_traceback(exc)}
            result = StepResult(done=True, outcome=outcome, info=info)
        t2 = time.perf_counter()
        turns.append(Turn(action=action, result=result, policy_s=t1 - t0, env_s=t2 - t1))
        messages.append(Message(role="assistant", content=action.text))
        messages.extend(result.observation.messages)
        if result.observation.tools:
            tools = result.observation.tools
        if result.done or result.truncated:
            break
    outcome = result.outcome
    rewards = [t.result.reward for t in turns if t.result.reward is not None]
    reward = float(sum(rewards)) if outcome.trainable and rewards else None
    if outcome.trainable and reward is None:
        reward = 0.0  # the episode ran out of turns before the env scored it
    return Episode(
        env_id=env.spec.id,
        task=task,
        messages=tuple(messages),
        turns=tuple(turns),
        outcome=outcome,
        reward=reward,
        done=result.done,
        truncated=result.truncated or not (result.done or result.truncated),
        timings={
            "reset_s": reset_s,
            "policy_s": sum(t.policy_s for t in turns),
            "env_s": reset_s + sum(t.env_s for t in turns),
        },
        error=result.info.get("error") if not outcome.trainable else None,
        traceback=result.info.get("traceback") if not outcome.trainable else None,
    )


def scripted_policy(actions: Sequence[Action | str]) -> Policy:
    """A policy that plays ``actions`` in order (the env's gold answer, a test script)."""
    queue = list(actions)

    async def play(messages: Sequence[Message], tools: Sequence[ToolSpec]) -> Action | str:
        if not queue:
            raise EnvError("scripted policy ran out of actions before the episode ended")
        return queue.pop(0)

    return play

"""A labrl episode as a remote client sees it, whatever the protocol.

- The action is the model's reply text, exactly as the harness hands it to the
  env: tool calls are ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, parsed by ``labrl.envs.actions.parse_action`` on the server.
- The observation carries the new messages (the opening prompt at reset), the
  tools, and on a step the labrl ``outcome``; ``error`` is its one line when the
  outcome is not ``ok``.
- The reward is labrl's: ``None`` for ``timeout``, ``env_error`` and
  ``verifier_failed`` (never a 0), the env's penalty for an ``invalid_action``
  that ends the episode. ``done`` is true when labrl's episode is over, by
  the env (``done``) or by its turn budget (``truncated``, kept separately).
- A task is shown by what selects it (split, seed) and its id, never its answer.
- A reset that fails has no step to carry its outcome: it is an ``EnvError``
  whose message starts with the kind (``timeout: ...``, ``env_error: ...``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from labrl.envs.actions import parse_action
from labrl.envs.budgets import outcome_of_error
from labrl.envs.types import Action, Message, Observation, Outcome, Split, StepResult, Task, ToolSpec
from labrl.errors import EnvError

#: StepResult.info keys a client does not get: the traceback stays in the server's log
PRIVATE_INFO_KEYS = frozenset({"traceback", "error"})


class WireAction(BaseModel):
    text: str = Field(
        description="the model's reply as written; tool calls as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks'
    )

    def to_labrl(self) -> Action:
        return parse_action(self.text)


class WireTask(BaseModel):
    env_id: str
    split: Split
    seed: int = Field(
        description="the task's index in its split: reset with the same split and seed to replay it"
    )
    task_id: str


class WireObservation(BaseModel):
    messages: list[Message] = Field(
        default_factory=list, description="new messages: the prompt at reset, then the env's replies"
    )
    tools: list[ToolSpec] = Field(default_factory=list, description="the tools the model may call")
    outcome: Outcome | None = Field(
        default=None, description="how the step ended (labrl's outcome); None at reset"
    )
    truncated: bool = Field(default=False, description="the episode ran out of turns (max_turns)")
    error: str | None = Field(default=None, description="one line, when the outcome is not ok")
    info: dict[str, Any] = Field(default_factory=dict, description="the env's step info")
    task: WireTask | None = Field(default=None, description="the task the episode plays (at reset)")


def task_view(task: Task) -> WireTask:
    return WireTask(env_id=task.env_id, split=task.split, seed=task.seed, task_id=task.task_id)


def reset_fields(task: Task, observation: Observation, default_tools: tuple[ToolSpec, ...]) -> dict[str, Any]:
    """The ``WireObservation`` fields of a reset (the env's tools when the observation names none)."""
    return {
        "messages": list(observation.messages),
        "tools": list(observation.tools or default_tools),
        "info": dict(observation.info),
        "task": task_view(task),
    }


def step_fields(result: StepResult) -> dict[str, Any]:
    """The ``WireObservation`` fields of a step; reward and done are ``step_reward`` and ``step_done``."""
    return {
        "messages": list(result.observation.messages),
        "tools": list(result.observation.tools),
        "outcome": result.outcome,
        "truncated": result.truncated,
        "error": result.info.get("error") if result.outcome is not Outcome.OK else None,
        "info": {k: v for k, v in result.info.items() if k not in PRIVATE_INFO_KEYS},
    }


def step_reward(result: StepResult) -> float | None:
    """labrl's reward, None where the outcome is not trainable (a failed verifier is never a 0)."""
    return result.reward if result.outcome.trainable else None


def step_done(result: StepResult) -> bool:
    return result.done or result.truncated


def reset_failure(exc: BaseException) -> EnvError:
    """The error a client sees for a reset that raised ``exc``: its message starts with the kind."""
    return EnvError(f"{outcome_of_error(exc).value}: {type(exc).__name__}: {exc}")

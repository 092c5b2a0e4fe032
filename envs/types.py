"""The Env contract: the records every labrl environment speaks.

One async API for every environment, fast or slow, local or remote::

    env = labrl.envs.make("xrd/phase-id-v0")
    task = env.make_task("train", seed=0)          # deterministic per (split, seed)
    obs = await env.reset(task)                    # Observation: messages + tools
    result = await env.step(Action(text="..."))    # StepResult: reward, done, outcome
    await env.close()

All records are pydantic models so they round-trip through JSON (they cross
process, HTTP and Ray boundaries). They are frozen: a record is a fact about
what happened, never updated in place.

``Outcome`` classifies how a step ended. Only ``ok`` and ``invalid_action``
carry a reward the learner may train on; ``timeout``, ``env_error`` and
``verifier_failed`` are infrastructure failures, and the harness masks those
episodes from training and counts them (a broken verifier must never look
like a wrong answer).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Role = Literal["system", "user", "assistant", "tool"]
Split = Literal["train", "test"]

ENV_ID_PATTERN = re.compile(
    r"^(?:(?P<namespace>[a-z0-9][a-z0-9_.-]*)/)?(?P<name>[a-z0-9][a-z0-9_.-]*?)-v(?P<version>\d+)$"
)


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Outcome(StrEnum):
    """How a step ended.

    - ``ok``: the env processed the action; the reward (if any) is meaningful.
    - ``invalid_action``: the action was unusable (malformed answer, unknown
      tool); the env answered with a message the model can read. Trainable:
      the reward is the env's penalty for a bad action.
    - ``timeout``: a phase overran its budget deadline. Not trainable.
    - ``env_error``: the environment or its backend failed. Not trainable.
    - ``verifier_failed``: scoring failed or returned garbage. Not trainable.
    """

    OK = "ok"
    INVALID_ACTION = "invalid_action"
    TIMEOUT = "timeout"
    ENV_ERROR = "env_error"
    VERIFIER_FAILED = "verifier_failed"

    @property
    def trainable(self) -> bool:
        return self in (Outcome.OK, Outcome.INVALID_ACTION)


class Message(_Record):
    role: Role
    content: str
    name: str | None = None
    tool_call_id: str | None = None


class ToolSpec(_Record):
    """A tool the model may call; ``parameters`` is a JSON schema object."""

    name: str
    description: str
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolCall(_Record):
    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Task(_Record):
    """One problem, drawn deterministically from (env id, split, seed).

    ``prompt`` holds what the model is shown (env-specific data); ``answer``
    is the hidden key where one exists (None for label-free tasks).
    """

    env_id: str
    split: Split
    seed: int
    task_id: str
    prompt: dict[str, Any] = Field(default_factory=dict)
    answer: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Observation(_Record):
    """Messages to append to the conversation and the tools now on offer."""

    messages: tuple[Message, ...] = ()
    tools: tuple[ToolSpec, ...] = ()
    info: dict[str, Any] = Field(default_factory=dict)


class Action(_Record):
    """The model's assistant turn: its raw text and the tool calls parsed from it.

    ``parse_error`` is set when the text contained a tool-call block that did
    not parse; envs answer such actions with ``invalid_action``.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    parse_error: str | None = None


class StepResult(_Record):
    observation: Observation = Field(default_factory=Observation)
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    outcome: Outcome = Outcome.OK
    info: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _reward_is_finite(self) -> StepResult:
        if self.reward is not None and not (-1e30 < self.reward < 1e30):
            raise ValueError(f"reward must be a finite number, got {self.reward!r}")
        if not self.outcome.trainable and self.reward is not None:
            raise ValueError(f"outcome {self.outcome.value!r} carries no reward; got reward={self.reward}")
        return self


class Budgets(_Record):
    """Limits the framework enforces for every episode of an env.

    Timeouts are seconds per phase; ``scoring_timeout_s`` bounds calls made
    through ``Env.score``. Retries apply to ``TransientEnvError`` only, with
    exponential backoff ``min(retry_backoff_cap_s, retry_backoff_s * 2**attempt)``
    (``labrl.resilience.Backoff``). The 30 s cap binds only for envs that raise
    ``max_retries`` (the defaults wait 0.5 s, then 1 s): a backend still down after
    half a minute is better asked again every 30 s than after 256 s on the tenth
    try. ``pools`` names concurrency limits shared by all episodes in the process
    (``{"lab": 4}``).
    """

    reset_timeout_s: float = Field(default=60.0, gt=0)
    step_timeout_s: float = Field(default=300.0, gt=0)
    scoring_timeout_s: float = Field(default=120.0, gt=0)
    max_turns: int = Field(default=1, ge=1)
    max_retries: int = Field(default=2, ge=0)
    retry_backoff_s: float = Field(default=0.5, ge=0)
    retry_backoff_cap_s: float = Field(default=30.0, ge=0)
    pools: dict[str, int] = Field(default_factory=dict)

    @field_validator("pools")
    @classmethod
    def _positive_pools(cls, pools: dict[str, int]) -> dict[str, int]:
        for name, size in pools.items():
            if size < 1:
                raise ValueError(f"pool {name!r} must allow at least 1 concurrent user, got {size}")
        return pools


class EnvSpec(_Record):
    """What an env is: id, version, budgets and the tools it offers."""

    id: str
    description: str = ""
    budgets: Budgets = Field(default_factory=Budgets)
    tools: tuple[ToolSpec, ...] = ()
    tags: tuple[str, ...] = ()
    license: str = "Apache-2.0"
    has_gold_answer: bool = False

    @field_validator("id")
    @classmethod
    def _versioned_id(cls, value: str) -> str:
        if not ENV_ID_PATTERN.match(value):
            raise ValueError(
                f"env id {value!r} must look like 'namespace/name-vN' (lowercase, e.g. 'xrd/phase-id-v0')"
            )
        return value

    @property
    def version(self) -> int:
        match = ENV_ID_PATTERN.match(self.id)
        assert match is not None  # validated on construction
        return int(match["version"])

"""One Open Reward Standard session: one labrl episode (``labrl.interop.ors_server`` serves it).

What the session's routes answer, as plain JSON values (the ``openreward`` SDK's
shapes, which its client reads):

- Tools (``/tools``): ``{tools: [{name, description, input_schema}], terminal_tool:
  {name, arg, description}, supports_score_group, message_block_types}``. The env's
  tools, sorted by name, each with the env's JSON schema; the ``@terminal`` tool
  ``answer(text)`` is listed apart (a harness sends the model's plain reply there).
- Prompt: ``/messages`` is ``[{role, blocks: [{text, detail, type: "text"}], detail}]``,
  the first observation's messages, a labrl ``tool`` message in a ``user`` turn (ORS
  has no tool role); ``/prompt`` is its flattening (the SDK's rule): a lone user
  message's blocks, else each message's blocks after a ``[role]`` text block whose
  ``detail`` is ``{role}``.
- A call answers ``{ok: true, output: {blocks, metadata, reward, finished}}`` or
  ``{ok: false, error, reason}``, ``reason`` one of ``not_found`` (no such tool),
  ``input_validation`` (``answer`` without a string ``text``) and
  ``episode_finished`` (a call after a ``finished`` one; the SDK's message). A
  tool call is the labrl step whose text is that one ``<tool_call>`` block (the
  env validates the arguments); ``answer`` is the step with that text. Calls run
  one at a time (a labrl env plays one step at a time).
- Output: blocks are the new messages' text, reward labrl's (None for
  ``timeout``, ``env_error``, ``verifier_failed``: never a 0), finished when
  labrl's episode is over, metadata ``{outcome, truncated, error, info}``
  (``labrl.interop.wire``).
- A reset that failed is kept as the session's error: ``EnvError`` whose
  message names the kind (``wire.reset_failure``), or the ``STOPS_THE_RUN``
  error itself. A lab or judge refusing our key during a step raises it, and
  every later call of the session raises it again: nothing is scored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import Any

from labrl.envs.actions import format_tool_call, parse_action
from labrl.envs.base import Env
from labrl.envs.budgets import STOPS_THE_RUN
from labrl.envs.registry import make
from labrl.envs.types import Message, Observation, Split, StepResult, Task, ToolSpec
from labrl.interop import wire
from labrl.interop.servers import ServeSettings

SPLITS: tuple[Split, ...] = ("train", "test")
#: the @terminal tool a harness sends the model's plain reply to, and its one argument
ANSWER_TOOL = "answer"
ANSWER_ARG = "text"
ANSWER_DESCRIPTION = "The model's plain reply (its answer turn), scored by the env."
#: the blocks a session serves (labrl's messages are text)
MESSAGE_BLOCK_TYPES = ["text"]


def tools_listing(tools: Sequence[ToolSpec]) -> dict[str, Any]:
    """The ``/tools`` answer for an env with ``tools``."""
    return {
        "tools": [
            {"name": t.name, "description": t.description.strip(), "input_schema": dict(t.parameters)}
            for t in sorted(tools, key=lambda t: t.name)
        ],
        "terminal_tool": {"name": ANSWER_TOOL, "arg": ANSWER_ARG, "description": ANSWER_DESCRIPTION},
        "supports_score_group": False,
        "message_block_types": MESSAGE_BLOCK_TYPES,
    }


def text_block(text: str, detail: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"text": text, "detail": detail, "type": "text"}


def ors_role(message: Message) -> str:
    return "user" if message.role == "tool" else message.role


def messages_view(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [{"role": ors_role(m), "blocks": [text_block(m.content)], "detail": None} for m in messages]


def prompt_blocks(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The SDK's flattening of a conversation into prompt blocks (see the module docstring)."""
    if len(messages) == 1 and ors_role(messages[0]) == "user":
        return [text_block(messages[0].content)]
    blocks = []
    for m in messages:
        role = ors_role(m)
        blocks += [text_block(f"[{role}]", {"role": role}), text_block(m.content)]
    return blocks


def tool_output(result: StepResult) -> dict[str, Any]:
    """A labrl step as a successful call's answer."""
    fields = wire.step_fields(result)
    reward = wire.step_reward(result)
    return {
        "ok": True,
        "output": {
            "blocks": [text_block(m.content) for m in result.observation.messages],
            "metadata": {k: fields[k] for k in ("outcome", "truncated", "error", "info")},
            "reward": None if reward is None else float(reward),
            "finished": wire.step_done(result),
        },
    }


def call_refused(reason: str, error: str) -> dict[str, Any]:
    return {"ok": False, "error": error, "reason": reason}


def episode_finished(name: str) -> dict[str, Any]:
    return call_refused(
        "episode_finished",
        f"{name!r} was not run: the episode has finished (a tool returned finished=True), "
        "so no further tool calls are accepted.",
    )


class OrsSession:
    """One labrl env playing one task; ``open`` builds it, ``start`` resets it in the background."""

    def __init__(self, env: Env, task: Task) -> None:
        self.env = env
        self.task = task
        self.last_seen = time.monotonic()  # the reaper's clock: every request of the session moves it
        self.setup: asyncio.Task[None] | None = None
        self.opening: Observation | None = None
        self.error: BaseException | None = None  # the reset's failure
        self.calls: dict[str, asyncio.Task[tuple[str, str]]] = {}  # task id -> call, for a resumed stream
        self._tools = frozenset(t.name for t in env.spec.tools)
        self._refused: BaseException | None = None
        self._finished = False
        self._turn = asyncio.Lock()

    @classmethod
    async def open(cls, settings: ServeSettings, split: Split, seed: int) -> OrsSession:
        """The env built off the event loop: an env's constructor may load data (a phase library)."""

        def build() -> tuple[Env, Task]:
            env = make(settings.env_id, **settings.options)
            return env, env.make_task(split, seed)

        return cls(*await asyncio.to_thread(build))

    def start(self) -> None:
        self.setup = asyncio.create_task(self._reset())

    async def _reset(self) -> None:
        try:
            self.opening = await self.env.reset(self.task)
        except STOPS_THE_RUN as exc:
            self.error = exc
        except Exception as exc:  # no step to carry it: an error naming the kind
            self.error = wire.reset_failure(exc)

    def opened(self) -> Observation:
        if self.error is not None:
            raise self.error
        assert self.opening is not None, "served only after the reset is done"
        return self.opening

    async def call(self, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """One call of tool ``name`` (see the module docstring); raises a refused key's error."""
        if name != ANSWER_TOOL and name not in self._tools:
            return call_refused("not_found", f"{name!r} is not a valid tool")
        if self._finished:
            return episode_finished(name)
        async with self._turn:
            if self._finished:  # the call queued ahead of this one ended the episode
                return episode_finished(name)
            if name == ANSWER_TOOL:
                text = arguments.get(ANSWER_ARG)
                if not isinstance(text, str):
                    error = f"Tool input validation error: {ANSWER_TOOL} takes a string {ANSWER_ARG!r}"
                    return call_refused("input_validation", error)
            else:
                text = format_tool_call(name, dict(arguments))
            if self._refused is not None:
                raise self._refused
            try:
                result = await self.env.step(parse_action(text))
            except STOPS_THE_RUN as exc:
                self._refused = exc
                raise
            self._finished = wire.step_done(result)
            return tool_output(result)

    async def close(self) -> None:
        if self.setup is not None and not self.setup.done():
            self.setup.cancel()
            await asyncio.gather(self.setup, return_exceptions=True)
        await self.env.close()

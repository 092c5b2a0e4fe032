"""Serve any registered labrl env over the Open Reward Standard (``openreward`` 0.1, ``labrl[ors]``).

Built on the SDK's own server, ``openreward.environments.Server``: it owns the
wire protocol (routes, sessions, SSE tool calls, the ping reaper); this module
gives it one ``openreward.environments.Environment`` subclass per served env,
whose route name is the id with ``/`` as ``--`` (``xrd--phase-id-tools-v0``;
the server's first env is also served at ``/``).

- Splits ``train`` and ``test``; task ``index`` of a split is labrl's
  ``make_task(split, index)``, shown as ``{env_id, split, seed, task_id}``
  (never the answer). ``num_tasks`` is ``tasks_per_split``; a session made
  from a task spec (``session(task=...)``) may name any seed.
- A session is one labrl episode on one labrl env (``make``, so wrapped in
  ``BudgetedEnv``): the SDK builds the env (off the event loop), ``setup`` is
  labrl's ``reset``, ``teardown`` its ``close``. The prompt is the first
  observation's messages (``/messages``, role-tagged; ``/prompt`` is the SDK's
  flattened rendering of them; a labrl ``tool`` message rides in a ``user``
  turn, as ORS places tool results).
- Tools: each of the env's tools is an ORS tool with the env's JSON schema;
  a call is the labrl step whose text is that one ``<tool_call>`` block (the
  env validates the arguments). The answer is the ``@terminal`` tool
  ``answer(text)``: a harness sends the model's plain reply there, and it is
  the labrl step with that text. Every tool is ``exclusive``: a labrl env
  plays one step at a time.
- A call answers ``{blocks, reward, finished, metadata}``: blocks are the new
  messages' text, reward labrl's (None for ``timeout``, ``env_error``,
  ``verifier_failed``: never a 0), finished when labrl's episode is over
  (after which the SDK refuses calls, reason ``episode_finished``), metadata
  ``{outcome, truncated, error, info}`` (``labrl.interop.wire``).
- What no step can carry is an error: a reset that failed (``/prompt``,
  ``/messages`` and ``/call`` answer HTTP 500 ``EnvError: env_error: ...``),
  and a lab or judge refusing our key (HTTP 401/403,
  ``CredentialsRefusedError``): the call's SSE ``error`` event (the SDK's
  client raises ``ToolFailed`` and marks the session dead), and every later
  call of the session answers the same error, nothing scored.
- ``max_sessions`` caps the sessions held at once: one more is HTTP 429 with
  ``Retry-After`` (the SDK's client retries it). ORS has no metadata route; the
  manifest's parts are on its own routes (``/splits``, ``/tools``, ``/tasks``).

This module imports ``openreward`` through ``labrl.extras.import_extra``; no
``from __future__ import annotations``: the SDK reads tool signatures'
annotations as types.
"""

import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_jsonable_python

from labrl.envs.actions import format_tool_call
from labrl.envs.base import Env
from labrl.envs.budgets import STOPS_THE_RUN
from labrl.envs.registry import make
from labrl.envs.types import Message, Observation, Split, StepResult, Task, ToolSpec
from labrl.errors import ConfigError
from labrl.extras import import_extra
from labrl.interop import wire
from labrl.interop.manifest import route_name
from labrl.interop.servers import ServeSettings

_ors = import_extra("openreward.environments", "ors")
_fastapi = import_extra("fastapi", "ors")

ToolOutput = _ors.ToolOutput
SPLITS: tuple[Split, ...] = ("train", "test")
#: the @terminal tool a harness sends the model's plain reply to
ANSWER_TOOL = "answer"
#: seconds a client refused for capacity is asked to wait before it retries
CAPACITY_RETRY_AFTER_S = 2


class Answer(BaseModel):
    text: str = Field(description="the model's reply as written; it is scored as labrl's answer turn")


class ToolArguments(BaseModel):
    """A labrl tool's arguments as ORS hands them over: any object; the env validates them."""

    model_config = ConfigDict(extra="allow")


def arguments_model(spec: ToolSpec) -> type[ToolArguments]:
    """The SDK reads a tool's schema from its argument model: this one publishes the env's own."""
    parameters = dict(spec.parameters)

    class Arguments(ToolArguments):
        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
            return dict(parameters)

    Arguments.__name__ = f"{spec.name}_arguments"
    return Arguments


def ors_message(message: Message) -> Any:
    role = "user" if message.role == "tool" else message.role
    return _ors.Message(role=role, blocks=[_ors.TextBlock(text=message.content)])


def tool_output(result: StepResult) -> Any:
    """A labrl step as ORS's ``ToolOutput`` (see the module docstring)."""
    fields = wire.step_fields(result)
    metadata = {k: fields[k] for k in ("outcome", "truncated", "error", "info")}
    return ToolOutput(
        blocks=[_ors.TextBlock(text=m.content) for m in result.observation.messages],
        metadata=to_jsonable_python(metadata, fallback=str),
        reward=wire.step_reward(result),
        finished=wire.step_done(result),
    )


class LabrlOrsEnvironment(_ors.Environment):  # type: ignore[misc, name-defined]
    """One ORS session: one labrl episode. ``environment_class`` makes a subclass per served env."""

    settings: ClassVar[ServeSettings]
    _catalog: ClassVar[Env | None] = None  # builds task views; make_task is pure
    _sessions: ClassVar[int] = 0
    _sessions_lock: ClassVar[threading.Lock]

    def __init__(
        self, task_spec: dict[str, Any] | None = None, secrets: dict[str, str] | None = None
    ) -> None:
        super().__init__(task_spec=task_spec or {}, secrets=secrets or {})
        shown = wire.WireTask.model_validate(task_spec or {})
        if shown.env_id != self.settings.env_id:
            raise ConfigError(f"task {shown.task_id!r} is not a task of {self.settings.env_id}")
        self._hold_a_session()
        try:
            self._env: Env = make(self.settings.env_id, **self.settings.options)
            self._task: Task = self._env.make_task(shown.split, shown.seed)
        except BaseException:  # no session was made: the SDK will never tear it down
            self._release_a_session()
            raise
        self._opening: Observation | None = None
        self._refused: BaseException | None = None

    @classmethod
    def _hold_a_session(cls) -> None:
        with cls._sessions_lock:
            if cls._sessions >= cls.settings.max_sessions:
                raise _fastapi.HTTPException(
                    status_code=429,
                    detail=f"{cls.settings.max_sessions} sessions held at once: retry later",
                    headers={"Retry-After": str(CAPACITY_RETRY_AFTER_S)},
                )
            cls._sessions += 1

    @classmethod
    def _release_a_session(cls) -> None:
        with cls._sessions_lock:
            cls._sessions -= 1

    # -- the episode -------------------------------------------------------------------

    async def setup(self) -> None:
        try:
            self._opening = await self._env.reset(self._task)
        except STOPS_THE_RUN:
            raise
        except Exception as exc:  # no step to carry it: an error naming the kind
            raise wire.reset_failure(exc) from exc

    async def teardown(self) -> None:
        try:
            await self._env.close()
        finally:
            self._release_a_session()

    async def get_messages(self) -> list[Any]:
        assert self._opening is not None  # the SDK serves the prompt only after setup
        return [ors_message(m) for m in self._opening.messages]

    async def step_text(self, text: str) -> Any:
        """Play ``text`` as labrl's next step; a refused key stops the session for good."""
        if self._refused is not None:
            raise self._refused
        try:
            result = await self._env.step(wire.WireAction(text=text).to_labrl())
        except STOPS_THE_RUN as exc:
            self._refused = exc
            raise
        return tool_output(result)

    @_ors.terminal
    @_ors.tool
    async def answer(self, args: Answer) -> ToolOutput:  # type: ignore[valid-type]  # the SDK's class
        """The model's plain reply (its answer turn), scored by the env."""
        return await self.step_text(args.text)

    # -- splits and tasks ----------------------------------------------------------------

    @classmethod
    def list_splits(cls) -> Sequence[str]:
        return list(SPLITS)

    @classmethod
    def list_tasks(cls, split: str) -> Sequence[dict[str, Any]]:
        return [cls.task_view(split, index) for index in range(cls.settings.tasks_per_split)]

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return cls.settings.tasks_per_split

    @classmethod
    def get_task(cls, split: str, index: int) -> dict[str, Any]:
        if not 0 <= index < cls.settings.tasks_per_split:
            raise IndexError(index)  # the SDK answers 400 "Invalid index"
        return cls.task_view(split, index)

    @classmethod
    def task_view(cls, split: str, index: int) -> dict[str, Any]:
        if cls._catalog is None:
            cls._catalog = make(cls.settings.env_id, checked=False, **cls.settings.options)
        return wire.task_view(cls._catalog.make_task(split, index)).model_dump()  # type: ignore[arg-type]


def _tool_method(spec: ToolSpec) -> Callable[..., Any]:
    """An ORS tool calling the labrl tool ``spec``: one step whose text is that tool call."""

    async def call(self: LabrlOrsEnvironment, args: ToolArguments) -> Any:
        return await self.step_text(format_tool_call(spec.name, args.model_dump()))

    call.__annotations__ = {"args": arguments_model(spec), "return": ToolOutput}
    call.__name__ = call.__qualname__ = spec.name
    call.__doc__ = spec.description
    return _ors.tool(exclusive=True)(call)


def environment_class(settings: ServeSettings) -> type[LabrlOrsEnvironment]:
    """A ``LabrlOrsEnvironment`` subclass serving ``settings.env_id``, its tools as ORS tools."""
    tools = make(settings.env_id, checked=False, **settings.options).spec.tools
    taken = set(dir(LabrlOrsEnvironment))
    clashing = sorted(t.name for t in tools if t.name in taken)
    if clashing:  # a tool named like the ORS environment's own attributes would replace them
        raise ConfigError(
            f"{settings.env_id}: tool name(s) {', '.join(clashing)} clash with the ORS environment's own "
            f"attributes (the answer tool is {ANSWER_TOOL!r}); it cannot be served over ORS"
        )
    namespace: dict[str, Any] = {t.name: _tool_method(t) for t in tools}
    namespace.update(settings=settings, _sessions_lock=threading.Lock(), __module__=__name__)
    return type(route_name(settings.env_id), (LabrlOrsEnvironment,), namespace)


def create_app(settings: ServeSettings) -> Any:
    """The FastAPI app serving ``settings.env_id`` over ORS (the SDK's ``Server``)."""
    return _ors.Server([environment_class(settings)]).app

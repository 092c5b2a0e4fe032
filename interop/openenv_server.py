"""Serve any registered labrl env over OpenEnv (``openenv`` 0.10, ``pip install 'labrl[openenv]'``).

Built on OpenEnv's own server, ``openenv.core.env_server.HTTPEnvServer``: it
awaits an environment's ``reset_async``/``step_async`` on the server's event
loop, so labrl's async envs run as they do under the harness, and it keeps
OpenEnv's wire protocol exactly:

- WebSocket ``/ws``: one session per connection, one labrl env (``make``, so
  wrapped in ``BudgetedEnv``) per session, many sessions at once. Messages
  ``{"type": "reset" | "step" | "state" | "close", "data": ...}``; answers
  ``{"type": "observation", "data": {"observation", "reward", "done"}}``,
  ``{"type": "state", ...}`` or ``{"type": "error", "data": {"message", "code"}}``.
- ``reset`` data: ``split`` (``train``/``test``, default ``train``) and
  ``index`` (OpenEnv's Task API) or ``seed``: labrl's task ``make_task(split,
  index)``; neither: a random seed, shown in the observation's ``task``.
- ``step`` data: ``{"text": the model's reply}`` (``labrl.interop.wire``).
- HTTP ``/reset``, ``/step``, ``/state`` build a fresh env per request (OpenEnv's
  rule), so a multi-turn episode needs the WebSocket; ``/health``, ``/schema``;
  the Task API ``/{route_name}/splits``, ``/tasks``, ``/num_tasks``, ``/task``.
- ``/metadata``: the manifest (``labrl.interop.manifest``), a superset of
  OpenEnv's ``EnvironmentMetadata``. OpenEnv's own route would cut it down to
  that model's fields, so ours is registered first and answers instead.

Errors: labrl's outcomes are data (``observation.outcome``, reward None unless
trainable, ``labrl.interop.wire``). What has no step to carry it becomes an
OpenEnv error frame (code ``EXECUTION_ERROR``) whose message starts with the
kind: a reset that fails (``timeout: ...``, ``env_error: ...``), a step with
no episode running. A lab or judge refusing our key (401/403,
``CredentialsRefusedError``) is an error frame too and ends the session's
use: every later reset or step answers the same error, nothing is scored.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Coroutine
from typing import Any, ClassVar

from labrl.envs.base import Env, no_episode_error
from labrl.envs.budgets import STOPS_THE_RUN
from labrl.envs.registry import make
from labrl.envs.types import Split, StepResult, Task
from labrl.errors import ConfigError
from labrl.extras import import_extra
from labrl.interop import wire
from labrl.interop.manifest import manifest, with_extra
from labrl.interop.servers import ServeSettings

_types = import_extra("openenv.core.env_server.types", "openenv")
_interfaces = import_extra("openenv.core.env_server.interfaces", "openenv")
_http = import_extra("openenv.core.env_server.http_server", "openenv")
_fastapi = import_extra("fastapi", "openenv")

#: how long an env's async close may take when OpenEnv closes a session from its worker thread
CLOSE_TIMEOUT_S = 30.0
SPLITS: tuple[Split, ...] = ("train", "test")


class OpenEnvAction(_types.Action, wire.WireAction):  # type: ignore[misc, name-defined]
    """OpenEnv's action (``metadata``) with labrl's ``text``."""


class OpenEnvObservation(_types.Observation, wire.WireObservation):  # type: ignore[misc, name-defined]
    """OpenEnv's observation (``done``, ``reward``, ``metadata``) with labrl's fields."""


class OpenEnvState(_types.State):  # type: ignore[misc, name-defined]
    env_id: str = ""
    task: wire.WireTask | None = None
    done: bool = False
    outcome: str | None = None
    reward: float | None = None


class LabrlEnvironment(_interfaces.Environment):  # type: ignore[misc, name-defined]
    """One OpenEnv session: one labrl env. ``environment_class`` makes a subclass per served env."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    settings: ClassVar[ServeSettings]

    def __init__(self) -> None:
        super().__init__()
        self._env: Env = make(self.settings.env_id, **self.settings.options)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the episode ran on
        self._runner: asyncio.Runner | None = None  # only for the sync reset/step
        self._refused: BaseException | None = None
        self._episode_id: str | None = None
        self._task: Task | None = None
        self._steps = 0
        self._last: StepResult | None = None
        self._reward: float | None = None

    # -- episode -------------------------------------------------------------------------

    async def reset_async(
        self,
        seed: int | None = None,
        episode_id: str | None = None,
        split: str = "train",
        index: int | None = None,
        **_: Any,
    ) -> OpenEnvObservation:
        self._loop = asyncio.get_running_loop()
        self._raise_if_refused()
        chosen = index if index is not None else seed
        task = self._env.make_task(_split(split), chosen if chosen is not None else random.randrange(2**31))
        try:
            observation = await self._env.reset(task)
        except STOPS_THE_RUN as exc:
            self._refused = exc
            raise
        except Exception as exc:  # no StepResult to carry it: an error frame naming the kind
            raise wire.reset_failure(exc) from exc
        self._episode_id = episode_id or uuid.uuid4().hex
        self._task, self._steps, self._last, self._reward = task, 0, None, None
        fields = wire.reset_fields(task, observation, self._env.spec.tools)
        return OpenEnvObservation(**fields, done=False, reward=None)

    async def step_async(
        self, action: OpenEnvAction, timeout_s: float | None = None, **_: Any
    ) -> OpenEnvObservation:
        self._raise_if_refused()
        if self._task is None or (self._last is not None and wire.step_done(self._last)):
            raise no_episode_error(self._env.spec.id)
        try:
            # the deadlines are labrl's budgets (BudgetedEnv); OpenEnv's optional timeout_s is not applied
            result = await self._env.step(action.to_labrl())
        except STOPS_THE_RUN as exc:
            self._refused = exc
            raise
        self._steps += 1
        self._last = result
        reward = wire.step_reward(result)
        if reward is not None:
            self._reward = (self._reward or 0.0) + reward
        return OpenEnvObservation(**wire.step_fields(result), done=wire.step_done(result), reward=reward)

    def _raise_if_refused(self) -> None:
        if self._refused is not None:
            raise self._refused

    @property
    def state(self) -> OpenEnvState:
        last = self._last
        return OpenEnvState(
            episode_id=self._episode_id,
            step_count=self._steps,
            env_id=self._env.spec.id,
            task=wire.task_view(self._task) if self._task is not None else None,
            done=last is not None and wire.step_done(last),
            outcome=last.outcome.value if last is not None else None,
            reward=self._reward,
        )

    # -- OpenEnv's sync entry points -------------------------------------------------------
    # OpenEnv's server awaits reset_async/step_async; these serve a caller without a loop, on
    # a loop of the instance's own (an env's connections are bound to the loop that opened them).

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> OpenEnvObservation:
        return self._run_sync(self.reset_async(seed=seed, episode_id=episode_id, **kwargs))

    def step(
        self, action: OpenEnvAction, timeout_s: float | None = None, **kwargs: Any
    ) -> OpenEnvObservation:
        return self._run_sync(self.step_async(action, timeout_s=timeout_s, **kwargs))

    def _run_sync(self, coro: Coroutine[Any, Any, OpenEnvObservation]) -> OpenEnvObservation:
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner.run(coro)

    def close(self) -> None:
        """Close the labrl env on the loop its episode ran on.

        OpenEnv calls this synchronously: from a session's worker thread when a
        WebSocket closes (wait for the close on the server's loop), on the loop
        itself for its per-request envs (schedule it; blocking would deadlock).
        """
        closing = self._env.close()
        if self._runner is not None:
            self._runner.run(closing)
            self._runner.close()
            return
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None:
            _keep_until_done(running.create_task(closing))
        elif self._loop is None:  # never reset: nothing of the env is bound to a loop
            asyncio.run(closing)
        else:
            asyncio.run_coroutine_threadsafe(closing, self._loop).result(timeout=CLOSE_TIMEOUT_S)

    # -- OpenEnv's Task API (discovery only: reset takes split and index) ------------------

    def list_splits(self) -> list[str]:
        return list(SPLITS)

    def num_tasks(self, split: str) -> int:
        _split(split)
        return self.settings.tasks_per_split

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return [self.get_task(split, index) for index in range(self.num_tasks(split))]

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_tasks(split):
            raise IndexError(index)
        return wire.task_view(self._env.make_task(_split(split), index)).model_dump()

    def get_metadata(self) -> Any:
        shown = metadata_payload(self.settings)
        return _types.EnvironmentMetadata(
            **{k: shown[k] for k in _types.EnvironmentMetadata.model_fields if k in shown}
        )


_closing: set[asyncio.Task[None]] = set()


def _keep_until_done(task: asyncio.Task[None]) -> None:
    _closing.add(task)  # the loop keeps only a weak reference to a task
    task.add_done_callback(_closing.discard)


def _split(split: str) -> Split:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    return split  # type: ignore[return-value]


def metadata_payload(settings: ServeSettings) -> dict[str, Any]:
    """The manifest as OpenEnv's ``/metadata`` publishes it: its fields first, labrl's beside them."""
    return with_extra(manifest(settings.env_id, settings.options), "openenv")


def environment_class(settings: ServeSettings) -> type[LabrlEnvironment]:
    """A ``LabrlEnvironment`` subclass bound to ``settings``: OpenEnv's server takes a class as factory."""
    name = "Labrl_" + "".join(c if c.isalnum() else "_" for c in settings.env_id)
    return type(name, (LabrlEnvironment,), {"settings": settings})


def create_app(settings: ServeSettings) -> Any:
    """The FastAPI app serving ``settings.env_id`` over OpenEnv."""
    metadata = metadata_payload(settings)  # built once: also fails early on an unknown id or bad option
    app = _fastapi.FastAPI(title=f"labrl {settings.env_id} (OpenEnv)", version=metadata["version"])

    @app.get("/metadata", tags=["Environment Info"])
    async def get_metadata() -> dict[str, Any]:
        return metadata

    server = _http.HTTPEnvServer(
        env=environment_class(settings),
        action_cls=OpenEnvAction,
        observation_cls=OpenEnvObservation,
        state_cls=OpenEnvState,
        max_concurrent_envs=settings.max_sessions,
        env_name=metadata["route_name"],
    )
    server.register_routes(app)
    return app

"""Serve any registered labrl env over the Open Reward Standard (ORS: the ``openreward`` SDK 0.1's protocol).

labrl's own server for the wire protocol of the SDK's ``openreward.environments.Server``
(read from openreward 0.1.167; only the SDK's client tests it). It needs no extra
(``labrl[ors]`` installs that client) and speaks ASGI directly (``labrl.interop.asgi``,
under uvicorn): the SDK's FastAPI server spent ~2.8 ms of CPU per step, ~97 % of it
outside the env. What a session answers is ``labrl.interop.ors_session``.

The protocol, as the SDK's client speaks it:

- Routes of the env are ``/{name}/ROUTE``, ``name`` the env id with ``/`` as ``--``
  (``xrd--phase-id-tools-v0``, any case), and ``/ROUTE`` too: the SDK's server
  answers those with a 308 to its first env, which the client follows; answering
  directly saves the round trip. A session's requests carry ``X-Session-ID``
  (missing: 400); ``X-Secrets`` is not used (labrl's envs read their keys from the
  server's environment).
- ``POST /create_session`` -> an SSE stream: ``task_id`` (a new sid), ``end`` (empty).
  ``POST /create`` ``{split, index}`` or ``{task_spec}`` (``env_name``,
  ``toolset_name`` optional: no toolsets are served) -> ``{sid}``; the env is built
  and its reset starts in the background. ``POST /delete`` -> ``{sid}`` once the
  env is closed; ``POST /delete_session`` -> ``{sid}`` (nothing left to do).
  ``POST /ping`` (the client's keepalive, every 10 s) -> ``{status: "ok"}``, 404
  for an unknown session.
- A session no request or ping touched for ``session_ttl_s`` (900 s, as the SDK's)
  is deleted by the reaper (checked every ``reap_every_s``, 5 s).
- ``/prompt``, ``/messages`` and ``/call`` wait for the reset, at most 25 s, then
  answer 503 ``Retry-After: 2`` ``X-Backend-State: starting`` (the client retries);
  a reset that failed answers its error (500); a session deleted meanwhile 410.
- ``POST /call`` ``{name, input, task_id?}`` -> an SSE stream: ``task_id`` (the
  call's id), a ``: ping`` comment every 10 s while the call runs (the client's
  read timeout is 30 s), then ``end`` with the answer's JSON, or ``error`` with
  the exception's text (the client raises ``ToolFailed`` and marks the session
  dead). A client that lost the stream posts again with ``task_id`` and gets
  that call's outcome, never a second run (``error`` ``unknown task_id`` for an
  id the session does not hold). One ``end`` event carries the whole answer
  (the SDK's server splits answers over 4 KiB into ``chunk`` events; the client
  joins either).
- Task routes: ``GET /splits`` -> ``[{name, type}]`` (``train``, ``test``);
  ``POST /num_tasks {split}`` -> ``{num_tasks}`` (``tasks_per_split``); ``POST
  /task {split, index}`` -> ``{task, env_name}`` (400 ``Invalid index``);
  ``POST /tasks {split}`` and ``/task_range {split, start, stop}`` (Python's
  slice rules) -> ``{tasks, env_name}``; an unknown split is 400 ``Invalid
  split``. A task is labrl's ``make_task(split, index)``, shown as ``{env_id,
  split, seed, task_id}`` (never the answer); a session made from a task spec
  may name any seed. ``GET /tools``, ``/task_tools`` (a session's: the same),
  ``/health``, ``/version``, ``/list_environments``; no ``/score_group`` (404).
- Errors answer ``{"detail": ...}``: a body that is not the route's 422; an
  exception 500 ``"{type}: {message}"`` (the SDK's ``return_errors="exception"``;
  a failed reset is ``EnvError: env_error: ...``). The client retries only 429,
  502, 503 and 504.
- ``max_sessions`` caps the sessions held (created and not yet closed): one more
  ``/create`` is 429 with ``Retry-After: 2`` (the client retries it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from pydantic_core import from_json, to_json

from labrl.envs.registry import make
from labrl.envs.types import Split
from labrl.errors import ConfigError
from labrl.interop import wire
from labrl.interop.asgi import (
    KEEPALIVE_COMMENT,
    HttpError,
    Receive,
    Scope,
    Send,
    event,
    header,
    lifespan,
    read_body,
    send_error,
    send_events,
    send_json,
    start_event_stream,
)
from labrl.interop.manifest import route_name
from labrl.interop.ors_session import (
    ANSWER_TOOL,
    SPLITS,
    OrsSession,
    messages_view,
    prompt_blocks,
    tools_listing,
)
from labrl.interop.servers import ServeSettings

logger = logging.getLogger(__name__)

SESSION_TTL_S = 900.0
REAP_EVERY_S = 5.0
#: how long a request waits for its session's reset before the client is told to retry
SETUP_WAIT_S = 25.0
#: seconds a client refused for capacity (or a starting session) is asked to wait before it retries
RETRY_AFTER_S = 2
#: seconds between keepalive comments of a running call's stream (the SDK's client gives up after 30 s silent)
KEEPALIVE_S = 10.0
#: a handler's answer when it has answered itself (an event stream)
STREAMED = object()


@dataclass
class Request:
    scope: Scope
    receive: Receive
    send: Send

    def sid(self) -> str:
        sid = header(self.scope, b"x-session-id")
        if not sid:
            raise HttpError(400, "X-Session-ID header is required")
        return sid.strip()

    async def json(self) -> dict[str, Any]:
        try:
            body = from_json(await read_body(self.receive))
        except ValueError as exc:
            raise HttpError(422, f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise HttpError(422, "the body must be a JSON object")
        return body


Handler = Callable[[Request], Awaitable[Any]]


def _field(body: dict[str, Any], key: str, kind: type, optional: bool = False) -> Any:
    value = body.get(key)
    if (value is None and optional) or (isinstance(value, kind) and not isinstance(value, bool)):
        return value
    raise HttpError(422, f"{key!r} must be {'null or ' if optional else ''}a JSON {kind.__name__}")


def _split(body: dict[str, Any]) -> Split:
    split = _field(body, "split", str)
    if split not in SPLITS:
        raise HttpError(400, "Invalid split")
    return split  # type: ignore[no-any-return]


class OrsServer:
    """The ASGI app serving ``settings.env_id`` over ORS (see the module docstring)."""

    def __init__(
        self,
        settings: ServeSettings,
        session_ttl_s: float = SESSION_TTL_S,
        reap_every_s: float = REAP_EVERY_S,
    ) -> None:
        self.settings = settings
        self.session_ttl_s = session_ttl_s
        self.reap_every_s = reap_every_s
        self._catalog = make(
            settings.env_id, checked=False, **settings.options
        )  # task views; make_task is pure
        tools = self._catalog.spec.tools
        if any(t.name == ANSWER_TOOL for t in tools):
            raise ConfigError(
                f"{settings.env_id}: a tool named {ANSWER_TOOL!r} clashes with ORS's terminal tool of that "
                "name (the model's plain reply); it cannot be served over ORS"
            )
        self.name = route_name(settings.env_id).lower()
        self._tools = tools_listing(tools)
        self._version = {"version": version("labrl"), "build_sha": None}
        self.sessions: dict[str, OrsSession] = {}
        self._held = 0  # sessions created and not yet closed: what max_sessions caps
        self._task_views: dict[str, list[dict[str, Any]]] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._root_routes: dict[str, tuple[str, Handler]] = {
            "health": ("GET", self.health),
            "version": ("GET", self.version),
            "list_environments": ("GET", self.list_environments),
            "ping": ("POST", self.ping),
            "create_session": ("POST", self.create_session),
            "create": ("POST", self.create),
            "delete": ("POST", self.delete),
            "delete_session": ("POST", self.delete_session),
        }
        self._env_routes: dict[str, tuple[str, Handler]] = {
            "tools": ("GET", self.tools),
            "task_tools": ("GET", self.task_tools),
            "splits": ("GET", self.splits),
            "num_tasks": ("POST", self.num_tasks),
            "task": ("POST", self.task),
            "tasks": ("POST", self.tasks),
            "task_range": ("POST", self.task_range),
            "prompt": ("GET", self.prompt),
            "messages": ("GET", self.messages),
            "call": ("POST", self.call),
            "score_group": ("POST", self.score_group),
        }

    # -- ASGI ------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(Request(scope, receive, send))
        elif scope["type"] == "lifespan":
            await lifespan(receive, send, self._start_reaper, self.shutdown)

    def _route(self, path: str) -> tuple[str, Handler]:
        parts = path.strip("/").split("/")
        if len(parts) == 1:
            found = self._root_routes.get(parts[0]) or self._env_routes.get(parts[0])
        elif len(parts) == 2 and parts[1] in self._env_routes:
            if parts[0].lower() != self.name:
                raise HttpError(404, f"unknown environment {parts[0]!r}")
            found = self._env_routes[parts[1]]
        else:
            found = None
        if found is None:
            raise HttpError(404, "Not Found")
        return found

    async def _http(self, request: Request) -> None:
        send = request.send
        try:
            method, handler = self._route(request.scope["path"])
            if request.scope["method"] != method:
                raise HttpError(405, "Method Not Allowed")
            answer = await handler(request)
            if answer is not STREAMED:
                await send_json(send, answer)
        except HttpError as error:
            await send_error(send, error)
        except Exception as exc:  # the SDK's server answers 500 naming the exception
            logger.warning(
                "%s %s: %s: %s", request.scope["method"], request.scope["path"], type(exc).__name__, exc
            )
            await send_error(send, HttpError(500, f"{type(exc).__name__}: {exc}"))

    # -- sessions --------------------------------------------------------------------------

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.reap_every_s)
            await self.reap()

    async def reap(self) -> None:
        """Delete every session no request touched for ``session_ttl_s``."""
        oldest = time.monotonic() - self.session_ttl_s
        for sid in [sid for sid, s in self.sessions.items() if s.last_seen < oldest]:
            await self._delete(sid)

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self._delete(sid) for sid in list(self.sessions)))

    async def _delete(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is not None:
            await self._close(session)

    async def _close(self, session: OrsSession) -> None:
        try:
            await session.close()
        except Exception:  # the session is gone either way; its env's close failure is the server's to log
            logger.exception("closing an ORS session of %s failed", self.settings.env_id)
        finally:
            self._held -= 1

    def _existing(self, request: Request) -> OrsSession:
        session = self.sessions.get(request.sid())
        if session is None:
            raise HttpError(404, "Active environment not found")
        session.last_seen = time.monotonic()
        return session

    async def _ready(self, request: Request) -> OrsSession:
        session = self._existing(request)
        setup = session.setup
        if setup is not None and not setup.done():
            done, _ = await asyncio.wait((setup,), timeout=SETUP_WAIT_S)
            if not done:
                raise HttpError(
                    503,
                    "Environment still starting.",
                    {"X-Backend-State": "starting", "Retry-After": str(RETRY_AFTER_S)},
                )
            if self.sessions.get(request.sid()) is not session:
                raise HttpError(410, "Session deleted")
        return session

    # -- root routes -----------------------------------------------------------------------

    async def health(self, request: Request) -> Any:
        return {"status": "ok"}

    async def version(self, request: Request) -> Any:
        return self._version

    async def list_environments(self, request: Request) -> Any:
        return [self.name]

    async def ping(self, request: Request) -> Any:
        self._existing(request)
        return {"status": "ok"}

    async def create_session(self, request: Request) -> Any:
        sid = str(uuid.uuid4())
        await start_event_stream(request.send, event("task_id", sid) + event("end", ""), more=False)
        return STREAMED

    async def delete_session(self, request: Request) -> Any:
        return {"sid": request.sid()}

    async def create(self, request: Request) -> Any:
        sid, body = request.sid(), await request.json()
        if sid in self.sessions:
            raise HttpError(400, "Session already exists")
        env_name = _field(body, "env_name", str, optional=True)
        if env_name is not None and env_name.lower() != self.name:
            raise HttpError(404, f"unknown environment {env_name!r}")
        if _field(body, "toolset_name", str, optional=True) is not None:
            raise HttpError(400, "labrl's ORS server serves no toolsets: an env's tools are its own")
        split, seed = self._chosen_task(body)
        if self._held >= self.settings.max_sessions:
            raise HttpError(
                429,
                f"{self.settings.max_sessions} sessions held at once: retry later",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        self._held += 1
        try:
            session = await OrsSession.open(self.settings, split, seed)
        except BaseException:
            self._held -= 1
            raise
        if sid in self.sessions:  # the same sid created twice at once: the first one made stays
            await self._close(session)
            raise HttpError(400, "Session already exists")
        self.sessions[sid] = session
        session.start()
        self._start_reaper()  # a server run without ASGI's lifespan protocol reaps too
        return {"sid": sid}

    def _chosen_task(self, body: dict[str, Any]) -> tuple[Split, int]:
        """The (split, seed) a ``/create`` names: a task spec, or a split and an index."""
        spec = _field(body, "task_spec", dict, optional=True)
        has_index = body.get("split") is not None and body.get("index") is not None
        if (spec is not None) == has_index:
            raise HttpError(422, "Provide either task_spec or both split and index, not both/neither")
        if spec is not None:
            try:
                shown = wire.WireTask.model_validate(spec)
            except ValueError as exc:
                raise HttpError(422, f"task_spec is not a task of this server: {exc}") from None
            if shown.env_id != self.settings.env_id:
                raise HttpError(400, f"task {shown.task_id!r} is not a task of {self.settings.env_id}")
            return shown.split, shown.seed
        split, index = _split(body), _field(body, "index", int)
        if not 0 <= index < self.settings.tasks_per_split:
            raise HttpError(400, "Invalid index")
        return split, index

    async def delete(self, request: Request) -> Any:
        sid = request.sid()
        await self._delete(sid)
        return {"sid": sid}

    # -- env routes ------------------------------------------------------------------------

    async def tools(self, request: Request) -> Any:
        return self._tools

    async def task_tools(self, request: Request) -> Any:
        session = self._existing(request)
        if session.error is not None:
            raise session.error
        return self._tools

    async def splits(self, request: Request) -> Any:
        return [{"name": split, "type": split} for split in SPLITS]

    async def num_tasks(self, request: Request) -> Any:
        _split(await request.json())
        return {"num_tasks": self.settings.tasks_per_split}

    def _task_view(self, split: Split, index: int) -> dict[str, Any]:
        return wire.task_view(self._catalog.make_task(split, index)).model_dump()

    async def _views(self, split: Split) -> list[dict[str, Any]]:
        if split not in self._task_views:  # off the loop: a split lists tasks_per_split tasks
            views = await asyncio.to_thread(
                lambda: [self._task_view(split, i) for i in range(self.settings.tasks_per_split)]
            )
            self._task_views[split] = views
        return self._task_views[split]

    async def task(self, request: Request) -> Any:
        body = await request.json()
        split, index = _split(body), _field(body, "index", int)
        if not 0 <= index < self.settings.tasks_per_split:
            raise HttpError(400, "Invalid index")
        return {"task": await asyncio.to_thread(self._task_view, split, index), "env_name": self.name}

    async def tasks(self, request: Request) -> Any:
        return {"tasks": await self._views(_split(await request.json())), "env_name": self.name}

    async def task_range(self, request: Request) -> Any:
        body = await request.json()
        split = _split(body)
        start, stop = _field(body, "start", int, optional=True), _field(body, "stop", int, optional=True)
        chosen = range(self.settings.tasks_per_split)[slice(start, stop)]
        views = await asyncio.to_thread(lambda: [self._task_view(split, i) for i in chosen])
        return {"tasks": views, "env_name": self.name}

    async def prompt(self, request: Request) -> Any:
        return prompt_blocks((await self._ready(request)).opened().messages)

    async def messages(self, request: Request) -> Any:
        return messages_view((await self._ready(request)).opened().messages)

    async def score_group(self, request: Request) -> Any:
        raise HttpError(404, f"Environment {self.name!r} does not implement score_group")

    async def call(self, request: Request) -> Any:
        """One tool call as an SSE stream (see the module docstring)."""
        session = await self._ready(request)
        session.opened()  # a failed reset answers its error before any stream starts
        body = await request.json()
        name, arguments = _field(body, "name", str), _field(body, "input", dict)
        task_id = _field(body, "task_id", str, optional=True)
        if task_id is None:
            task_id = uuid.uuid4().hex
            running = asyncio.create_task(_answer(session, name, arguments))
            session.calls[task_id] = running
        elif task_id not in session.calls:
            await start_event_stream(request.send, event("error", "unknown task_id"), more=False)
            return STREAMED
        else:
            running = session.calls[task_id]
        await start_event_stream(request.send, event("task_id", task_id))
        with contextlib.suppress(OSError):  # the client went away; the call's outcome waits for its resume
            while not running.done():
                done, _ = await asyncio.wait((running,), timeout=KEEPALIVE_S)
                if not done:
                    await send_events(request.send, KEEPALIVE_COMMENT)
            kind, data = ("error", "the call was cancelled") if running.cancelled() else running.result()
            await send_events(request.send, event(kind, data), more=False)
        return STREAMED


async def _answer(session: OrsSession, name: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """A call's last SSE event: ``end`` with the answer's JSON, or ``error`` with what it raised."""
    try:
        return "end", to_json(await session.call(name, arguments), fallback=str).decode()
    except Exception as exc:
        logger.warning("ORS call %s failed: %s: %s", name, type(exc).__name__, exc)
        return "error", str(exc)


def create_app(
    settings: ServeSettings, session_ttl_s: float = SESSION_TTL_S, reap_every_s: float = REAP_EVERY_S
) -> OrsServer:
    """The ASGI app serving ``settings.env_id`` over ORS."""
    return OrsServer(settings, session_ttl_s=session_ttl_s, reap_every_s=reap_every_s)

"""The three ways ``benchmarks/serve.py`` plays ``bench/wait-v0``: in-process, OpenEnv, ORS.

A ``Client`` hands out ``Slot``s; a slot is one concurrent session's client side. Every path
plays the same episode: reset, then ``turns`` steps whose text is ``WAIT_CALL``; each step must
come back ``ok`` and the last one must end the episode, else the episode is an error
(``BenchEpisodeError``). A step's latency is the time the caller waited for it.

- in-process: ``labrl.envs.make`` (``BudgetedEnv``), reset and step awaited directly;
- OpenEnv: ``GenericEnvClient``'s async API, one WebSocket per slot, reset per episode;
- ORS: the openreward SDK's ``AsyncOpenReward`` client; an ORS session is one episode, so a
  slot opens a session per episode (its prompt read, as a harness reads it) and calls the
  ``wait`` tool.

The protocol packages are imported where first used, through ``labrl.extras.import_extra`` (one
line naming the extra when missing); ``require_protocol`` checks for one before anything starts.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any

from _serve_env import ENV_ID, TOOL, WAIT_CALL

from labrl.envs import Env, make, parse_action
from labrl.extras import import_extra

IN_PROCESS = "in-process"
PROTOCOLS = ("openenv", "ors")
#: task indices an ORS session may name (the server's ``--tasks-per-split``)
TASKS_PER_SPLIT = 1000


class BenchEpisodeError(RuntimeError):
    """An episode that did not play as ``bench/wait-v0`` plays: a step not ``ok``, or no end."""


def _check_step(outcome: object, done: bool, last: bool) -> None:
    if outcome != "ok":
        raise BenchEpisodeError(f"step outcome {outcome!r}, expected 'ok'")
    if done != last:
        raise BenchEpisodeError(f"episode done={done} at {'the last' if last else 'an earlier'} step")


class Slot(ABC):
    """One concurrent session: ``open``, any number of ``episode``s (or one ``hold``), ``close``."""

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    async def episode(self, seed: int, turns: int, latencies: list[float]) -> None:
        """Play one episode of ``turns`` steps, appending each step's latency (seconds)."""

    @abstractmethod
    async def hold(self, seed: int) -> None:
        """Reset an episode and leave it idle until ``close`` (for the memory per idle session)."""

    @abstractmethod
    async def check(self) -> None:
        """Raise unless the held episode is still there (asks the server, for the protocols)."""

    @abstractmethod
    async def close(self) -> None: ...


class Client(ABC):
    """What a slot shares with the others (a connection pool); an async context manager."""

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    @abstractmethod
    def slot(self) -> Slot: ...


# -- in-process ------------------------------------------------------------------------------


class InProcessSlot(Slot):
    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options
        self._env: Env | None = None

    async def open(self) -> None:
        self._env = make(ENV_ID, **self._options)

    def _opened(self) -> Env:
        if self._env is None:
            raise RuntimeError("slot not open")
        return self._env

    async def episode(self, seed: int, turns: int, latencies: list[float]) -> None:
        env = self._opened()
        await env.reset(env.make_task("train", seed))
        for turn in range(turns):
            started = time.perf_counter()
            result = await env.step(parse_action(WAIT_CALL))  # the server parses the same text
            latencies.append(time.perf_counter() - started)
            _check_step(result.outcome.value, result.done or result.truncated, turn == turns - 1)

    async def hold(self, seed: int) -> None:
        env = self._opened()
        await env.reset(env.make_task("train", seed))

    async def check(self) -> None:
        self._opened().unwrapped.episode_task()

    async def close(self) -> None:
        if self._env is not None:
            await self._env.close()


class InProcessClient(Client):
    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options

    def slot(self) -> Slot:
        return InProcessSlot(self.options)


# -- OpenEnv ---------------------------------------------------------------------------------


class OpenEnvSlot(Slot):
    def __init__(self, url: str) -> None:
        self._url = url
        self._stack = AsyncExitStack()
        self._env: Any = None

    async def open(self) -> None:
        generic = import_extra("openenv.core.generic_client", "openenv")
        self._env = await self._stack.enter_async_context(generic.GenericEnvClient(base_url=self._url))

    async def episode(self, seed: int, turns: int, latencies: list[float]) -> None:
        await self._env.reset(split="train", index=seed)
        for turn in range(turns):
            started = time.perf_counter()
            result = await self._env.step({"text": WAIT_CALL})
            latencies.append(time.perf_counter() - started)
            _check_step(result.observation.get("outcome"), result.done, turn == turns - 1)

    async def hold(self, seed: int) -> None:
        await self._env.reset(split="train", index=seed)

    async def check(self) -> None:
        state = await self._env.state()
        if state.get("task") is None or state.get("done"):
            raise BenchEpisodeError(f"the held episode is gone: state {state}")

    async def close(self) -> None:
        await self._stack.aclose()


class OpenEnvClient(Client):
    def __init__(self, url: str) -> None:
        self.url = url

    def slot(self) -> Slot:
        return OpenEnvSlot(self.url)


# -- the Open Reward Standard ----------------------------------------------------------------


class OrsSlot(Slot):
    def __init__(self, environment: Any) -> None:
        self._environment = environment
        self._held = AsyncExitStack()
        self._session: Any = None

    async def open(self) -> None:
        return None  # an ORS session is one episode: each episode opens its own

    async def episode(self, seed: int, turns: int, latencies: list[float]) -> None:
        async with self._environment.session(split="train", index=seed % TASKS_PER_SPLIT) as session:
            await session.get_prompt()
            for turn in range(turns):
                started = time.perf_counter()
                output = await session.call_tool(TOOL, {})
                latencies.append(time.perf_counter() - started)
                _check_step((output.metadata or {}).get("outcome"), output.finished, turn == turns - 1)

    async def hold(self, seed: int) -> None:
        session_cm = self._environment.session(split="train", index=seed % TASKS_PER_SPLIT)
        self._session = await self._held.enter_async_context(session_cm)
        await self._session.get_prompt()

    async def check(self) -> None:
        if self._session is None:
            raise BenchEpisodeError("no session held")
        await self._session.get_prompt()  # the SDK raises for a session the server dropped

    async def close(self) -> None:
        await self._held.aclose()


class OrsClient(Client):
    def __init__(self, url: str) -> None:
        os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")  # never ask PyPI for a newer SDK
        self._openreward = import_extra("openreward", "ors")
        self.url = url
        self._api: Any = None
        self._environment: Any = None

    async def __aenter__(self) -> Client:
        self._api = self._openreward.AsyncOpenReward(api_key="local").environments
        self._environment = self._api.get(ENV_ID, base_url=self.url)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._api is not None:
            await self._api.aclose()

    def slot(self) -> Slot:
        if self._environment is None:
            raise RuntimeError("OrsClient used outside 'async with'")
        return OrsSlot(self._environment)


#: protocol -> (the module its client needs, the labrl extra that installs it)
CLIENT_MODULES = {"openenv": ("openenv.core.generic_client", "openenv"), "ors": ("openreward", "ors")}


def require_protocol(protocol: str) -> None:
    """``MissingExtraError`` (one line: what to install) unless this interpreter has the protocol."""
    if protocol not in CLIENT_MODULES:
        raise ValueError(f"unknown protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    import_extra(*CLIENT_MODULES[protocol])  # the server (same interpreter) needs the same package


def protocol_client(protocol: str, url: str) -> Client:
    """The protocol's own client against the server at ``url``."""
    if protocol == "openenv":
        return OpenEnvClient(url)
    if protocol == "ors":
        return OrsClient(url)
    raise ValueError(f"unknown protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")

"""The lab envs' connection to a lab: adapter + journal, one per event loop and lab.

Every experiment goes through ``RestLabAdapter`` and a ``JournaledLab``
(journal committed before the request goes out, idempotency keys, exactly-once
delivery), whichever lab is behind it:

- ``lab_url`` set: a real lab (or ``labrl lab serve-mock``) over HTTP; the API
  key is read from the environment variable ``api_key_env``; the journal is
  ``journal_path`` (default ``runs/lab/journal.sqlite``), so a restarted run
  re-attaches to its experiments instead of paying for them twice;
- ``lab_url`` unset (the default, and what ``labrl envs check`` uses): the
  mock lab in-process (``InProcessMockLab``) behind ``httpx.ASGITransport``,
  with its state and the journal in a temporary directory. Its bearer token
  is a random value put in the environment variable
  ``LABRL_INPROCESS_LAB_TOKEN`` for this process, read from there by both sides.

Connections are shared by every env instance on the same loop (the harness
makes one env per episode), so the completion feed and the HTTP connection
pool serve all episodes.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labrl.errors import ConfigError
from labrl.lab_adapters.job_journal import Journal
from labrl.lab_adapters.journaled_lab import JournaledLab, JournaledLabConfig
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

INPROCESS_TOKEN_ENV = "LABRL_INPROCESS_LAB_TOKEN"
DEFAULT_JOURNAL = Path("runs/lab/journal.sqlite")


@dataclass(frozen=True)
class LabSettings:
    lab_url: str | None
    api_key_env: str
    journal_path: str | None
    mock_latency_s: float
    fresh_journal: bool = False  # an empty or corrupt journal is set aside instead of refused


@dataclass
class LabConnection:
    adapter: RestLabAdapter
    journal: Journal
    lab: JournaledLab
    mock: Any = None  # InProcessMockLab when offline
    tmpdir: str | None = None

    async def aclose(self) -> None:
        await self.lab.aclose()
        await self.adapter.aclose()
        await self.journal.close()
        if self.mock is not None:
            await self.mock.aclose()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


_CONNECTIONS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[LabSettings, asyncio.Future[LabConnection]]
] = weakref.WeakKeyDictionary()


#: when set, ``connection`` returns what it makes instead of opening a lab connection in this process
#: (``backend=ray``: every experiment goes through the lab-gateway actor, labrl.harness.backends.ray)
_connection_factory: Callable[[LabSettings], Awaitable[Any]] | None = None


def use_connection_factory(factory: Callable[[LabSettings], Awaitable[Any]] | None) -> None:
    """Route this process's lab envs through ``factory`` (None: back to opening connections here)."""
    global _connection_factory
    _connection_factory = factory


def open_connections() -> list[LabConnection]:
    """The connections opened on the running loop (the lab gateway reports their counters)."""
    per_loop = _CONNECTIONS.get(asyncio.get_running_loop(), {})
    return [f.result() for f in per_loop.values() if f.done() and not f.cancelled() and f.exception() is None]


def check_settings(settings: LabSettings) -> None:
    """Fail at env construction, not mid-episode, when a real lab's key is missing."""
    if settings.lab_url is not None and not os.environ.get(settings.api_key_env):
        raise ConfigError(
            f"lab API key missing: set the environment variable {settings.api_key_env} "
            f"(or pass api_key_env= naming the variable that holds it)"
        )


async def connection(settings: LabSettings) -> LabConnection:
    """The shared connection for ``settings`` on the running loop (opened on first use)."""
    if _connection_factory is not None:
        return await _connection_factory(settings)
    loop = asyncio.get_running_loop()
    per_loop = _CONNECTIONS.setdefault(loop, {})
    future = per_loop.get(settings)
    if future is None:
        future = loop.create_future()
        per_loop[settings] = future
        try:
            future.set_result(await _open(settings))
        except BaseException as exc:
            per_loop.pop(settings, None)
            future.set_exception(exc)
            future.exception()  # retrieved: the waiters below get it too
            raise
    return await asyncio.shield(future)


async def _open(settings: LabSettings) -> LabConnection:
    feed = JournaledLabConfig(feed_wait_s=5.0, fallback_poll_s=10.0)
    if settings.lab_url is not None:
        adapter = RestLabAdapter(RestLabConfig(base_url=settings.lab_url, api_key_env=settings.api_key_env))
        journal = Journal(
            Path(settings.journal_path) if settings.journal_path else DEFAULT_JOURNAL,
            start_fresh=settings.fresh_journal,
        )
        return LabConnection(adapter, journal, JournaledLab(adapter, journal, feed))
    from labrl.lab_adapters.mock.server import InProcessMockLab, MockLabConfig

    os.environ.setdefault(INPROCESS_TOKEN_ENV, secrets.token_hex(16))
    tmpdir = tempfile.mkdtemp(prefix="labrl-inprocess-lab-")
    config = MockLabConfig(
        state_dir=Path(tmpdir) / "mock",
        token_env=INPROCESS_TOKEN_ENV,
        latency_median_s=settings.mock_latency_s,
        latency_sigma=0.3,
        port=0,
    )
    mock = await InProcessMockLab(config).start()
    # removed at exit (or when the loop and its connection are collected) even if never closed
    weakref.finalize(mock, shutil.rmtree, tmpdir, True)
    adapter = RestLabAdapter(
        RestLabConfig(base_url="http://mock-lab.inprocess", api_key_env=INPROCESS_TOKEN_ENV),
        transport=mock.transport(),
    )
    journal = Journal(
        Path(settings.journal_path) if settings.journal_path else Path(tmpdir) / "journal.sqlite",
        start_fresh=settings.fresh_journal,
    )
    return LabConnection(adapter, journal, JournaledLab(adapter, journal, feed), mock=mock, tmpdir=tmpdir)


async def close_connections() -> None:
    """Close every connection opened on the running loop (tests, clean shutdown)."""
    per_loop = _CONNECTIONS.pop(asyncio.get_running_loop(), {})
    for future in per_loop.values():
        if future.done() and not future.cancelled() and future.exception() is None:
            await future.result().aclose()

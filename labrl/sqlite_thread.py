"""SQLite for labrl's small crash-safe stores: one connection set-up, and one thread for async callers.

- ``connect_wal(path, synchronous=...)``: the set-up every store shares. Autocommit
  (``isolation_level=None``: a store opens its transactions with ``BEGIN``), WAL
  (readers never block the writer, and a process killed mid-write loses at most
  that write), ``busy_timeout`` 5 s (a second process on the file waits for the
  lock instead of failing). ``synchronous="NORMAL"`` survives the process being
  killed at any point but may lose the last commits to a power cut;
  ``"FULL"`` (SQLite's default) survives both, for one more fsync per commit.
- ``SqliteThread(path, setup=..., synchronous=...)``: a connection owned by one
  dedicated thread, so an event loop never waits on the disk. ``setup(conn)``
  (schema, migrations) runs there on opening; ``await run(fn, *args)`` runs
  ``fn(conn, *args)`` there and returns its result; ``call`` does the same
  blocking (start-up, shutdown); ``close()`` closes the connection and ends the
  thread. Calls run one at a time, in the order they were made.

Used by the job journal (``labrl.lab_adapters.job_journal``) and the Ray lab
gateway's transcript store (``labrl.harness.backends.ray.transcript_store``);
the mock lab (``labrl.lab_adapters.mock.store``) uses ``connect_wal`` from
its own, synchronous server.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")

Synchronous = Literal["NORMAL", "FULL"]
BUSY_TIMEOUT_MS = 5000


def connect_wal(path: str | Path, *, synchronous: Synchronous) -> sqlite3.Connection:
    """Open ``path`` in autocommit mode with WAL, ``synchronous`` and the busy timeout (module docstring)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return conn


class SqliteThread:
    """A SQLite connection on a thread of its own; see the module docstring."""

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: Synchronous,
        setup: Callable[[sqlite3.Connection], Any] | None = None,
        thread_name: str = "labrl-sqlite",
    ) -> None:
        self.path = Path(path)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        try:
            self._conn = self._thread.submit(self._open, synchronous, setup).result()
        except BaseException:
            self._thread.shutdown(wait=True)
            raise

    def _open(
        self, synchronous: Synchronous, setup: Callable[[sqlite3.Connection], Any] | None
    ) -> sqlite3.Connection:
        conn = connect_wal(self.path, synchronous=synchronous)
        try:
            if setup is not None:
                setup(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(conn, *args)`` on the database thread, awaited without blocking the loop."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, self._conn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(conn, *args)`` on the database thread, blocking the caller until it returns."""
        return self._thread.submit(fn, self._conn, *args).result()

    def close(self) -> None:
        """Close the connection (on its thread) and end the thread; blocking, and quick."""
        self._thread.submit(self._conn.close).result()
        self._thread.shutdown(wait=True)

    async def aclose(self) -> None:
        """``close`` for a caller on an event loop."""
        await asyncio.get_running_loop().run_in_executor(self._thread, self._conn.close)
        self._thread.shutdown(wait=True)

"""The job journal: a SQLite (WAL) record of every experiment this client asked for.

Experiments are expensive; losing one means paying for it twice. So:

1. ``record(key, request)`` commits a row *before* the submit request goes
   out (state ``pending``: we may or may not have reached the lab);
2. ``attach(key, job_id)`` once the lab answered with a job id (``submitted``);
3. ``deliver(key, status)`` stores the terminal status and result; it
   succeeds once per key (``UPDATE ... WHERE delivered_at IS NULL``), so a
   result that reaches the client twice (a retried poll, a repeated feed
   event, two waiters) is handed to the caller exactly once.

4. ``ack(key)`` once the consumer has the result (``JournaledLab`` calls it
   after ``on_result`` returns).

After a crash the rows that are not delivered are the work to resume: those
with a job id are polled, those without are looked up by key at the lab
(``LabAdapter.find``) before anything is submitted. Rows delivered but not
acknowledged (the process died between storing a result and handing it
over) are handed over again from the journal (``unacked_entries``): the
result is never lost, and a consumer may see a key twice across a crash
(at-least-once), never zero times.

Opening: a missing file is a new journal. An existing file that is empty,
is not SQLite, or holds no ``jobs`` table is ``LabJournalError`` (an empty
file is what a crash during creation or a truncated copy leaves; treating it
as new would resubmit every experiment) unless ``start_fresh=True``: then the
bad file is kept beside it as ``<name>.bad-<unix time>`` and a new journal is
created.

SQLite calls run on one dedicated thread that owns the connection
(``labrl.sqlite_thread.SqliteThread``), so the event loop never waits on
disk; every transaction is a single small statement. WAL with
``synchronous=NORMAL`` survives the process being killed (SIGKILL) at any
point: a commit either happened or it did not.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from labrl.errors import LabJournalError, LabRejectedError
from labrl.lab_adapters.protocol import JobState, JobStatus, request_hash
from labrl.sqlite_thread import SqliteThread

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    key TEXT PRIMARY KEY,
    request_hash TEXT NOT NULL,
    request TEXT NOT NULL,
    job_id TEXT,
    state TEXT NOT NULL,
    result TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    delivered_at REAL,
    acked_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_open ON jobs (delivered_at) WHERE delivered_at IS NULL;
"""

PENDING = "pending"
SUBMITTED = "submitted"


class JournalEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    request_hash: str
    request: dict[str, Any]
    job_id: str | None
    state: str
    result: dict[str, Any] | None
    error: str | None
    delivered: bool
    acked: bool = False

    def status(self) -> JobStatus:
        """The delivered terminal status (only meaningful once ``delivered``)."""
        return JobStatus(
            job_id=self.job_id or "",
            idempotency_key=self.key,
            state=JobState(self.state),
            result=self.result,
            error=self.error,
            request_hash=self.request_hash,
        )


def _row(row: tuple[Any, ...]) -> JournalEntry:
    key, rhash, request, job_id, state, result, error, delivered_at, acked_at = row
    return JournalEntry(
        key=key,
        request_hash=rhash,
        request=json.loads(request),
        job_id=job_id,
        state=state,
        result=json.loads(result) if result is not None else None,
        error=error,
        delivered=delivered_at is not None,
        acked=acked_at is not None,
    )


def _create(conn: sqlite3.Connection) -> None:
    """The schema, and the migration of a journal from before acknowledgements."""
    conn.executescript(_SCHEMA)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(jobs)")}
    if "acked_at" not in columns:  # delivered then meant handed over
        conn.execute("ALTER TABLE jobs ADD COLUMN acked_at REAL")
        conn.execute("UPDATE jobs SET acked_at = delivered_at WHERE delivered_at IS NOT NULL")


_COLUMNS = "key, request_hash, request, job_id, state, result, error, delivered_at, acked_at"


class Journal:
    """See the module docstring. Open with ``Journal(path)``; close with ``await close()``."""

    def __init__(self, path: str | Path, *, start_fresh: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.set_aside: Path | None = None  # where start_fresh moved a bad journal
        problem = journal_problem(self.path)
        if problem is not None:
            if not start_fresh:
                raise LabJournalError(
                    f"job journal {self.path}: {problem}. Its jobs cannot be resumed; to start a new "
                    "journal anyway pass start_fresh=True (env option fresh_journal=true, or "
                    "`labrl lab journal PATH --fresh`), which keeps the old file beside it"
                )
            self.set_aside = self.path.with_name(f"{self.path.name}.bad-{int(time.time())}")
            self.path.rename(self.set_aside)
            for suffix in ("-wal", "-shm"):
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    side.rename(self.set_aside.with_name(self.set_aside.name + suffix))
        self._db = SqliteThread(self.path, synchronous="NORMAL", setup=_create, thread_name="labrl-journal")

    async def close(self) -> None:
        await self._db.aclose()

    # -- writes -----------------------------------------------------------------

    async def record(self, key: str, request: dict[str, Any]) -> tuple[JournalEntry, bool]:
        """Record ``key`` before submitting; returns ``(entry, created)``.

        ``created`` is False when the key was already journaled (a resumed or
        repeated run): then the caller must look for an existing job before
        submitting anything.

        A key already recorded with a different request is refused: reusing a
        key for another experiment is a caller bug that would otherwise return
        the wrong result.
        """
        rhash = request_hash(request)
        body = json.dumps(request, sort_keys=True, allow_nan=False)

        def write(conn: sqlite3.Connection) -> tuple[JournalEntry, bool]:
            now = time.time()
            cur = conn.execute(
                "INSERT OR IGNORE INTO jobs (key, request_hash, request, state, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (key, rhash, body, PENDING, now, now),
            )
            row = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE key = ?", (key,)).fetchone()
            return _row(row), cur.rowcount == 1

        entry, created = await self._db.run(write)
        if entry.request_hash != rhash:
            raise LabRejectedError(
                f"idempotency key {key!r} is already journaled for a different request "
                f"(hash {entry.request_hash[:12]} vs {rhash[:12]}): use a new key for a new experiment"
            )
        return entry, created

    async def attach(self, key: str, job_id: str) -> None:
        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE jobs SET job_id = ?, state = CASE WHEN state = ? THEN ? ELSE state END, updated_at = ? "
                "WHERE key = ?",
                (job_id, PENDING, SUBMITTED, time.time(), key),
            )

        await self._db.run(write)

    async def reject(self, key: str, error: str) -> bool:
        """Mark a submission the lab refused; True if this call delivered it."""

        def write(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE jobs SET state = 'rejected', error = ?, delivered_at = ?, updated_at = ? "
                "WHERE key = ? AND delivered_at IS NULL",
                (error, time.time(), time.time(), key),
            )
            return cur.rowcount == 1

        return await self._db.run(write)

    async def ack(self, key: str) -> None:
        """The consumer has the delivered result of ``key``: it is not handed over again after a crash."""

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE jobs SET acked_at = ? WHERE key = ? AND delivered_at IS NOT NULL AND acked_at IS NULL",
                (time.time(), key),
            )

        await self._db.run(write)

    async def deliver(self, key: str, status: JobStatus) -> bool:
        """Store the terminal ``status``; True only for the first delivery of ``key``."""
        if not status.state.terminal:
            raise ValueError(f"deliver() needs a terminal status, got {status.state.value}")
        result = json.dumps(status.result, sort_keys=True) if status.result is not None else None

        def write(conn: sqlite3.Connection) -> bool:
            now = time.time()
            cur = conn.execute(
                "UPDATE jobs SET job_id = ?, state = ?, result = ?, error = ?, delivered_at = ?, updated_at = ? "
                "WHERE key = ? AND delivered_at IS NULL",
                (status.job_id, status.state.value, result, status.error, now, now, key),
            )
            return cur.rowcount == 1

        return await self._db.run(write)

    # -- reads ------------------------------------------------------------------

    async def get(self, key: str) -> JournalEntry | None:
        def read(conn: sqlite3.Connection) -> JournalEntry | None:
            row = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE key = ?", (key,)).fetchone()
            return _row(row) if row else None

        return await self._db.run(read)

    async def open_entries(self) -> list[JournalEntry]:
        """Entries recorded but not delivered: the work a restarted client resumes."""

        def read(conn: sqlite3.Connection) -> list[JournalEntry]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE delivered_at IS NULL ORDER BY created_at"
            ).fetchall()
            return [_row(r) for r in rows]

        return await self._db.run(read)

    async def unacked_entries(self) -> list[JournalEntry]:
        """Entries delivered but never acknowledged: results stored just before a crash, to hand over again."""

        def read(conn: sqlite3.Connection) -> list[JournalEntry]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM jobs WHERE delivered_at IS NOT NULL AND acked_at IS NULL "
                "ORDER BY created_at"
            ).fetchall()
            return [_row(r) for r in rows]

        return await self._db.run(read)

    async def entries(self, limit: int | None = None) -> list[JournalEntry]:
        """All entries, newest first (``limit`` of them when given): for ``labrl lab journal``."""

        def read(conn: sqlite3.Connection) -> list[JournalEntry]:
            sql = f"SELECT {_COLUMNS} FROM jobs ORDER BY created_at DESC"
            rows = conn.execute(sql + (" LIMIT ?" if limit else ""), (limit,) if limit else ()).fetchall()
            return [_row(r) for r in rows]

        return await self._db.run(read)

    async def counts(self) -> dict[str, int]:
        """``{state: n}`` over all entries."""

        def read(conn: sqlite3.Connection) -> dict[str, int]:
            return dict(conn.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

        return await self._db.run(read)


_SQLITE_MAGIC = b"SQLite format 3\x00"


def journal_problem(path: Path) -> str | None:
    """Why the existing file at ``path`` is not a usable journal, or None (also None when it does not exist)."""
    if not path.exists():
        return None
    if not path.is_file():
        return "is not a file"
    if path.stat().st_size == 0:
        return "the file is empty (a crash while it was created, or a truncated copy)"
    with path.open("rb") as handle:
        if handle.read(len(_SQLITE_MAGIC)) != _SQLITE_MAGIC:
            return "the file is not an SQLite database (corrupt or not a journal)"
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if "jobs" not in tables:
                return "the database holds no jobs table (not a labrl journal)"
            conn.execute("SELECT COUNT(*) FROM jobs").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return f"the database cannot be read ({exc})"
    return None

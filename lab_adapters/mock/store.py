"""The mock lab's job store: in memory for speed, written through to SQLite (WAL).

A restarted mock (same ``state_dir``) reloads every job and the completion
feed, so clients see the same jobs, results and event sequence numbers
before and after the restart. ``runs`` counts how many times a job's
experiment was started: the reliability tests assert it never exceeds 1.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labrl.lab_adapters.protocol import CompletionEvent, JobState, JobStatus
from labrl.sqlite_thread import connect_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    request_hash TEXT NOT NULL,
    request TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    started_at REAL,
    finish_at REAL,
    completed_at REAL,
    updated_at REAL NOT NULL,
    runs INTEGER NOT NULL DEFAULT 0,
    submits INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL,
    key TEXT NOT NULL,
    state TEXT NOT NULL,
    result TEXT,
    error TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass
class MockJob:
    job_id: str
    key: str
    request_hash: str
    request: dict[str, Any]
    state: JobState
    created_at: float
    updated_at: float
    result: dict[str, Any] | None = None
    error: str | None = None
    started_at: float | None = None
    finish_at: float | None = None
    completed_at: float | None = None
    runs: int = 0
    submits: int = 1
    # not persisted: long-poll waiters
    done: Any = field(default=None, repr=False)

    def status(self) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            idempotency_key=self.key,
            state=self.state,
            result=self.result,
            error=self.error,
            request_hash=self.request_hash,
            updated_at=self.updated_at,
        )


class MockStore:
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self._conn = connect_wal(state_dir / "mock_lab.sqlite", synchronous="NORMAL")
        self._conn.executescript(_SCHEMA)
        self.jobs: dict[str, MockJob] = {}
        self.by_key: dict[str, str] = {}
        self.events: list[CompletionEvent] = []
        self.counters: dict[str, int] = {}
        self._load()

    def _load(self) -> None:
        for row in self._conn.execute(
            "SELECT job_id, key, request_hash, request, state, result, error, created_at, started_at, finish_at, "
            "completed_at, updated_at, runs, submits FROM jobs"
        ):
            job = MockJob(
                job_id=row[0],
                key=row[1],
                request_hash=row[2],
                request=json.loads(row[3]),
                state=JobState(row[4]),
                result=json.loads(row[5]) if row[5] is not None else None,
                error=row[6],
                created_at=row[7],
                started_at=row[8],
                finish_at=row[9],
                completed_at=row[10],
                updated_at=row[11],
                runs=row[12],
                submits=row[13],
            )
            self.jobs[job.job_id] = job
            self.by_key[job.key] = job.job_id
        for seq, job_id, key, state, result, error in self._conn.execute(
            "SELECT seq, job_id, key, state, result, error FROM events ORDER BY seq"
        ):
            self.events.append(
                CompletionEvent(
                    seq=seq,
                    job_id=job_id,
                    idempotency_key=key,
                    state=JobState(state),
                    result=json.loads(result) if result is not None else None,
                    error=error,
                )
            )
        self.counters = dict(self._conn.execute("SELECT name, value FROM counters").fetchall())

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Group the writes of one API operation into one commit (nested calls join the outer one)."""
        if self._conn.in_transaction:
            yield
            return
        self._conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def bump(self, name: str, by: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + by
        self._conn.execute(
            "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
            (name, by, by),
        )

    def insert(self, job: MockJob) -> None:
        self._conn.execute(
            "INSERT INTO jobs (job_id, key, request_hash, request, state, created_at, updated_at, runs, submits) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job.job_id,
                job.key,
                job.request_hash,
                json.dumps(job.request),
                job.state.value,
                job.created_at,
                job.updated_at,
                job.runs,
                job.submits,
            ),
        )
        self.jobs[job.job_id] = job
        self.by_key[job.key] = job.job_id

    def save(self, job: MockJob) -> None:
        job.updated_at = time.time()
        self._conn.execute(
            "UPDATE jobs SET state = ?, result = ?, error = ?, started_at = ?, finish_at = ?, completed_at = ?, "
            "updated_at = ?, runs = ?, submits = ? WHERE job_id = ?",
            (
                job.state.value,
                json.dumps(job.result) if job.result is not None else None,
                job.error,
                job.started_at,
                job.finish_at,
                job.completed_at,
                job.updated_at,
                job.runs,
                job.submits,
                job.job_id,
            ),
        )

    def append_event(self, job: MockJob) -> CompletionEvent:
        seq = (self.events[-1].seq if self.events else 0) + 1
        event = CompletionEvent(
            seq=seq,
            job_id=job.job_id,
            idempotency_key=job.key,
            state=job.state,
            result=job.result,
            error=job.error,
        )
        self._conn.execute(
            "INSERT INTO events (seq, job_id, key, state, result, error) VALUES (?, ?, ?, ?, ?, ?)",
            (
                seq,
                job.job_id,
                job.key,
                job.state.value,
                json.dumps(job.result) if job.result is not None else None,
                job.error,
            ),
        )
        self.events.append(event)
        return event

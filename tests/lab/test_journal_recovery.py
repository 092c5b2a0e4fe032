"""Journal recovery: rejected keys, the crash window between storing and handing over, bad journal files."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from labrl.errors import LabJournalError, LabRejectedError
from labrl.lab_adapters.job_journal import Journal
from labrl.lab_adapters.journaled_lab import JournaledLab
from labrl.lab_adapters.protocol import JobRef, JobState, JobStatus, LabAdapter, SupportsSubmitStatus
from labrl.lab_adapters.rest import RestLabAdapter


class InstantLab:
    """A lab that finishes every job at once (result = the request), refusing requests with "bad" set."""

    def __init__(self) -> None:
        self.submitted: list[str] = []
        self.jobs: dict[str, JobStatus] = {}

    async def submit(self, request: dict[str, Any], idempotency_key: str) -> JobRef:
        if request.get("bad"):
            raise LabRejectedError("HTTP 422: temperature out of range")
        self.submitted.append(idempotency_key)
        job_id = f"job-{len(self.submitted)}"
        self.jobs[job_id] = JobStatus(
            job_id=job_id, idempotency_key=idempotency_key, state=JobState.COMPLETED, result=dict(request)
        )
        return JobRef(job_id=job_id, idempotency_key=idempotency_key)

    async def find(self, idempotency_key: str) -> JobStatus | None:
        return next((s for s in self.jobs.values() if s.idempotency_key == idempotency_key), None)

    async def status(self, job: JobRef) -> JobStatus:
        return self.jobs[job.job_id]

    async def wait(self, job: JobRef, timeout: float) -> JobStatus:
        return self.jobs[job.job_id]

    async def result(self, job: JobRef) -> dict[str, Any]:
        return dict(self.jobs[job.job_id].result or {})

    async def cancel(self, job: JobRef) -> JobStatus:
        return self.jobs[job.job_id]

    async def aclose(self) -> None:
        return None


async def test_rejected_key_is_a_state_not_a_poisoned_key(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    lab = JournaledLab(InstantLab(), journal)
    with pytest.raises(LabRejectedError):
        await lab.run({"bad": True}, "k-bad")
    outcome = await lab.run({"bad": True}, "k-bad")  # raised ValueError('rejected' is not a valid JobState)
    assert outcome.status.state is JobState.REJECTED and not outcome.fresh
    assert "temperature out of range" in outcome.status.error
    assert (await journal.get("k-bad")).status().state is JobState.REJECTED
    await journal.close()


def test_submit_status_is_a_declared_capability():
    assert isinstance(InstantLab(), LabAdapter) and not isinstance(InstantLab(), SupportsSubmitStatus)
    assert issubclass(RestLabAdapter, SupportsSubmitStatus)


CRASHING_CONSUMER = textwrap.dedent(
    """
    import asyncio, os, signal
    from test_journal_recovery import InstantLab
    from labrl.lab_adapters.job_journal import Journal
    from labrl.lab_adapters.journaled_lab import JournaledLab

    def consume(key, status):  # dies after the result is stored, before the consumer acknowledged it
        os.kill(os.getpid(), signal.SIGKILL)

    async def main():
        lab = JournaledLab(InstantLab(), Journal({path!r}), on_result=consume)
        await lab.run({{"sample": 7}}, "k-7")

    asyncio.run(main())
    """
)


async def test_result_stored_before_a_kill_is_handed_over_on_resume(tmp_path):
    path = tmp_path / "j.sqlite"
    script = CRASHING_CONSUMER.format(path=str(path))
    # the child imports InstantLab from this module by name
    pythonpath = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    got: list[tuple[str, JobStatus]] = []
    journal = Journal(path)
    lab = JournaledLab(InstantLab(), journal, on_result=lambda key, status: got.append((key, status)))
    outcomes = await lab.resume()
    assert [(k, s.result) for k, s in got] == [("k-7", {"sample": 7})]
    assert [(o.key, o.fresh) for o in outcomes] == [("k-7", True)]
    assert await lab.resume() == [] and len(got) == 1  # acknowledged now: handed over once
    await journal.close()


def _sqlite_without_jobs(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE other (x)")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    ("make_bad", "says"),
    [
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: p.write_bytes(b"\x00garbage" * 100), "not an SQLite database"),
        (lambda p: p.write_bytes(b"SQLite format 3\x00" + b"\xff" * 5000), "cannot be read"),
        (_sqlite_without_jobs, "no jobs table"),
    ],
    ids=["empty", "garbage", "corrupt_sqlite", "other_database"],
)
async def test_bad_journal_is_an_error_unless_starting_fresh(tmp_path, make_bad, says):
    path = tmp_path / "j.sqlite"
    make_bad(path)
    before = path.read_bytes()
    with pytest.raises(LabJournalError, match=says) as info:
        Journal(path)
    assert "start_fresh" in str(info.value) and path.read_bytes() == before  # nothing touched
    journal = Journal(path, start_fresh=True)
    assert journal.set_aside is not None and journal.set_aside.read_bytes() == before  # kept, not lost
    entry, created = await journal.record("k", {"a": 1})
    assert created and entry.state == "pending"
    await journal.close()
    assert Journal(path).path == path  # the new journal opens cleanly


async def test_journal_from_before_acknowledgements_is_migrated(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE jobs (key TEXT PRIMARY KEY, request_hash TEXT NOT NULL, request TEXT NOT NULL, "
        "job_id TEXT, state TEXT NOT NULL, result TEXT, error TEXT, created_at REAL NOT NULL, "
        "updated_at REAL NOT NULL, delivered_at REAL);"
        "INSERT INTO jobs VALUES ('k', 'h', '{}', 'j1', 'completed', '{\"x\": 1}', NULL, 1, 1, 2);"
    )
    conn.commit()
    conn.close()
    journal = Journal(path)
    assert await journal.unacked_entries() == []
    assert (await journal.get("k")).acked
    await journal.close()

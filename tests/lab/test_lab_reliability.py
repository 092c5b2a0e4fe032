"""No lost and no repeated experiments: faults, a server restart, a client SIGKILL."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from lab_clients import JOURNAL_CONFIG, fast_retry_client

from labrl.errors import LabRejectedError
from labrl.lab_adapters.job_journal import Journal
from labrl.lab_adapters.journaled_lab import JournaledLab, JournaledLabConfig
from labrl.lab_adapters.mock.server import FaultConfig
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

from .conftest import TOKEN, start_mock

DRIVER = Path(__file__).with_name("lab_driver.py")


def rest(url: str, **overrides) -> RestLabAdapter:
    settings = dict(call_timeout_s=0.5, long_poll_s=0.5, breaker_threshold=50, breaker_reset_s=0.2, seed=1)
    return fast_retry_client(url, **{**settings, **overrides})


@pytest.mark.slow
async def test_thousand_jobs_under_faults_and_restart(tmp_path, api_key, caplog):
    faults = FaultConfig(error_rate=0.10, hang_rate=0.05, hang_s=1.0, duplicate_rate=0.02)
    lab = start_mock(tmp_path / "lab", faults)
    delivered: collections.Counter[str] = collections.Counter()
    adapter = rest(lab.url)
    journal = Journal(tmp_path / "journal.sqlite")
    client = JournaledLab(
        adapter,
        journal,
        JOURNAL_CONFIG,
        on_result=lambda key, status: delivered.update([key]),
    )
    try:

        async def restart_midway() -> None:
            while client.stats["delivered"] < 300:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(lab.restart)

        restarter = asyncio.ensure_future(restart_midway())
        outcomes = await asyncio.gather(
            *(client.run({"kind": "echo", "payload": {"i": i}}, f"k{i}") for i in range(1000))
        )
        await restarter
        stats = lab.stats()
    finally:
        await client.aclose()
        await adapter.aclose()
        await journal.close()
        lab.stop()
    # every result delivered exactly once, and each to its own request
    assert len(delivered) == 1000 and set(delivered.values()) == {1}
    assert all(o.status.result["echo"] == {"i": int(o.key[1:])} for o in outcomes)
    # the lab's own count: every job ran exactly once, nothing lost
    assert stats["jobs"] == 1000 and stats["runs_total"] == 1000 and stats["max_runs_per_job"] == 1
    assert stats["states"] == {"completed": 1000}
    # the faults really happened (counters survive the restart only for the stored ones)
    assert stats["counters"]["duplicate_events"] > 0
    assert adapter.stats["retry_503"] > 0 and adapter.stats["retry_timeout"] > 0
    assert client.stats["delivered"] == 1000
    assert TOKEN not in caplog.text


def _journal_rows(path: Path) -> dict[str, tuple[str | None, bool]]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT key, job_id, delivered_at FROM jobs").fetchall()
    finally:
        conn.close()
    return {k: (j, d is not None) for k, j, d in rows}


@pytest.mark.slow
def test_sigkill_client_resumes_from_journal_without_resubmitting(tmp_path):
    lab = start_mock(tmp_path / "lab", FaultConfig(error_rate=0.05), latency_median_s=1.0, latency_sigma=0.3)
    journal_path, out = tmp_path / "journal.sqlite", tmp_path / "out.tsv"
    env = {**os.environ, "LABRL_LAB_API_KEY": TOKEN}
    n = 200
    try:
        # the killed child's retry warnings go to a file, not into pytest's output
        first_log = (tmp_path / "first.log").open("wb")
        first = subprocess.Popen(
            [sys.executable, str(DRIVER), lab.url, str(journal_path), str(out), str(n)],
            env=env,
            stdout=first_log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill once some are delivered and some are in flight
            time.sleep(0.1)
            if journal_path.exists():
                try:
                    rows = _journal_rows(journal_path)
                except sqlite3.OperationalError:  # the child made the file but not yet its table
                    continue
                if (
                    sum(d for _, d in rows.values()) >= 20
                    and sum(j is not None and not d for j, d in rows.values()) >= 20
                ):
                    break
        first.send_signal(signal.SIGKILL)
        first.wait()
        first_log.close()
        at_kill = _journal_rows(journal_path)
        submits_at_kill = lab.stats()["submits_by_key"]
        in_flight = [k for k, (j, d) in at_kill.items() if j is not None and not d]
        assert len(in_flight) >= 20

        second = subprocess.run(
            [sys.executable, str(DRIVER), lab.url, str(journal_path), str(out), str(n)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 0, second.stderr[-2000:]
        stats = lab.stats()
    finally:
        lab.stop()
    client_stats = eval(second.stdout.strip().splitlines()[-1])  # the driver prints its Counter as a dict
    # pending jobs were resumed from the journal, not submitted again
    assert client_stats["resumed"] >= len(in_flight)
    assert all(stats["submits_by_key"][k] == submits_at_kill[k] for k in in_flight)
    # nothing ran twice, nothing lost
    assert stats["jobs"] == n and stats["max_runs_per_job"] == 1 and stats["states"] == {"completed": n}
    lines = [line.split("\t") for line in out.read_text().splitlines()]
    fresh = collections.Counter(k for k, kind in lines if kind == "fresh")
    assert set(fresh.values()) == {1}
    assert {k for k, _ in lines} == {f"job-{i}" for i in range(n)}
    assert all(d for _, d in _journal_rows(journal_path).values())


def test_mock_refuses_missing_and_wrong_tokens(mock_lab):
    url = mock_lab.url + "/jobs"
    body = {"request": {"kind": "echo", "payload": 1}}
    missing = httpx.post(url, json=body, headers={"Idempotency-Key": "a"})
    wrong = httpx.post(url, json=body, headers={"Idempotency-Key": "a", "Authorization": "Bearer nope"})
    right = httpx.post(url, json=body, headers={"Idempotency-Key": "a", "Authorization": f"Bearer {TOKEN}"})
    assert (missing.status_code, missing.json()["detail"]) == (401, "missing bearer token")
    assert (wrong.status_code, wrong.json()["detail"]) == (403, "invalid bearer token")
    assert right.status_code == 202 and right.json()["state"] in ("queued", "running")
    assert mock_lab.stats()["jobs"] == 1
    assert TOKEN not in mock_lab.log_tail(100_000)
    spec = httpx.get(mock_lab.url + "/openapi.json").json()
    assert {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/cancel", "/events", "/stats"} <= set(spec["paths"])


async def test_same_key_different_payload_is_rejected(mock_lab, api_key):
    adapter = rest(mock_lab.url)
    try:
        first = await adapter.submit({"kind": "echo", "payload": 1}, "dup")
        again = await adapter.submit({"kind": "echo", "payload": 1}, "dup")
        assert again == first
        with pytest.raises(
            LabRejectedError,
            match=re.escape("HTTP 409: Idempotency-Key 'dup' was used for a different request"),
        ):
            await adapter.submit({"kind": "echo", "payload": 2}, "dup")
        with pytest.raises(
            LabRejectedError, match=re.escape("HTTP 422: request refused: unknown job kind 'bake'")
        ):
            await adapter.submit({"kind": "bake"}, "bad")
        status = await adapter.wait(first, timeout=30)
        assert status.result["echo"] == 1
        assert (await adapter.find("dup")).job_id == first.job_id
        assert await adapter.find("never-submitted") is None
    finally:
        await adapter.aclose()
    assert mock_lab.stats()["submits_by_key"]["dup"] == 2


async def test_journal_records_before_request_goes_out(tmp_path, api_key):
    journal = Journal(tmp_path / "j.sqlite")
    seen_states = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            rows = _journal_rows(tmp_path / "j.sqlite")
            seen_states.append(rows.get(request.headers["idempotency-key"]))
            return httpx.Response(
                202, json={"job_id": "j1", "idempotency_key": "k", "state": "completed", "result": {"v": 7}}
            )
        raise AssertionError("no GET expected: the submit answered a terminal state")

    adapter = RestLabAdapter(
        RestLabConfig(base_url="http://127.0.0.1:9", rate_limit_per_s=None),
        transport=httpx.MockTransport(handler),
    )
    client = JournaledLab(adapter, journal, JournaledLabConfig(use_feed=False))
    outcome = await client.run({"x": 1}, "k")
    again = await client.run({"x": 1}, "k")
    assert seen_states == [(None, False)]  # the row existed, without a job id, when the POST went out
    assert outcome.fresh and outcome.status.result == {"v": 7}
    assert not again.fresh and again.status.result == {"v": 7}
    with pytest.raises(
        LabRejectedError, match=re.escape("idempotency key 'k' is already journaled for a different request")
    ):
        await client.run({"x": 2}, "k")
    await adapter.aclose()
    await journal.close()

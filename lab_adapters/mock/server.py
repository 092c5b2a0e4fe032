"""The mock autonomous lab: a FastAPI app on loopback with realistic latency and injectable faults.

Run it with ``labrl lab serve-mock --state-dir DIR`` (token in the environment
variable named by ``token_env``, default ``LABRL_MOCK_LAB_TOKEN``); the
OpenAPI spec is at ``/openapi.json``. The API is the one
``RestLabAdapter`` speaks (see ``labrl.lab_adapters.rest``), plus
``GET /stats`` (the lab's own counts: jobs, runs per job, submits, faults)
and an unauthenticated ``GET /healthz``.

Jobs: a submit with a new ``Idempotency-Key`` creates a job (``queued``); it
starts at once (``running``, ``runs += 1``) when an instrument is free,
finishes after a lognormal latency (median ``latency_median_s``, log-sd
``latency_sigma``), and ends ``completed`` (or ``failed`` if the simulated
lab raised). A completion is appended to the event feed. Completed results
expire ``result_ttl_s`` after completion (state ``expired``).

Faults (``FaultConfig``), drawn per request from a seeded RNG; ``/healthz``,
``/stats`` and the docs are exempt:

- ``error_rate``: answer 503; with probability ``error_after_commit`` the
  request was processed first (a job may have been created: the client must
  resubmit with the same key and get the same job);
- ``hang_rate``: process the request, then hold the answer ``hang_s``
  (longer than the client's timeout);
- ``drop_rate``: process the request, send the headers and half the body,
  then drop the connection;
- ``duplicate_rate``: append a completion to the feed twice;
- restart: the state is in SQLite under ``state_dir``; a new server on the
  same directory reloads every job and resumes the running ones at their
  original finish time (a job is never started twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from labrl.errors import ConfigError, LabrlError
from labrl.lab_adapters.mock import simlab
from labrl.lab_adapters.mock.store import MockJob, MockStore
from labrl.lab_adapters.protocol import EventPage, JobState, JobStatus, request_hash
from labrl.offload import run_cpu

log = logging.getLogger(__name__)

EXEMPT_PATHS = frozenset({"/healthz", "/stats", "/openapi.json", "/docs", "/redoc"})


class FaultConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_after_commit: float = Field(default=0.5, ge=0, le=1)
    hang_rate: float = Field(default=0.0, ge=0, le=1)
    hang_s: float = Field(default=30.0, ge=0)
    drop_rate: float = Field(default=0.0, ge=0, le=1)
    duplicate_rate: float = Field(default=0.0, ge=0, le=1)
    result_ttl_s: float | None = Field(default=None, gt=0)


class MockLabConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=0, le=65535)
    state_dir: Path
    token_env: str = "LABRL_MOCK_LAB_TOKEN"
    latency_median_s: float = Field(default=2.0, gt=0)
    latency_sigma: float = Field(default=0.5, ge=0)
    instruments: int | None = Field(default=None, ge=1, description="jobs run at once; None = unlimited")
    long_poll_max_s: float = Field(default=30.0, ge=0)
    seed: int = 0
    faults: FaultConfig = Field(default_factory=FaultConfig)

    @field_validator("host")
    @classmethod
    def _loopback(cls, host: str) -> str:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise ValueError(f"the mock lab binds to loopback only (127.0.0.1, ::1, localhost), got {host!r}")
        return host

    def faults_summary(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.faults.model_dump().items() if v)


class Submission(BaseModel):
    request: dict[str, Any]


class _Dropped(Exception):
    """Raised after a partial body so the server closes the connection mid-response."""


class FaultInjector:
    """ASGI middleware: run the app, then fail, hang or drop its answer as configured."""

    def __init__(self, app: Any, faults: FaultConfig, rng: random.Random, counters: dict[str, int]) -> None:
        self.app = app
        self.faults = faults
        self.rng = rng
        self.counters = counters

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        f = self.faults
        draw = self.rng.random()
        if draw < f.error_rate:
            self.counters["fault_5xx"] += 1
            if self.rng.random() < f.error_after_commit:
                await self.app(scope, receive, _discard)
            body = json.dumps({"detail": "injected fault: service unavailable"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        if draw < f.error_rate + f.hang_rate:
            self.counters["fault_hang"] += 1
            messages = await _capture(self.app, scope, receive)
            await asyncio.sleep(f.hang_s)
            with contextlib.suppress(Exception):  # the client has long gone
                for message in messages:
                    await send(message)
            return
        if draw < f.error_rate + f.hang_rate + f.drop_rate:
            self.counters["fault_drop"] += 1
            messages = await _capture(self.app, scope, receive)
            start = next(m for m in messages if m["type"] == "http.response.start")
            body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": start["status"], "headers": headers})
            await send({"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True})
            raise _Dropped("injected fault: connection dropped mid-response")
        await self.app(scope, receive, send)


def _json(model: BaseModel, status_code: int = 200) -> Response:
    """``model`` serialised once by pydantic-core (FastAPI would validate it again against response_model)."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


async def _discard(message: dict[str, Any]) -> None:
    return None


async def _capture(app: Any, scope: dict[str, Any], receive: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    return messages


class MockLab:
    """The lab's state and scheduler (one per server process)."""

    def __init__(self, config: MockLabConfig) -> None:
        self.config = config
        self.store = MockStore(config.state_dir)
        self.rng = random.Random(config.seed + len(self.store.jobs))
        self.fault_counters: dict[str, int] = {"fault_5xx": 0, "fault_hang": 0, "fault_drop": 0}
        self._instruments = asyncio.Semaphore(config.instruments) if config.instruments else None
        self._tasks: set[asyncio.Task[None]] = set()
        self._feed_changed = asyncio.Event()
        for job in self.store.jobs.values():
            job.done = asyncio.Event()
            if job.state.terminal:
                job.done.set()

    def start(self) -> None:
        """Resume the jobs a previous server left queued or running."""
        for job in self.store.jobs.values():
            if not job.state.terminal:
                self._spawn(job)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.store.close()

    def _spawn(self, job: MockJob) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _latency(self) -> float:
        return self.config.latency_median_s * math.exp(self.config.latency_sigma * self.rng.gauss(0.0, 1.0))

    async def _run(self, job: MockJob) -> None:
        if job.state is JobState.QUEUED:
            if self._instruments is not None:
                await self._instruments.acquire()
            if job.state is not JobState.QUEUED:  # cancelled while waiting for an instrument
                if self._instruments is not None:
                    self._instruments.release()
                return
            job.state = JobState.RUNNING
            job.runs += 1
            job.started_at = time.time()
            job.finish_at = job.started_at + self._latency()
            self.store.save(job)
        elif self._instruments is not None:
            await self._instruments.acquire()  # a resumed running job holds its instrument again
        try:
            await asyncio.sleep(max(0.0, (job.finish_at or 0.0) - time.time()))
            if job.state is not JobState.RUNNING:
                return
            seed = int(request_hash(job.request)[:8], 16)
            try:
                if simlab.is_heavy(job.request):
                    result = await run_cpu(simlab.execute, job.request, seed)
                else:
                    result = simlab.execute(job.request, seed)
            except LabrlError as exc:
                self._finish(job, JobState.FAILED, error=f"{type(exc).__name__}: {exc}")
            else:
                self._finish(job, JobState.COMPLETED, result=result)
        finally:
            if self._instruments is not None:
                self._instruments.release()

    def _finish(
        self, job: MockJob, state: JobState, result: dict[str, Any] | None = None, error: str | None = None
    ) -> None:
        if job.state.terminal:
            return
        job.state, job.result, job.error = state, result, error
        job.completed_at = time.time()
        with self.store.transaction():
            self.store.save(job)
            self.store.append_event(job)
            if self.rng.random() < self.config.faults.duplicate_rate:
                self.store.append_event(job)
                self.store.bump("duplicate_events")
        job.done.set()
        self._feed_changed.set()
        self._feed_changed = asyncio.Event()

    def _expire(self, job: MockJob) -> MockJob:
        ttl = self.config.faults.result_ttl_s
        if ttl is not None and job.state is JobState.COMPLETED and job.completed_at is not None:
            if time.time() - job.completed_at > ttl:
                job.state, job.result = JobState.EXPIRED, None
                self.store.save(job)
        return job

    # -- API operations ---------------------------------------------------------

    def submit(self, key: str, request: dict[str, Any]) -> tuple[MockJob, bool]:
        rhash = request_hash(request)
        existing = self.store.by_key.get(key)
        if existing is not None:
            job = self.store.jobs[existing]
            if job.request_hash != rhash:
                raise HTTPException(409, f"Idempotency-Key {key!r} was used for a different request")
            job.submits += 1
            with self.store.transaction():
                self.store.save(job)
                self.store.bump("replayed_submits")
            return self._expire(job), False
        try:
            simlab.validate(request)
        except LabrlError as exc:
            raise HTTPException(422, f"request refused: {exc}") from None
        now = time.time()
        job = MockJob(
            job_id=f"job-{uuid.uuid4().hex[:16]}",
            key=key,
            request_hash=rhash,
            request=request,
            state=JobState.QUEUED,
            created_at=now,
            updated_at=now,
        )
        job.done = asyncio.Event()
        with self.store.transaction():
            self.store.insert(job)
            self.store.bump("created")
        self._spawn(job)
        return job, True

    def get(self, job_id: str) -> MockJob:
        job = self.store.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"unknown job {job_id!r}")
        return self._expire(job)

    async def wait(self, job_id: str, wait: float) -> MockJob:
        job = self.get(job_id)
        if not job.state.terminal and wait > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(job.done.wait(), min(wait, self.config.long_poll_max_s))
        return self._expire(job)

    def cancel(self, job_id: str) -> MockJob:
        job = self.get(job_id)
        if not job.state.terminal:
            self._finish(job, JobState.CANCELLED, error="cancelled by the client")
        return job

    async def events(self, after: int, wait: float, limit: int) -> EventPage:
        if (not self.store.events or self.store.events[-1].seq <= after) and wait > 0:
            changed = self._feed_changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(wait, self.config.long_poll_max_s))
        events = [e for e in self._events_after(after)][:limit]
        next_after = events[-1].seq if events else max(after, 0)
        return EventPage(events=tuple(events), next_after=next_after)

    def _events_after(self, after: int) -> list[Any]:
        events = self.store.events
        lo, hi = 0, len(events)
        while lo < hi:  # seqs are increasing: binary search the first seq > after
            mid = (lo + hi) // 2
            if events[mid].seq <= after:
                lo = mid + 1
            else:
                hi = mid
        return events[lo:]

    def stats(self) -> dict[str, Any]:
        jobs = list(self.store.jobs.values())
        states: dict[str, int] = {}
        for job in jobs:
            states[job.state.value] = states.get(job.state.value, 0) + 1
        return {
            "jobs": len(jobs),
            "states": states,
            "runs_total": sum(j.runs for j in jobs),
            "max_runs_per_job": max((j.runs for j in jobs), default=0),
            "submits_total": sum(j.submits for j in jobs),
            "submits_by_key": {j.key: j.submits for j in jobs},
            "events": len(self.store.events),
            "counters": {**self.store.counters, **self.fault_counters},
        }


def create_app(config: MockLabConfig) -> Any:
    """The ASGI app: FastAPI routes wrapped in the fault injector."""
    token = os.environ.get(config.token_env)
    if not token:
        raise ConfigError(
            f"the mock lab needs a bearer token: set the environment variable {config.token_env}"
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        lab = MockLab(config)
        app.state.lab = lab
        injector.counters = lab.fault_counters
        lab.start()
        log.info(
            "mock lab up on %s:%d with %d stored jobs; faults: %s",
            config.host,
            config.port,
            len(lab.store.jobs),
            config.faults_summary() or "none",
        )
        try:
            yield
        finally:
            await lab.stop()

    app = FastAPI(
        title="labrl mock lab",
        version="1",
        lifespan=lifespan,
        description="A simulated autonomous lab: submit jobs, long-poll their status, read the completion feed.",
    )

    # async: a sync dependency would cost a worker-thread hop on every request
    async def authorized(authorization: str | None = Header(default=None)) -> None:
        if authorization is None or not authorization.startswith("Bearer "):
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(authorization.removeprefix("Bearer ").encode(), token.encode()):
            raise HTTPException(403, "invalid bearer token")

    def lab_of(request: Request) -> MockLab:
        return request.app.state.lab

    auth = [Depends(authorized)]

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/jobs", status_code=202, response_model=JobStatus, dependencies=auth)
    async def submit(
        body: Submission, request: Request, idempotency_key: str = Header(min_length=1, max_length=200)
    ) -> Any:
        job, _created = lab_of(request).submit(idempotency_key, body.request)
        return _json(job.status(), 202)

    @app.get("/jobs", dependencies=auth)
    async def find(request: Request, idempotency_key: str = Query(min_length=1)) -> dict[str, Any]:
        lab = lab_of(request)
        job_id = lab.store.by_key.get(idempotency_key)
        return {"jobs": [] if job_id is None else [lab.get(job_id).status().model_dump(mode="json")]}

    @app.get("/jobs/{job_id}", response_model=JobStatus, dependencies=auth)
    async def get_job(job_id: str, request: Request, wait: float = Query(default=0.0, ge=0)) -> Any:
        return _json((await lab_of(request).wait(job_id, wait)).status())

    @app.post("/jobs/{job_id}/cancel", response_model=JobStatus, dependencies=auth)
    async def cancel(job_id: str, request: Request) -> Any:
        return _json(lab_of(request).cancel(job_id).status())

    @app.get("/events", response_model=EventPage, dependencies=auth)
    async def events(
        request: Request,
        after: int = Query(default=0, ge=0),
        wait: float = Query(default=0.0, ge=0),
        limit: int = Query(default=1000, ge=1, le=10000),
    ) -> Any:
        return _json(await lab_of(request).events(after, wait, limit))

    @app.get("/stats", dependencies=auth)
    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(lab_of(request).stats())

    injector = FaultInjector(app, config.faults, random.Random(config.seed + 1), {})
    injector.openapi = app.openapi  # type: ignore[attr-defined]
    return injector


class InProcessMockLab:
    """The mock lab inside the running event loop, reached through ``httpx.ASGITransport``.

    No socket and no child process, but the same app, auth, job store and
    simulated lab: a ``RestLabAdapter`` built with ``transport=lab.transport()``
    goes through its real request path (headers, idempotency keys, status
    mapping). Used as the offline default of the lab envs and in tests.
    """

    def __init__(self, config: MockLabConfig) -> None:
        self.config = config
        self.asgi = create_app(config)
        self._stack: contextlib.AsyncExitStack | None = None

    @property
    def lab(self) -> MockLab:
        return self.asgi.app.state.lab

    async def start(self) -> InProcessMockLab:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.asgi.app.router.lifespan_context(self.asgi.app))
        self._stack = stack
        return self

    def transport(self) -> Any:
        import httpx

        return httpx.ASGITransport(app=self.asgi)

    async def aclose(self) -> None:
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def serve(config: MockLabConfig) -> None:
    """Run the mock lab in the foreground until interrupted."""
    import uvicorn

    asgi = create_app(config)
    # keep-alive longer than the clients' idle gaps: a connection closed by the server just as the
    # client reuses it costs a transport error and a retry
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the handler it found:
    # with the default one the process dies there and no cleanup runs. This one exits normally.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        uvicorn.run(
            asgi,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
        )
    finally:  # SIGTERM/SIGINT end uvicorn.run: take the simulation pool's processes down with us
        from labrl.offload import shutdown_cpu_pool

        shutdown_cpu_pool(terminate=True)

"""``RestLabAdapter``: the ``LabAdapter`` protocol over a lab's REST API (httpx, async).

The API (served by the mock lab, ``labrl lab serve-mock``; a real lab
implements the same)::

    POST /jobs                     {"request": {...}}, header Idempotency-Key -> 202 job status
    GET  /jobs?idempotency_key=K   -> 200 {"jobs": [status]}  (empty when unknown)
    GET  /jobs/{id}?wait=S         long poll: answers when the job is terminal or after S s
    POST /jobs/{id}/cancel         -> 200 job status
    GET  /events?after=N&wait=S    completion feed (at-least-once), for many jobs at once

Every call goes through ``_call``, the one place where httpx exceptions and
HTTP statuses become labrl errors::

    httpx.TimeoutException      -> LabTimeoutError      retried
    httpx.TransportError        -> LabTransportError    retried (refused, reset, dropped)
    408, 429, 5xx               -> LabStatusError       retried; Retry-After honoured
    401, 403                    -> LabAuthError         never retried; stops the env (never a reward)
    409, 400, 404, 422...       -> LabRejectedError     never retried
    other statuses              -> LabStatusError       never retried
    breaker open                -> LabCircuitOpenError  waits for the half-open probe

Retries use full-jitter exponential backoff (``labrl.resilience.Backoff``, jitter 0.5);
calls are paced by a token bucket and capped by a semaphore. The API key is
read from the environment variable ``api_key_env`` when the adapter is built;
it lives only in the Authorization header of outgoing requests, never in a
repr, a log line or an error message: every piece of a lab's answer quoted in
an error goes through ``labrl.redact.redact`` (a lab may echo the header).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import Counter
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labrl.errors import (
    ConfigError,
    LabAuthError,
    LabCircuitOpenError,
    LabError,
    LabRejectedError,
    LabStatusError,
    LabTimeoutError,
    LabTransportError,
)
from labrl.lab_adapters.protocol import EventPage, JobRef, JobStatus
from labrl.redact import redact
from labrl.resilience import Backoff, CircuitBreaker, TokenBucket, retry_after_s

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429})
FEED_CONNECTIONS = 1
AUTH_STATUSES = frozenset({401, 403})
REJECT_STATUSES = frozenset({400, 404, 409, 410, 413, 422})


class RestLabConfig(BaseModel):
    """How to reach a lab and how patiently."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str
    api_key_env: str = "LABRL_LAB_API_KEY"
    require_api_key: bool = True
    connect_timeout_s: float = Field(default=3.0, gt=0)
    call_timeout_s: float = Field(
        default=10.0, gt=0, description="deadline of one HTTP call (plus the long-poll wait)"
    )
    long_poll_s: float = Field(
        default=20.0, ge=0, description="how long the lab may hold a GET /jobs/{id}?wait="
    )
    max_attempts: int = Field(default=8, ge=1)
    backoff_base_s: float = Field(default=0.1, ge=0)
    backoff_max_s: float = Field(default=5.0, ge=0)
    retry_after_max_s: float = Field(default=60.0, ge=0)
    rate_limit_per_s: float | None = Field(default=200.0, gt=0)
    rate_burst: int = Field(default=100, ge=1)
    max_concurrency: int = Field(
        default=32,
        ge=1,
        description="HTTP calls in flight and pooled connections. Keep it modest: httpcore scans every "
        "pooled connection (a getpeername and a select syscall each) whenever a request starts or ends, so "
        "a large pool costs O(connections) per call; calls beyond the cap wait on a cheap semaphore instead",
    )
    breaker_threshold: int = Field(default=20, ge=1)
    breaker_reset_s: float = Field(default=1.0, gt=0)
    seed: int | None = None


class _Secret:
    """Holds the API key; its repr never shows it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "_Secret('***')"

    __str__ = __repr__


def _brief(response: httpx.Response, secret: str) -> str:
    """The lab's error detail, secrets redacted (before truncation, so no half-secret survives)."""
    try:
        detail = response.json().get("detail", response.text)
    except Exception:
        detail = response.text
    return redact(str(detail), [secret])[:200]


class RestLabAdapter:
    """A ``LabAdapter`` for a lab with the REST API in the module docstring."""

    def __init__(self, config: RestLabConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        key = os.environ.get(config.api_key_env)
        if not key and config.require_api_key:
            raise ConfigError(
                f"lab API key missing: set the environment variable {config.api_key_env} "
                f"(or RestLabConfig.api_key_env to the variable that holds it)"
            )
        self._key = _Secret(key or "")
        self._client = httpx.AsyncClient(
            base_url=config.base_url,
            transport=transport,
            limits=httpx.Limits(
                # + FEED_CONNECTIONS: the completion feed has its own connection (see _send_once)
                max_connections=config.max_concurrency + FEED_CONNECTIONS,
                max_keepalive_connections=config.max_concurrency + FEED_CONNECTIONS,
            ),
        )
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        self._bucket = (
            TokenBucket(config.rate_limit_per_s, config.rate_burst) if config.rate_limit_per_s else None
        )
        self.breaker = CircuitBreaker(config.breaker_threshold, config.breaker_reset_s)
        self._backoff = Backoff(
            config.backoff_base_s,
            config.backoff_max_s,
            jitter=0.5,
            retry_after_cap_s=config.retry_after_max_s,
        )
        self._rng = random.Random(config.seed)
        #: calls, retries and their reasons, for benchmarks and metrics
        self.stats: Counter[str] = Counter()

    def __repr__(self) -> str:
        return f"RestLabAdapter(base_url={self.config.base_url!r}, api_key_env={self.config.api_key_env!r})"

    async def __aenter__(self) -> RestLabAdapter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- the one place that talks HTTP -----------------------------------------

    def _brief(self, response: httpx.Response) -> str:
        return _brief(response, self._key.reveal())

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._key.reveal():
            headers["Authorization"] = f"Bearer {self._key.reveal()}"
        return {**headers, **(extra or {})}

    async def _send_once(
        self, method: str, path: str, timeout: float, *, priority: bool = False, **kwargs: Any
    ) -> httpx.Response:
        """One HTTP exchange; httpx exceptions become labrl errors here and only here.

        ``priority`` calls (the completion feed, one per client) skip the concurrency cap: the feed
        serves every waiting job, so queueing it behind a thousand submits would delay every
        delivery and trigger fallback polls.
        """
        try:
            if priority:
                return await self._client.request(
                    method,
                    path,
                    timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout_s),
                    **kwargs,
                )
            async with self._semaphore:
                return await self._client.request(
                    method,
                    path,
                    timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout_s),
                    **kwargs,
                )
        except httpx.TimeoutException as exc:
            raise LabTimeoutError(
                f"{method} {path}: no answer within {timeout:g} s ({type(exc).__name__})"
            ) from exc
        except httpx.TransportError as exc:
            detail = redact(str(exc), [self._key.reveal()])
            raise LabTransportError(f"{method} {path}: {type(exc).__name__}: {detail}") from exc

    async def _call(
        self,
        method: str,
        path: str,
        *,
        extra_timeout: float = 0.0,
        headers: dict[str, str] | None = None,
        ok: tuple[int, ...] = (200, 201, 202),
        priority: bool = False,
        **kwargs: Any,
    ) -> httpx.Response:
        """``method path`` with retries; returns a response whose status is in ``ok``."""
        cfg = self.config
        timeout = cfg.call_timeout_s + extra_timeout
        last: LabError | None = None
        for attempt in range(cfg.max_attempts):
            if not self.breaker.allow():
                self.stats["breaker_fast_fail"] += 1
                last = LabCircuitOpenError(
                    f"{method} {path}: circuit open after {cfg.breaker_threshold} consecutive failures"
                )
                if attempt + 1 < cfg.max_attempts:
                    await asyncio.sleep(max(self.breaker.retry_in(), self._backoff.delay(attempt, self._rng)))
                continue
            if self._bucket is not None:
                await self._bucket.acquire()
            self.stats["calls"] += 1
            if last is not None:  # a call re-sent after a failure (breaker fast-fails are not calls)
                self.stats["retries"] += 1
            wait: float | None = None
            try:
                response = await self._send_once(
                    method, path, timeout, priority=priority, headers=self._headers(headers), **kwargs
                )
            except (LabTimeoutError, LabTransportError) as exc:
                self.breaker.record_failure()
                self.stats["retry_" + ("timeout" if isinstance(exc, LabTimeoutError) else "transport")] += 1
                last = exc
            except BaseException:
                self.breaker.abandon()
                raise
            else:
                status = response.status_code
                if status in ok:
                    self.breaker.record_success()
                    return response
                if status in RETRY_STATUSES or status >= 500:
                    self.breaker.record_failure()
                    self.stats[f"retry_{status}"] += 1
                    wait = retry_after_s(response.headers.get("retry-after"))
                    last = LabStatusError(f"{method} {path}: HTTP {status}: {self._brief(response)}")
                else:
                    self.breaker.record_success()  # the lab is up; the request is wrong
                    if status in AUTH_STATUSES:
                        raise LabAuthError(
                            f"{method} {path}: HTTP {status}: the lab refused the credentials in "
                            f"${self.config.api_key_env}: {self._brief(response)}"
                        )
                    if status in REJECT_STATUSES:
                        raise LabRejectedError(f"{method} {path}: HTTP {status}: {self._brief(response)}")
                    raise LabStatusError(
                        f"{method} {path}: unexpected HTTP {status}: {self._brief(response)}"
                    )
            if attempt + 1 < cfg.max_attempts:
                await asyncio.sleep(self._backoff.delay(attempt, self._rng, retry_after=wait))
        assert last is not None
        self.stats["gave_up"] += 1
        log.warning("lab call %s %s gave up after %d attempts: %s", method, path, cfg.max_attempts, last)
        raise type(last)(f"{last} (gave up after {cfg.max_attempts} attempts)") from last

    @staticmethod
    def _status(payload: Any) -> JobStatus:
        try:
            return JobStatus.model_validate(payload)
        except ValidationError as exc:
            raise LabStatusError(f"the lab answered a job status that does not parse: {exc}") from exc

    # -- the LabAdapter protocol ------------------------------------------------

    async def submit_status(self, request: dict[str, Any], idempotency_key: str) -> JobStatus:
        """Submit and return the lab's status (terminal already if the key's job has finished)."""
        if not idempotency_key or len(idempotency_key) > 200:
            raise ConfigError(f"idempotency_key must be 1-200 characters, got {len(idempotency_key)}")
        response = await self._call(
            "POST", "/jobs", json={"request": request}, headers={"Idempotency-Key": idempotency_key}
        )
        return self._status(response.json())

    async def submit(self, request: dict[str, Any], idempotency_key: str) -> JobRef:
        return (await self.submit_status(request, idempotency_key)).ref

    async def find(self, idempotency_key: str) -> JobStatus | None:
        response = await self._call("GET", "/jobs", params={"idempotency_key": idempotency_key})
        jobs = response.json().get("jobs", [])
        return self._status(jobs[0]) if jobs else None

    async def status(self, job: JobRef) -> JobStatus:
        return self._status((await self._call("GET", f"/jobs/{job.job_id}")).json())

    async def wait(self, job: JobRef, timeout: float) -> JobStatus:
        """Long-poll until ``job`` is terminal; ``LabTimeoutError`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LabTimeoutError(f"job {job.job_id} not finished within {timeout:g} s")
            hold = min(self.config.long_poll_s, remaining)
            response = await self._call(
                "GET", f"/jobs/{job.job_id}", params={"wait": f"{hold:.3f}"}, extra_timeout=hold
            )
            status = self._status(response.json())
            if status.state.terminal:
                return status

    async def result(self, job: JobRef) -> dict[str, Any]:
        return (await self.status(job)).completed_result()

    async def cancel(self, job: JobRef) -> JobStatus:
        return self._status((await self._call("POST", f"/jobs/{job.job_id}/cancel")).json())

    async def events(self, after: int, wait: float) -> EventPage:
        """Completion events with ``seq > after``; holds up to ``wait`` s when there are none."""
        response = await self._call(
            "GET",
            "/events",
            params={"after": after, "wait": f"{wait:.3f}"},
            extra_timeout=wait,
            priority=True,
        )
        try:
            return EventPage.model_validate(response.json())
        except ValidationError as exc:
            raise LabStatusError(f"the lab answered an event page that does not parse: {exc}") from exc

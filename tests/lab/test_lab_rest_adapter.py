"""RestLabAdapter against httpx.MockTransport: retries, rejections, timeouts, breaker, secrets."""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

from labrl.errors import (
    ConfigError,
    LabAuthError,
    LabCircuitOpenError,
    LabRejectedError,
    LabStatusError,
    LabTimeoutError,
    LabTransportError,
)
from labrl.lab_adapters.protocol import JobState
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

STATUS = {"job_id": "job-1", "idempotency_key": "k1", "state": "queued"}


def adapter(handler, **overrides) -> RestLabAdapter:
    config = RestLabConfig(
        base_url="http://127.0.0.1:9",
        backoff_base_s=0.001,
        backoff_max_s=0.01,
        rate_limit_per_s=None,
        seed=0,
        **overrides,
    )
    return RestLabAdapter(config, transport=httpx.MockTransport(handler))


async def test_retries_5xx_then_succeeds_and_sends_key_and_token(api_key):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(
            (
                request.headers["idempotency-key"],
                request.headers["authorization"],
                json.loads(request.content),
            )
        )
        return httpx.Response(503) if len(seen) < 3 else httpx.Response(202, json=STATUS)

    lab = adapter(handler)
    job = await lab.submit({"kind": "echo", "payload": 1}, "k1")
    assert job.job_id == "job-1"
    assert [s[0] for s in seen] == ["k1", "k1", "k1"]
    assert seen[0][1] == f"Bearer {api_key}"
    assert seen[0][2] == {"request": {"kind": "echo", "payload": 1}}
    assert lab.stats["retries"] == 2 and lab.stats["retry_503"] == 2
    await lab.aclose()


async def test_429_retry_after_is_honoured(api_key):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(time.monotonic())
        if len(calls) == 1:
            return httpx.Response(429, headers={"Retry-After": "0.3"})
        return httpx.Response(202, json=STATUS)

    lab = adapter(handler)
    await lab.submit({"x": 1}, "k1")
    assert calls[1] - calls[0] >= 0.3
    await lab.aclose()


@pytest.mark.parametrize(
    ("status", "error", "message"),
    [
        (400, LabRejectedError, "POST /jobs: HTTP 400: nope"),
        (
            401,
            LabAuthError,
            "POST /jobs: HTTP 401: the lab refused the credentials in $LABRL_LAB_API_KEY: nope",
        ),
        (
            403,
            LabAuthError,
            "POST /jobs: HTTP 403: the lab refused the credentials in $LABRL_LAB_API_KEY: nope",
        ),
        (409, LabRejectedError, "POST /jobs: HTTP 409: nope"),
        (422, LabRejectedError, "POST /jobs: HTTP 422: nope"),
    ],
)
async def test_other_4xx_never_retried(api_key, status, error, message):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(status, json={"detail": "nope"})

    lab = adapter(handler)
    with pytest.raises(error, match=re.escape(message)):
        await lab.submit({"x": 1}, "k1")
    assert len(calls) == 1
    await lab.aclose()


async def test_unexpected_status_is_status_error(api_key):
    lab = adapter(lambda r: httpx.Response(302))
    with pytest.raises(LabStatusError, match=re.escape("POST /jobs: unexpected HTTP 302")):
        await lab.submit({"x": 1}, "k1")
    await lab.aclose()


@pytest.mark.parametrize(
    ("failure", "attempts", "error", "message"),
    [
        (httpx.ConnectError("connection refused"), 3, LabTransportError, "(gave up after 3 attempts)"),
        (httpx.ReadTimeout("slow"), 2, LabTimeoutError, "POST /jobs: no answer within 10 s (ReadTimeout)"),
    ],
    ids=["connection-error", "timeout"],
)
async def test_transport_failures_are_typed_after_every_attempt(api_key, failure, attempts, error, message):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        failure.request = request
        raise failure

    lab = adapter(handler, max_attempts=attempts, breaker_threshold=100)
    with pytest.raises(error, match=re.escape(message)):
        await lab.submit({"x": 1}, "k1")
    assert len(calls) == attempts
    await lab.aclose()


async def test_circuit_breaker_fails_fast_then_probes(api_key):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        return httpx.Response(500)

    # reset_s far above the (<= 10 ms) backoff, so the sequence holds on a loaded machine
    lab = adapter(handler, max_attempts=6, breaker_threshold=2, breaker_reset_s=0.5)
    with pytest.raises(LabStatusError, match=re.escape("POST /jobs: HTTP 500")):
        await lab.submit({"x": 1}, "k1")
    # attempts: fail, fail (circuit opens), fast-fail, probe fails (reopens), fast-fail, probe fails
    assert len(calls) == 4
    assert lab.stats["breaker_fast_fail"] == 2
    assert lab.breaker.times_opened == 3
    assert not lab.breaker.allow()  # open again right after the failed probe


async def test_breaker_open_error_when_never_probed(api_key):
    calls = []
    lab = adapter(
        lambda r: calls.append(1) or httpx.Response(500),
        max_attempts=1,
        breaker_threshold=2,
        breaker_reset_s=30,
    )
    lab.breaker.record_failure()
    lab.breaker.record_failure()
    with pytest.raises(
        LabCircuitOpenError, match=re.escape("POST /jobs: circuit open after 2 consecutive failures")
    ):
        await lab.submit({"x": 1}, "k1")
    assert calls == []  # the lab was not touched
    await lab.aclose()


async def test_wait_long_polls_until_terminal(api_key):
    states = iter(["running", "running", "completed"])
    waits = []

    def handler(request: httpx.Request) -> httpx.Response:
        waits.append(request.url.params["wait"])
        state = next(states)
        return httpx.Response(
            200, json={**STATUS, "state": state, "result": {"v": 1} if state == "completed" else None}
        )

    lab = adapter(handler, long_poll_s=5)
    from labrl.lab_adapters.protocol import JobRef

    status = await lab.wait(JobRef(job_id="job-1", idempotency_key="k1"), timeout=60)
    assert status.state is JobState.COMPLETED and status.result == {"v": 1}
    assert waits == ["5.000", "5.000", "5.000"]
    await lab.aclose()


def test_missing_api_key_is_config_error(monkeypatch):
    monkeypatch.delenv("LABRL_LAB_API_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=re.escape("lab API key missing: set the environment variable LABRL_LAB_API_KEY")
    ):
        RestLabAdapter(RestLabConfig(base_url="http://127.0.0.1:9"))


async def test_api_key_never_in_repr_logs_or_errors(api_key, caplog):
    caplog.set_level(logging.DEBUG)

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused {request.url}", request=request)

    lab = adapter(handler, max_attempts=2, breaker_threshold=100)
    with pytest.raises(LabTransportError) as info:
        await lab.submit({"x": 1}, "k1")
    texts = [
        repr(lab),
        str(lab.config),
        repr(lab.config),
        repr(lab._key),
        str(info.value),
        repr(info.value),
        caplog.text,
    ]
    assert caplog.text  # the give-up warning was logged
    assert all(api_key not in t for t in texts)
    await lab.aclose()

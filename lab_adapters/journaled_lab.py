"""``JournaledLab``: run experiments through a ``LabAdapter`` without losing or repeating one.

``run(request, key)`` is the call an env makes. It

1. journals ``key`` and the request (commit before anything goes out);
2. if the key was journaled before (a restarted client), re-attaches: a
   known job id is polled, an unknown one is looked up at the lab with
   ``find(key)``; only a key the lab has never seen is submitted;
3. submits with the key (idempotent at the lab), retrying transport errors,
   timeouts and 5xx with backoff until ``submit_deadline_s``;
4. waits for the terminal state: through the lab's completion feed when the
   adapter offers one (one connection for thousands of jobs) with a slow
   per-job status poll as a safety net, else by long-polling ``wait``;
5. delivers: ``Journal.deliver`` stores the result and returns True once per
   key, and only that first delivery calls ``on_result``. Duplicates (a
   repeated feed event, a retried poll, two waiters) are dropped.

6. acknowledges (``Journal.ack``) once ``on_result`` has returned.

``resume()`` hands over again every result stored but not acknowledged (the
process died between steps 5 and 6: at-least-once across a crash, never
lost), then does steps 2-6 for every journaled job not yet delivered.
Concurrent ``run`` calls for the same key share one driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from labrl.errors import LabAuthError, LabError, LabRejectedError, LabTimeoutError
from labrl.lab_adapters.job_journal import Journal, JournalEntry
from labrl.lab_adapters.protocol import (
    JobRef,
    JobState,
    JobStatus,
    LabAdapter,
    SupportsEvents,
    SupportsSubmitStatus,
)
from labrl.resilience import backoff_delay

log = logging.getLogger(__name__)

ResultCallback = Callable[[str, JobStatus], None]


class JournaledLabConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    wait_timeout_s: float = Field(
        default=24 * 3600.0, gt=0, description="give up waiting for one job after this"
    )
    submit_deadline_s: float = Field(default=600.0, gt=0, description="keep retrying a submit this long")
    use_feed: bool = True
    feed_wait_s: float = Field(default=10.0, ge=0)
    fallback_poll_s: float = Field(
        default=30.0, gt=0, description="poll a job's status if the feed is silent this long"
    )
    backoff_base_s: float = Field(default=0.1, ge=0)
    backoff_max_s: float = Field(default=5.0, ge=0)


class JobOutcome(BaseModel):
    """The terminal status of ``key``; ``fresh`` is True for the one delivery that called back."""

    model_config = ConfigDict(frozen=True)

    key: str
    status: JobStatus
    fresh: bool


class JournaledLab:
    def __init__(
        self,
        adapter: LabAdapter,
        journal: Journal,
        config: JournaledLabConfig | None = None,
        *,
        on_result: ResultCallback | None = None,
    ) -> None:
        self.adapter = adapter
        self.journal = journal
        self.config = config or JournaledLabConfig()
        self.on_result = on_result
        self.stats: Counter[str] = Counter()
        self._drivers: dict[str, asyncio.Task[JobOutcome]] = {}
        self._waiters: dict[str, asyncio.Future[JobStatus]] = {}
        self._early: dict[str, JobStatus] = {}
        self._feed_task: asyncio.Task[None] | None = None
        self._rng = random.Random(0)
        self._feed = self.config.use_feed and isinstance(adapter, SupportsEvents)

    async def aclose(self) -> None:
        if self._feed_task is not None:
            self._feed_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._feed_task
            self._feed_task = None

    # -- public -----------------------------------------------------------------

    async def run(self, request: dict[str, Any], key: str) -> JobOutcome:
        """Run ``request`` under ``key`` exactly once; see the module docstring."""
        if key in self._drivers:
            return await asyncio.shield(self._drivers[key])
        entry, created = await self.journal.record(key, request)
        return await self._drive(entry, created)

    async def resume(self) -> list[JobOutcome]:
        """Hand over results stored but never acknowledged, then re-attach to every job not yet delivered.

        Returns the outcomes of both (``fresh=True``: the consumer had not had them).
        """
        outcomes: list[JobOutcome] = []
        for entry in await self.journal.unacked_entries():
            self.stats["redelivered"] += 1
            status = entry.status()
            await self._hand_over(entry.key, status)
            outcomes.append(JobOutcome(key=entry.key, status=status, fresh=True))
        entries = await self.journal.open_entries()
        self.stats["resume_entries"] += len(entries)
        results = await asyncio.gather(
            *(self._drive(e, created=False) for e in entries), return_exceptions=True
        )
        for entry, result in zip(entries, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("resuming %s failed: %s", entry.key, result)
                continue
            outcomes.append(result)
        return outcomes

    # -- driver -----------------------------------------------------------------

    async def _drive(self, entry: JournalEntry, created: bool) -> JobOutcome:
        if entry.delivered:
            self.stats["replayed"] += 1
            return JobOutcome(key=entry.key, status=entry.status(), fresh=False)
        existing = self._drivers.get(entry.key)
        if existing is not None:
            return await asyncio.shield(existing)
        task = asyncio.ensure_future(self._drive_new(entry, created))
        self._drivers[entry.key] = task
        task.add_done_callback(lambda _t, key=entry.key: self._drivers.pop(key, None))
        return await asyncio.shield(task)

    async def _drive_new(self, entry: JournalEntry, created: bool) -> JobOutcome:
        key = entry.key
        if entry.job_id is not None:
            self.stats["resumed"] += 1
            job = JobRef(job_id=entry.job_id, idempotency_key=key)
        else:
            status: JobStatus | None = None
            if not created:
                status = await self._retrying(lambda: self.adapter.find(key), self.config.submit_deadline_s)
                if status is not None:
                    self.stats["reattached"] += 1
            if status is None:
                try:
                    status = await self._retrying(
                        lambda: self._submit(entry.request, key), self.config.submit_deadline_s
                    )
                except LabRejectedError as exc:
                    await self.journal.reject(key, str(exc))
                    raise
                self.stats["submitted"] += 1
            await self.journal.attach(key, status.job_id)
            if status.state.terminal:
                return await self._deliver(key, status)
            job = status.ref
        return await self._deliver(key, await self._await_terminal(job))

    async def _submit(self, request: dict[str, Any], key: str) -> JobStatus:
        if isinstance(self.adapter, SupportsSubmitStatus):
            return await self.adapter.submit_status(request, key)
        ref = await self.adapter.submit(request, key)
        return JobStatus(job_id=ref.job_id, idempotency_key=key, state=JobState.QUEUED)

    async def _retrying(self, call: Callable[[], Awaitable[Any]], deadline_s: float) -> Any:
        """``call()`` until it succeeds; lab errors other than rejections are retried until the deadline."""
        deadline = time.monotonic() + deadline_s
        attempt = 0
        while True:
            try:
                return await call()
            except (LabRejectedError, LabAuthError):  # retrying cannot help: the request or the key is wrong
                raise
            except LabError:
                self.stats["driver_retries"] += 1
                if time.monotonic() >= deadline:
                    raise
                delay = backoff_delay(
                    attempt, self.config.backoff_base_s, self.config.backoff_max_s, self._rng
                )
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                attempt += 1

    async def _await_terminal(self, job: JobRef) -> JobStatus:
        cfg = self.config
        deadline = time.monotonic() + cfg.wait_timeout_s
        if not self._feed:
            return await self._retrying(
                lambda: self.adapter.wait(job, cfg.wait_timeout_s), cfg.wait_timeout_s
            )
        self._ensure_feed()
        waiter = self._waiters.get(job.job_id)
        if waiter is None:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[job.job_id] = waiter
            early = self._early.pop(job.job_id, None)
            if early is not None:
                waiter.set_result(early)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LabTimeoutError(
                        f"job {job.job_id} ({job.idempotency_key}) not finished within {cfg.wait_timeout_s:g} s"
                    )
                try:
                    return await asyncio.wait_for(asyncio.shield(waiter), min(cfg.fallback_poll_s, remaining))
                except TimeoutError:
                    self.stats["fallback_polls"] += 1
                    try:
                        status = await self.adapter.status(job)
                    except (LabRejectedError, LabAuthError):
                        raise
                    except LabError:
                        continue
                    if status.state.terminal:
                        return status
        finally:
            self._waiters.pop(job.job_id, None)

    def _ensure_feed(self) -> None:
        if self._feed_task is None or self._feed_task.done():
            self._feed_task = asyncio.ensure_future(self._feed_loop())

    async def _feed_loop(self) -> None:
        assert isinstance(self.adapter, SupportsEvents)
        after = 0
        attempt = 0
        while True:
            try:
                page = await self.adapter.events(after, self.config.feed_wait_s)
            except LabAuthError as exc:  # every waiter would wait for nothing: fail them all now
                for waiter in self._waiters.values():
                    if not waiter.done():
                        waiter.set_exception(exc)
                return
            except LabError as exc:
                self.stats["feed_errors"] += 1
                log.debug("completion feed failed (%s); retrying", type(exc).__name__)
                await asyncio.sleep(
                    backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_max_s, self._rng)
                )
                attempt += 1
                continue
            attempt = 0
            for event in page.events:
                self.stats["feed_events"] += 1
                status = JobStatus(
                    job_id=event.job_id,
                    idempotency_key=event.idempotency_key,
                    state=event.state,
                    result=event.result,
                    error=event.error,
                )
                waiter = self._waiters.get(event.job_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(status)
                elif waiter is None:
                    self._early[event.job_id] = status
            after = max(after, page.next_after)

    async def _deliver(self, key: str, status: JobStatus) -> JobOutcome:
        fresh = await self.journal.deliver(key, status)
        if not fresh:
            self.stats["duplicates_dropped"] += 1
            stored = await self.journal.get(key)
            assert stored is not None and stored.delivered
            return JobOutcome(key=key, status=stored.status(), fresh=False)
        self.stats["delivered"] += 1
        await self._hand_over(key, status)
        return JobOutcome(key=key, status=status, fresh=True)

    async def _hand_over(self, key: str, status: JobStatus) -> None:
        """Call ``on_result``, then acknowledge: a crash in between hands the result over again on resume."""
        if self.on_result is not None:
            self.on_result(key, status)
        await self.journal.ack(key)

"""``SimulatorAdapter``: the ``LabAdapter`` protocol over local ASE calculators.

Calculation requests (``labrl.lab_adapters.calculators``) run off the event
loop: in the shared process pool (``run_cpu``) for fast backends, in a fresh
subprocess killed at ``timeout_s`` (``run_killable``) for hang-prone ones
(PySCF). Results are cached by the canonical structure hash plus backend,
task and task parameters, so a thousand episodes asking for the energy of the
same structure pay for one calculation; concurrent identical requests share
one computation. Jobs live in memory: a simulator is cheap to re-run, which
is why it needs no journal.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from typing import Any

from labrl.errors import LabRejectedError, LabrlError, LabTimeoutError
from labrl.lab_adapters.calculators import BACKENDS, execute_calculation, validate_calculation
from labrl.lab_adapters.protocol import JobRef, JobState, JobStatus, request_hash
from labrl.lab_adapters.structures import parse_structure, structure_hash
from labrl.offload import run_cpu, run_killable


def cache_key(request: dict[str, Any]) -> str:
    """Canonical structure hash + backend + task + the task's parameters."""
    atoms = parse_structure(request["structure"], max_atoms=BACKENDS[request["backend"]].max_atoms)
    params = {k: v for k, v in request.items() if k not in ("structure", "kind")}
    return structure_hash(atoms, request_hash(params))


class SimulatorAdapter:
    def __init__(self, *, timeout_s: float = 600.0, cache_size: int = 4096, max_concurrency: int = 8) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self._jobs: dict[str, tuple[str, asyncio.Task[dict[str, Any]]]] = {}
        self._by_key: dict[str, str] = {}
        self._hash_of_key: dict[str, str] = {}
        self._ids = itertools.count()
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self.calls = 0
        self.cache_hits = 0

    async def _compute(self, key: str, request: dict[str, Any]) -> dict[str, Any]:
        async with self._semaphore:
            self.calls += 1
            if BACKENDS[request["backend"]].killable:
                result = await run_killable(execute_calculation, request, timeout=self.timeout_s)
            else:
                async with asyncio.timeout(self.timeout_s):
                    result = await run_cpu(execute_calculation, request)
        self._cache[key] = result
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return result

    async def calculate(self, request: dict[str, Any]) -> dict[str, Any]:
        """Run (or fetch from the cache) one calculation; errors propagate as raised."""
        key = cache_key(request)
        if key in self._cache:
            self.cache_hits += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._compute(key, request))
            self._inflight[key] = task
            task.add_done_callback(lambda _t: self._inflight.pop(key, None))
        else:
            self.cache_hits += 1
        return await asyncio.shield(task)

    # -- the LabAdapter protocol ------------------------------------------------

    async def submit(self, request: dict[str, Any], idempotency_key: str) -> JobRef:
        rhash = request_hash(request)
        if idempotency_key in self._by_key:
            if self._hash_of_key[idempotency_key] != rhash:
                raise LabRejectedError(
                    f"idempotency key {idempotency_key!r} was used for a different request"
                )
            return JobRef(job_id=self._by_key[idempotency_key], idempotency_key=idempotency_key)
        try:
            validate_calculation(request)
        except LabrlError as exc:
            raise LabRejectedError(f"calculation refused: {exc}") from exc
        job_id = f"sim-{next(self._ids)}"
        self._jobs[job_id] = (idempotency_key, asyncio.ensure_future(self.calculate(request)))
        self._by_key[idempotency_key] = job_id
        self._hash_of_key[idempotency_key] = rhash
        return JobRef(job_id=job_id, idempotency_key=idempotency_key)

    async def find(self, idempotency_key: str) -> JobStatus | None:
        job_id = self._by_key.get(idempotency_key)
        return (
            None
            if job_id is None
            else await self.status(JobRef(job_id=job_id, idempotency_key=idempotency_key))
        )

    def _task(self, job: JobRef) -> asyncio.Task[dict[str, Any]]:
        if job.job_id not in self._jobs:
            raise LabRejectedError(f"unknown job {job.job_id!r}")
        return self._jobs[job.job_id][1]

    async def status(self, job: JobRef) -> JobStatus:
        task = self._task(job)
        if not task.done():
            return JobStatus(job_id=job.job_id, idempotency_key=job.idempotency_key, state=JobState.RUNNING)
        if task.cancelled():
            return JobStatus(job_id=job.job_id, idempotency_key=job.idempotency_key, state=JobState.CANCELLED)
        exc = task.exception()
        if exc is not None:
            return JobStatus(
                job_id=job.job_id,
                idempotency_key=job.idempotency_key,
                state=JobState.FAILED,
                error=f"{type(exc).__name__}: {exc}",
            )
        return JobStatus(
            job_id=job.job_id,
            idempotency_key=job.idempotency_key,
            state=JobState.COMPLETED,
            result=task.result(),
        )

    async def wait(self, job: JobRef, timeout: float) -> JobStatus:
        task = self._task(job)
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise LabTimeoutError(f"job {job.job_id} not finished within {timeout:g} s") from None
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        except Exception:  # the job failed: its status carries the error
            pass
        return await self.status(job)

    async def result(self, job: JobRef) -> dict[str, Any]:
        return (await self.wait(job, self.timeout_s)).completed_result()

    async def cancel(self, job: JobRef) -> JobStatus:
        self._task(job).cancel()
        await asyncio.sleep(0)
        return await self.status(job)

    async def aclose(self) -> None:
        for _key, task in self._jobs.values():
            task.cancel()
        self._jobs.clear()

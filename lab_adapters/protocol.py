"""The ``LabAdapter`` protocol: the client side of anything that runs an experiment.

A lab (an autonomous synthesis lab, a DFT worker pool, a remote calculator)
takes a request, runs it for seconds to hours, and reports a result. The
protocol is five calls::

    job = await lab.submit(request, idempotency_key="run7/ep42/exp0")   # JobRef
    status = await lab.wait(job, timeout=600)     # JobStatus, terminal unless it timed out
    status = await lab.status(job)                # one look, no waiting
    result = await lab.result(job)                # the result dict of a completed job
    status = await lab.cancel(job)

``idempotency_key`` is chosen by the caller and makes ``submit`` safe to
repeat: the same key with the same request returns the same job (never a
second experiment); the same key with a different request is refused
(``LabRejectedError``). ``find(key)`` looks a key up without submitting,
which is how a restarted client re-attaches to a job it may or may not have
submitted before it died.

Job states::

    queued -> running -> completed | failed
         \\-> cancelled            (any non-terminal state)
    completed -> expired           (the lab dropped the result after its TTL)
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from labrl.errors import LabJobError


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    REJECTED = "rejected"  # the lab refused the submission (journaled by JournaledLab; never ran)

    @property
    def terminal(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


class JobRef(BaseModel):
    """A handle on a submitted job."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    idempotency_key: str


class JobStatus(BaseModel):
    """What the lab says about a job. ``result`` is set only when completed."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    idempotency_key: str
    state: JobState
    result: dict[str, Any] | None = None
    error: str | None = None
    request_hash: str | None = None
    updated_at: float | None = None

    @property
    def ref(self) -> JobRef:
        return JobRef(job_id=self.job_id, idempotency_key=self.idempotency_key)

    def completed_result(self, what: str = "job") -> dict[str, Any]:
        """The result of a completed job; ``LabJobError`` naming the state (and error) otherwise."""
        if self.state is JobState.COMPLETED and self.result is not None:
            return self.result
        raise LabJobError(
            f"{what} {self.job_id} has no result: state {self.state.value}"
            + (f" ({self.error})" if self.error else "")
        )


class CompletionEvent(BaseModel):
    """One entry of a lab's completion feed (at-least-once: may repeat)."""

    model_config = ConfigDict(frozen=True)

    seq: int
    job_id: str
    idempotency_key: str
    state: JobState
    result: dict[str, Any] | None = None
    error: str | None = None


class EventPage(BaseModel):
    model_config = ConfigDict(frozen=True)

    events: tuple[CompletionEvent, ...] = ()
    next_after: int = Field(ge=0)


def request_hash(request: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``request`` (sorted keys, no spaces).

    Both the client and the lab use it to tell "the same request again" from
    "a different request under a reused key".
    """
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@runtime_checkable
class LabAdapter(Protocol):
    """Submit, wait, look, fetch, cancel. See the module docstring."""

    async def submit(self, request: dict[str, Any], idempotency_key: str) -> JobRef: ...

    async def find(self, idempotency_key: str) -> JobStatus | None: ...

    async def status(self, job: JobRef) -> JobStatus: ...

    async def wait(self, job: JobRef, timeout: float) -> JobStatus: ...

    async def result(self, job: JobRef) -> dict[str, Any]: ...

    async def cancel(self, job: JobRef) -> JobStatus: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SupportsSubmitStatus(Protocol):
    """A lab whose submit answers with the job's full status (a lab that dedupes by key may answer a
    finished job at once), not only its id: the journal can then deliver without a poll."""

    async def submit_status(self, request: dict[str, Any], idempotency_key: str) -> JobStatus: ...


@runtime_checkable
class SupportsEvents(Protocol):
    """A lab that also offers a completion feed (one connection for many jobs)."""

    async def events(self, after: int, wait: float) -> EventPage: ...

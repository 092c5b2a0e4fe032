"""``MadsciNodeAdapter``: the ``LabAdapter`` protocol over a MADSci node's REST action API.

A MADSci node (``madsci-node-module`` 0.8, a ``RestNode``) runs *actions*. Its
REST API, as served by ``madsci.node_module.rest_node_module``::

    POST /action/{name}                 {"args": {...}}     -> {"action_id": ULID}   (created, not run)
    POST /action/{name}/{id}/start                          -> the action's result so far
    GET  /action/{name}/{id}/status                         -> "not_started" | "running" | ... | "unknown"
    GET  /action/{name}/{id}/result                         -> {"status", "errors", "json_result", ...}

A request for this adapter names the action and its arguments:
``{"action": "measure", "args": {"sample": "A1", "seconds": 2}}``. The job id is
``"{action}/{action_id}"``, so every later call can build its route from it.

Action states and what labrl makes of them::

    not_started                  -> queued
    running, paused              -> running
    succeeded                    -> completed  (result: json_result if it is a dict, else {"value": it})
    failed                       -> failed     (error: the node's error messages)
    not_ready                    -> failed; at submit, the node was busy (one action at a
                                    time) and dropped it unrun: offered again under a new
                                    action id every poll gap for up to ``busy_wait_s``
    cancelled                    -> cancelled
    unknown                      -> see "re-attaching" below

Idempotency. MADSci has no idempotency key, so this adapter keeps the caller's
key in labrl's job journal (``labrl.lab_adapters.job_journal.Journal``, the one
``JournaledLab`` uses) and relies on three facts of the node's code:

1. creating an action runs nothing: it only parks the request under a new id;
2. ``start`` runs a parked action and un-parks it, so a second ``start`` of the
   same id answers ``failed``/``NotFound`` and runs nothing;
3. the node keeps parked actions and its action history in memory only: after a
   node restart every earlier id is ``unknown``.

So ``submit`` records the key, creates the action, **journals the action id
(``Journal.attach``) before it starts the action**, then starts it. A restarted
client finds the key's action id in the journal and polls it instead of
creating another (``find``; ``JournaledLab`` does the same from its own entry).
A client that died between ``attach`` and ``start`` left a parked action: its
status is ``unknown``, and the next look starts it (fact 2 makes that safe).
A client that died after ``create`` and before ``attach`` left a parked action
that nothing will ever start: the key is then submitted anew, and still runs once.
An ``unknown`` action that ``start`` does not find was lost by a node restart
(fact 3): it may have run in part, so it is reported ``failed`` with that
reason and never started again; to repeat the experiment, submit under a new key.

Transport: every call goes through ``RestLabAdapter``'s one HTTP path
(``labrl.lab_adapters.rest``): per-call timeouts, retries with backoff, the
circuit breaker, and its status rules (401/403 -> ``LabAuthError``, which stops;
422, a request the action's signature refuses -> ``LabRejectedError``). MADSci
0.8 nodes have no authentication of their own; a key in the environment
variable ``api_key_env`` (when set) goes out as a bearer token for a proxy in
front of the node, and is never logged.

``cancel`` is refused (``LabRejectedError``): MADSci 0.8 cancels through
``POST /admin/cancel``, which stops whatever the node is doing, not one action.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from labrl.errors import LabRejectedError, LabStatusError, LabTimeoutError
from labrl.lab_adapters.job_journal import Journal
from labrl.lab_adapters.protocol import JobRef, JobState, JobStatus
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

#: the state of an action a busy node refused to start: dropped, never run
NOT_READY = "not_ready"

#: MADSci ``ActionStatus`` value -> labrl state; ``unknown`` is resolved separately (module docstring).
ACTION_STATES: dict[str, JobState] = {
    "not_started": JobState.QUEUED,
    "running": JobState.RUNNING,
    "paused": JobState.RUNNING,
    "succeeded": JobState.COMPLETED,
    "failed": JobState.FAILED,
    NOT_READY: JobState.FAILED,
    "cancelled": JobState.CANCELLED,
}
UNKNOWN = "unknown"
_ACTION_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")


class MadsciNodeConfig(BaseModel):
    """Where the node is, how patiently to call it, and how often to look at a running action."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_url: str
    api_key_env: str = "LABRL_MADSCI_API_KEY"
    call_timeout_s: float = Field(
        default=10.0, gt=0, description="deadline of one HTTP call; start holds its answer 0.5 s"
    )
    connect_timeout_s: float = Field(default=3.0, gt=0)
    max_attempts: int = Field(default=8, ge=1)
    backoff_base_s: float = Field(default=0.1, ge=0)
    backoff_max_s: float = Field(default=5.0, ge=0)
    poll_first_s: float = Field(default=0.25, gt=0, description="first wait between status polls")
    poll_max_s: float = Field(default=5.0, gt=0, description="polls back off x1.5 up to this")
    busy_wait_s: float = Field(
        default=600.0,
        ge=0,
        description="how long submit keeps offering an experiment to a node that refuses it as busy",
    )

    def http(self) -> RestLabConfig:
        """The transport settings, in the form the shared HTTP path takes."""
        return RestLabConfig(
            base_url=self.node_url,
            api_key_env=self.api_key_env,
            require_api_key=False,
            call_timeout_s=self.call_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            max_attempts=self.max_attempts,
            backoff_base_s=self.backoff_base_s,
            backoff_max_s=self.backoff_max_s,
        )


def action_of(request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(action name, args)`` of a request; ``LabRejectedError`` (never sent) when malformed."""
    name, args = request.get("action"), request.get("args", {})
    if not isinstance(name, str) or not _ACTION_NAME.match(name):
        raise LabRejectedError(
            f'a MADSci request needs "action", an action name like "measure"; got {name!r}'
        )
    if not isinstance(args, dict) or set(request) - {"action", "args"}:
        raise LabRejectedError('a MADSci request is {"action": NAME, "args": {...}} and nothing else')
    return name, args


def _split(job: JobRef) -> tuple[str, str]:
    name, _, action_id = job.job_id.partition("/")
    if not action_id:
        raise LabRejectedError(f"{job.job_id!r} is not a MADSci job id (ACTION/ACTION_ID)")
    return name, action_id


def _errors(answer: dict[str, Any]) -> list[dict[str, Any]]:
    errors = answer.get("errors") or []
    return [e for e in errors if isinstance(e, dict)]


class MadsciNodeAdapter:
    """A ``LabAdapter`` for one MADSci node; see the module docstring."""

    def __init__(self, config: MadsciNodeConfig, journal: Journal) -> None:
        self.config = config
        self.journal = journal
        self._http = RestLabAdapter(config.http())

    def __repr__(self) -> str:
        return f"MadsciNodeAdapter(node_url={self.config.node_url!r})"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        # RestLabAdapter._call is the one place where HTTP becomes labrl errors and retries
        return (await self._http._call(method, path, **kwargs)).json()

    # -- the LabAdapter protocol ------------------------------------------------

    async def submit_status(self, request: dict[str, Any], idempotency_key: str) -> JobStatus:
        """Create, journal, start (module docstring); a key already journaled is looked at, not re-run."""
        name, args = action_of(request)
        entry, _ = await self.journal.record(idempotency_key, request)
        if entry.job_id is not None:
            return await self.status(JobRef(job_id=entry.job_id, idempotency_key=idempotency_key))
        deadline = time.monotonic() + self.config.busy_wait_s
        gap = self.config.poll_first_s
        while True:
            created = await self._call("POST", f"/action/{name}", json={"args": args})
            job = JobRef(job_id=f"{name}/{created['action_id']}", idempotency_key=idempotency_key)
            await self.journal.attach(idempotency_key, job.job_id)  # before start: a restart re-attaches
            answer = await self._start_answer(job)
            # not_ready: the node was busy (it runs one action at a time) and dropped the action
            # unrun; offer the experiment again under a new action id until busy_wait_s
            if answer.get("status") != NOT_READY or time.monotonic() + gap > deadline:
                return await self._status_of_start(job, answer)
            await asyncio.sleep(gap)
            gap = min(gap * 1.5, self.config.poll_max_s)

    async def submit(self, request: dict[str, Any], idempotency_key: str) -> JobRef:
        return (await self.submit_status(request, idempotency_key)).ref

    async def find(self, idempotency_key: str) -> JobStatus | None:
        """The status of the action journaled under the key; None if none was ever started."""
        entry = await self.journal.get(idempotency_key)
        if entry is None or entry.job_id is None:
            return None
        return await self.status(JobRef(job_id=entry.job_id, idempotency_key=idempotency_key))

    async def status(self, job: JobRef) -> JobStatus:
        """One look; an ``unknown`` action is started if the node still holds it parked."""
        return await self._look(job, start_parked=True)

    async def wait(self, job: JobRef, timeout: float) -> JobStatus:
        """Poll until terminal (first gap ``poll_first_s``, x1.5 up to ``poll_max_s``)."""
        deadline = time.monotonic() + timeout
        gap = self.config.poll_first_s
        while True:
            status = await self.status(job)
            if status.state.terminal:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LabTimeoutError(f"MADSci action {job.job_id} not finished within {timeout:g} s")
            await asyncio.sleep(min(gap, remaining))
            gap = min(gap * 1.5, self.config.poll_max_s)

    async def result(self, job: JobRef) -> dict[str, Any]:
        return (await self.status(job)).completed_result("MADSci action")

    async def cancel(self, job: JobRef) -> JobStatus:
        raise LabRejectedError(
            f"MADSci action {job.job_id} cannot be cancelled alone: MADSci 0.8 cancels with "
            "POST /admin/cancel, which stops whatever the node is running"
        )

    # -- MADSci specifics -------------------------------------------------------

    async def _start(self, job: JobRef) -> JobStatus:
        return await self._status_of_start(job, await self._start_answer(job))

    async def _start_answer(self, job: JobRef) -> dict[str, Any]:
        name, action_id = _split(job)
        return await self._call("POST", f"/action/{name}/{action_id}/start")

    async def _status_of_start(self, job: JobRef, answer: dict[str, Any]) -> JobStatus:
        if any(e.get("error_type") == "NotFound" for e in _errors(answer)):
            # not parked: started already (a retried start) or lost with a node restart
            return await self._look(job, start_parked=False)
        return self._to_status(job, answer)

    async def _look(self, job: JobRef, *, start_parked: bool) -> JobStatus:
        name, action_id = _split(job)
        state = await self._call("GET", f"/action/{name}/{action_id}/status")
        if state == UNKNOWN:
            if start_parked:
                return await self._start(job)
            return JobStatus(
                job_id=job.job_id,
                idempotency_key=job.idempotency_key,
                state=JobState.FAILED,
                error=(
                    f"the MADSci node at {self.config.node_url} no longer knows action {action_id}: it "
                    "restarted (MADSci keeps actions in memory). It may have run in part, so labrl does "
                    "not run it again; submit under a new key to repeat the experiment"
                ),
            )
        if state not in ACTION_STATES:
            raise LabStatusError(f"MADSci node answered an unknown action status {state!r}")
        if not ACTION_STATES[state].terminal:
            return JobStatus(
                job_id=job.job_id, idempotency_key=job.idempotency_key, state=ACTION_STATES[state]
            )
        return self._to_status(job, await self._call("GET", f"/action/{name}/{action_id}/result"))

    @staticmethod
    def _to_status(job: JobRef, answer: dict[str, Any]) -> JobStatus:
        raw = answer.get("status")
        if raw not in ACTION_STATES:
            raise LabStatusError(f"MADSci node answered an action result with status {raw!r}")
        state = ACTION_STATES[raw]
        result: dict[str, Any] | None = None
        if state is JobState.COMPLETED:
            value = answer.get("json_result")
            result = value if isinstance(value, dict) else {"value": value}
        messages = "; ".join(str(e.get("message", e)) for e in _errors(answer))
        return JobStatus(
            job_id=job.job_id,
            idempotency_key=job.idempotency_key,
            state=state,
            result=result,
            error=messages or None,
        )

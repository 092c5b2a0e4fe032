"""labrl.lab_adapters: clients for labs, instruments and simulators; the mock lab in ``mock``.

- ``LabAdapter`` protocol (``protocol``): submit / find / status / wait / result / cancel.
- ``RestLabAdapter`` (``rest``): the protocol over a lab's REST API, with retries,
  timeouts, rate limit, concurrency cap and circuit breaker.
- ``Journal`` + ``JournaledLab`` (``job_journal``, ``journaled_lab``): no experiment lost
  or paid for twice across crashes and restarts.
- ``MadsciNodeAdapter`` (``madsci``): the protocol over a MADSci node's REST
  actions, its action ids journaled before they start (import it from there).
- ``SimulatorAdapter`` (``simulator``): ASE calculators off the event loop,
  cached by canonical structure hash.
- ``recipes``: what a valid ``synthesis`` job is (shelf, limits, targets,
  candidate phases): the contract between the lab envs and any lab.
- the mock lab, its own package ``labrl.lab_adapters.mock`` (server, store,
  child process, simulated jobs and the hidden synthesis chemistry;
  ``labrl lab serve-mock``). No real adapter imports it.
"""

from labrl.lab_adapters.job_journal import Journal, JournalEntry
from labrl.lab_adapters.journaled_lab import JobOutcome, JournaledLab, JournaledLabConfig
from labrl.lab_adapters.protocol import (
    CompletionEvent,
    EventPage,
    JobRef,
    JobState,
    JobStatus,
    LabAdapter,
    SupportsEvents,
    SupportsSubmitStatus,
    request_hash,
)
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig
from labrl.lab_adapters.simulator import SimulatorAdapter

__all__ = [
    "CompletionEvent",
    "EventPage",
    "JobOutcome",
    "JobRef",
    "JobState",
    "JobStatus",
    "Journal",
    "JournalEntry",
    "JournaledLab",
    "JournaledLabConfig",
    "LabAdapter",
    "RestLabAdapter",
    "RestLabConfig",
    "SimulatorAdapter",
    "SupportsEvents",
    "SupportsSubmitStatus",
    "request_hash",
]

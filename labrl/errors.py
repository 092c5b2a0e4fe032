"""The labrl exception tree.

One root, ``LabrlError``; every category also subclasses the builtin a caller
would reach for, so ``except ValueError`` still catches a bad config::

    LabrlError
    ├── ConfigError (ValueError)              bad config or argument: says what to fix
    │   ├── PatternFileError                  a measured-pattern file that cannot be read (file, line)
    │   └── PlacementError                    backend=ray: unknown resource or impossible placement
    ├── RegistryError (LookupError)           unknown or duplicate env id
    ├── MissingExtraError (ImportError)       an optional extra (labrl[openenv], ...) is not installed
    ├── EnvError (RuntimeError)               the environment itself failed -> outcome env_error
    │   └── TransientEnvError                 infrastructure hiccup: retried within the budget
    ├── InvalidActionError (ValueError)       the model's action is unusable -> outcome invalid_action
    ├── VerifierError (RuntimeError)          scoring failed -> outcome verifier_failed (never a 0)
    ├── EnvTimeoutError (TimeoutError)        a phase overran its deadline -> outcome timeout
    ├── CredentialsRefusedError (PermissionError)  a lab or judge refused our key (401/403): stops the run
    ├── BudgetExhaustedError (RuntimeError)   a cascade stage's run budget is spent: stops the run
    ├── LabError (RuntimeError)               lab adapters (labrl.lab_adapters)
    │   ├── LabTransportError (ConnectionError)
    │   │   └── LabCircuitOpenError           the client's circuit breaker is open: not even tried
    │   ├── LabTimeoutError (TimeoutError)
    │   ├── LabStatusError                    unexpected HTTP status from the lab
    │   ├── LabRejectedError (ValueError)     the lab refused the request (4xx, conflict)
    │   ├── LabAuthError (CredentialsRefused) the lab refused our credentials (401/403): stop, never a reward
    │   ├── LabJournalError                   the job journal is empty, corrupt or not a journal
    │   └── LabJobError                       the job ended without a result (failed, cancelled, expired)
    ├── JudgeError (RuntimeError)             rubric judges (labrl.verifiers.rubric)
    │   └── JudgeAuthError (CredentialsRefused) the judge refused our credentials (401/403): stop, never a reward
    ├── SamplerError (RuntimeError)           samplers (local, SGLang)
    ├── LearnerError (RuntimeError)           learners
    │   └── LearnerLostError                  backend=ray: the learner actor (or its node) died
    └── WorkerLostError (RuntimeError)        backend=ray: every actor of a pool is gone for good

All are picklable (they cross process-pool and Ray boundaries): each keeps its
constructor arguments in ``args`` so the default ``__reduce__`` rebuilds it.
"""

from __future__ import annotations


class LabrlError(Exception):
    """Root of every error labrl raises on purpose."""


class ConfigError(LabrlError, ValueError):
    """A config value or argument is wrong; the message names the field and the fix."""


class PatternFileError(ConfigError):
    """A measured-pattern file is malformed; names the file and, where known, the line (1-based)."""

    def __init__(self, path: str, line: int | None, reason: str):
        super().__init__(path, line, reason)  # args rebuild the error when unpickled
        self.path, self.line, self.reason = path, line, reason

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else self.path
        return f"{where}: {self.reason}"


class RegistryError(LabrlError, LookupError):
    """An env id is unknown, malformed or registered twice."""


class MissingExtraError(LabrlError, ImportError):
    """An optional extra is not installed; the message is one line naming the ``pip install`` to run."""


class EnvError(LabrlError, RuntimeError):
    """The environment failed (a bug or a broken backend), not the model."""


class TransientEnvError(EnvError):
    """An infrastructure error worth retrying (connection reset, 503, busy worker)."""


class InvalidActionError(LabrlError, ValueError):
    """The model's action cannot be used; the message is shown to the model."""


class VerifierError(LabrlError, RuntimeError):
    """Scoring failed. The episode is masked from training, never scored 0."""


class EnvTimeoutError(LabrlError, TimeoutError):
    """A phase (reset, step, scoring) overran its deadline."""


class CredentialsRefusedError(LabrlError, PermissionError):
    """A service the run depends on (a lab, a judge) refused our credentials (HTTP 401/403).

    A setup error, never the model's fault: every episode would fail alike, so it stops the env
    and the run (``labrl.envs.budgets.STOPS_THE_RUN``) instead of becoming an outcome or a reward.
    """


class BudgetExhaustedError(LabrlError, RuntimeError):
    """A cascade stage would be charged beyond the run's budget for it (``cascade.budgets``).

    Stops the run (``labrl.envs.budgets.STOPS_THE_RUN``): every later episode would need the stage
    alike, and skipping the audits a spent budget cannot pay for would bias the reward.
    """


class LabError(LabrlError, RuntimeError):
    """Root of lab-adapter errors."""


class LabTransportError(LabError, ConnectionError):
    """The lab could not be reached (connection refused, reset, DNS)."""


class LabTimeoutError(LabError, TimeoutError):
    """A call to the lab, or the wait for a job, overran its deadline."""


class LabStatusError(LabError):
    """The lab answered with an HTTP status the client did not expect."""


class LabRejectedError(LabError, ValueError):
    """The lab refused the request (bad payload, auth, idempotency conflict)."""


class LabAuthError(LabError, CredentialsRefusedError):
    """The lab refused the client's credentials (HTTP 401/403): a setup error, never the model's fault."""


class LabJournalError(LabError):
    """The job journal cannot be trusted (empty, corrupt, not a journal); start fresh only if told to."""


class LabCircuitOpenError(LabTransportError):
    """The client's circuit breaker is open after repeated failures; the call was not made."""


class LabJobError(LabError):
    """The job has no result: it failed, was cancelled or expired, or is not finished yet."""


class JudgeError(LabrlError, RuntimeError):
    """A rubric judge failed or answered something that does not parse."""


class JudgeAuthError(JudgeError, CredentialsRefusedError):
    """The judge refused the client's credentials (HTTP 401/403): a setup error, never a verifier failure."""


class SamplerError(LabrlError, RuntimeError):
    """The sampler (local or remote inference engine) failed."""


class LearnerError(LabrlError, RuntimeError):
    """The learner failed (model build, checkpoint, train step)."""


class PlacementError(ConfigError):
    """``backend=ray``: a resource no node has, or an actor / placement group that cannot be placed."""


class LearnerLostError(LearnerError):
    """``backend=ray``: the learner actor died; the run stops and resumes from its last checkpoint."""


class WorkerLostError(LabrlError, RuntimeError):
    """``backend=ray``: every env worker (or sampler) actor is dead and out of restarts."""


class RunFailedError(LabrlError, RuntimeError):
    """A training run stopped on an unexpected (internal) error; its traceback is in the run's errors.jsonl."""


__all__ = [
    "BudgetExhaustedError",
    "ConfigError",
    "CredentialsRefusedError",
    "EnvError",
    "EnvTimeoutError",
    "InvalidActionError",
    "JudgeAuthError",
    "JudgeError",
    "LabAuthError",
    "LabCircuitOpenError",
    "LabError",
    "LabJobError",
    "LabJournalError",
    "LabRejectedError",
    "LabStatusError",
    "LabTimeoutError",
    "LabTransportError",
    "LabrlError",
    "LearnerError",
    "LearnerLostError",
    "MissingExtraError",
    "PatternFileError",
    "PlacementError",
    "RegistryError",
    "RunFailedError",
    "SamplerError",
    "TransientEnvError",
    "VerifierError",
    "WorkerLostError",
]


class StructureFileError(ConfigError):
    """A crystal-structure file (CIF) that cannot be read or fails validation."""

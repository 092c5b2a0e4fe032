"""labrl.harness.pipeline: sync / one-step-off / PipelineRL training over the Env contract.

See ``orchestrator`` for the loop, ``buffer`` for dynamic sampling,
``admission`` for staleness pacing, ``overlong`` for length handling and
``runner`` for building a run from a ``RunConfig``.
"""

from labrl.harness.pipeline.admission import (
    AdmissionState,
    may_start,
    predicted_staleness,
    predicted_train_version,
)
from labrl.harness.pipeline.buffer import Group, GroupBuffer
from labrl.harness.pipeline.orchestrator import (
    Orchestrator,
    PipelineStalledError,
    latest_checkpoint,
    sampling_seed,
    task_seed,
    token_staleness,
)
from labrl.harness.pipeline.overlong import (
    BudgetForcingSampler,
    length_penalty,
    mask_unsampled_tokens,
    process_overlong,
)

__all__ = [
    "AdmissionState",
    "BudgetForcingSampler",
    "Group",
    "GroupBuffer",
    "Orchestrator",
    "PipelineStalledError",
    "latest_checkpoint",
    "length_penalty",
    "mask_unsampled_tokens",
    "may_start",
    "predicted_staleness",
    "predicted_train_version",
    "process_overlong",
    "sampling_seed",
    "task_seed",
    "token_staleness",
]

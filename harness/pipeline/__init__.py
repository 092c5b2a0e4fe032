"""labrl.harness.pipeline: sync / one-step-off / PipelineRL training over the Env contract.

See ``orchestrator`` for the loop, ``buffer`` for dynamic sampling,
``admission`` for staleness pacing, ``overlong`` for length handling,
``evaluation`` for the test split, ``weight_sync`` for the hand-over of
weights and ``runner`` for ``train``: a run from a ``RunConfig``.
"""

from labrl.harness.pipeline.admission import (
    AdmissionState,
    may_start,
    predicted_staleness,
    predicted_train_version,
)
from labrl.harness.pipeline.buffer import Group, GroupBuffer
from labrl.harness.pipeline.checkpoint import latest_checkpoint
from labrl.harness.pipeline.orchestrator import Orchestrator, PipelineStalledError, sampling_seed, task_seed
from labrl.harness.pipeline.overlong import (
    BudgetForcingSampler,
    length_penalty,
    mask_unsampled_tokens,
    process_overlong,
)
from labrl.harness.pipeline.stats import token_staleness

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

"""labrl.harness.objectives: off-policy RL objectives as pure torch functions.

One typed config (``ObjectiveConfig``) composes an advantage estimator, a
policy loss, behaviour-policy corrections and an aggregation mode. The learner
calls ``prepare`` once per global batch (no grad) and ``policy_loss`` per
micro-batch; see ``_objective`` for the flow (and the decoupled-PPO semantics) and
docs/objectives.md for the formulas. Each building block is also exported as a plain function so it can
be tested and reused on its own.
"""

from ._advantages import (
    GroupStats,
    compute_advantages,
    dr_grpo_advantages,
    group_stats,
    grpo_advantages,
    rloo_advantages,
    whiten_advantages,
)
from ._aggregation import aggregate, global_denominator, valid_counts
from ._config import M2PO, OPSM, TIS, Correction, GeoMask, IcePop, ObjectiveConfig, TokenMask, Veto
from ._corrections import (
    M2POResult,
    geo_mask,
    icepop_weights,
    m2po_mask,
    opsm_mask,
    tis_sequence_weights,
    tis_token_truncated,
    tis_token_weights,
    token_mask,
    veto_mask,
)
from ._diagnostics import (
    effective_sample_size,
    mismatch_kl,
    quantiles,
    ratio_stats,
    staleness_stats,
    version_span,
)
from ._kl import kl_estimate
from ._losses import (
    TokenLoss,
    cispo_loss,
    gspo_loss,
    ppo_loss,
    proximal_is_current_loss,
    reinforce_loss,
    sapo_loss,
    sequence_log_ratio,
)
from ._metrics import DeviceMetrics, Metrics, MetricSums, host_metrics, sum_metrics
from ._objective import (
    BatchInputs,
    BatchTerms,
    ObjectiveInputs,
    PreparedBatch,
    batch_terms,
    combine_metrics,
    minibatch,
    nonfinite,
    policy_loss,
    prepare,
    prepare_rows,
    proximal_is_current_metrics,
    whole_batch_terms,
)

__all__ = [
    "M2PO",
    "OPSM",
    "TIS",
    "BatchInputs",
    "BatchTerms",
    "Correction",
    "DeviceMetrics",
    "GeoMask",
    "GroupStats",
    "IcePop",
    "M2POResult",
    "MetricSums",
    "Metrics",
    "ObjectiveConfig",
    "ObjectiveInputs",
    "PreparedBatch",
    "TokenLoss",
    "TokenMask",
    "Veto",
    "aggregate",
    "batch_terms",
    "cispo_loss",
    "combine_metrics",
    "compute_advantages",
    "dr_grpo_advantages",
    "effective_sample_size",
    "geo_mask",
    "global_denominator",
    "group_stats",
    "grpo_advantages",
    "gspo_loss",
    "host_metrics",
    "icepop_weights",
    "kl_estimate",
    "m2po_mask",
    "minibatch",
    "mismatch_kl",
    "nonfinite",
    "opsm_mask",
    "policy_loss",
    "ppo_loss",
    "prepare",
    "prepare_rows",
    "proximal_is_current_loss",
    "proximal_is_current_metrics",
    "quantiles",
    "ratio_stats",
    "reinforce_loss",
    "rloo_advantages",
    "sapo_loss",
    "sequence_log_ratio",
    "staleness_stats",
    "sum_metrics",
    "tis_sequence_weights",
    "tis_token_truncated",
    "tis_token_weights",
    "token_mask",
    "valid_counts",
    "version_span",
    "veto_mask",
    "whiten_advantages",
    "whole_batch_terms",
]

"""labrl.envs.cascade: rewards as a cascade of stages of rising cost, unbiased and within a budget.

The contract (``stages``), the estimator (``estimator``), the ``cascade:`` section (``config``),
the budget ledger (``ledger``), the env base (``env``), the group context of top-k rules
(``group``), the learnt control variate (``baseline``) and the synthetic env (``synthetic``). Guide: docs/rewards-that-cost-money.md.
"""

from labrl.envs.cascade.baseline import NearestTruths
from labrl.envs.cascade.config import CascadeSection, ControlVariate, StageBudget
from labrl.envs.cascade.env import CascadeEnv, audit_uniform, stage_key
from labrl.envs.cascade.estimator import audited_proxy_variance, cascade_reward, conditional_variance
from labrl.envs.cascade.group import GroupGate
from labrl.envs.cascade.ledger import BudgetLedger, MemoryLedger, SqliteLedger
from labrl.envs.cascade.stages import (
    CascadeRecord,
    CostUnit,
    Informative,
    Latency,
    Stage,
    StageRecord,
    Threshold,
    TopK,
)

__all__ = [
    "BudgetLedger",
    "CascadeEnv",
    "CascadeRecord",
    "CascadeSection",
    "ControlVariate",
    "CostUnit",
    "GroupGate",
    "Informative",
    "Latency",
    "MemoryLedger",
    "NearestTruths",
    "SqliteLedger",
    "Stage",
    "StageBudget",
    "StageRecord",
    "Threshold",
    "TopK",
    "audit_uniform",
    "audited_proxy_variance",
    "cascade_reward",
    "conditional_variance",
    "stage_key",
]

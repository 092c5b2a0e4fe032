"""labrl.envs: the async Env contract, registry, checker and built-in envs."""

from labrl.envs.types import (
    Action,
    Budgets,
    EnvSpec,
    Message,
    Observation,
    Outcome,
    StepResult,
    Task,
    ToolCall,
    ToolSpec,
)

__all__ = [
    "Action",
    "Budgets",
    "EnvSpec",
    "Message",
    "Observation",
    "Outcome",
    "StepResult",
    "Task",
    "ToolCall",
    "ToolSpec",
]

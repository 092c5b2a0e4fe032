"""labrl.envs: the async Env contract, registry, checker and built-in envs.

::

    from labrl.envs import make, run_episode
    env = make("xrd/phase-id-v0")
    task = env.make_task("train", seed=0)
    episode = await run_episode(env, task, policy)   # policy: async (messages, tools) -> text
"""

from labrl.envs.actions import format_tool_call, parse_action
from labrl.envs.base import Env
from labrl.envs.budgets import BudgetedEnv
from labrl.envs.checker import CheckReport, check_env, check_env_async
from labrl.envs.episode import Episode, EpisodeTruncated, Policy, Turn, run_episode, scripted_policy
from labrl.envs.registry import deregister, load_plugins, make, register, registered_ids, spec
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
from labrl.offload import run_cpu, run_killable

__all__ = [
    "Action",
    "BudgetedEnv",
    "Budgets",
    "CheckReport",
    "Env",
    "EnvSpec",
    "Episode",
    "EpisodeTruncated",
    "Message",
    "Observation",
    "Outcome",
    "Policy",
    "StepResult",
    "Task",
    "ToolCall",
    "ToolSpec",
    "Turn",
    "check_env",
    "check_env_async",
    "deregister",
    "format_tool_call",
    "load_plugins",
    "make",
    "parse_action",
    "register",
    "registered_ids",
    "run_cpu",
    "run_episode",
    "run_killable",
    "scripted_policy",
    "spec",
]

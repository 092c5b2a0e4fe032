"""labrl.envs.xrd: XRD phase identification (single turn and with tools)."""

from labrl.envs.xrd.env import PhaseIdEnv, PhaseIdToolsEnv
from labrl.envs.xrd.tasks import PhaseIdConfig

__all__ = ["PhaseIdConfig", "PhaseIdEnv", "PhaseIdToolsEnv"]

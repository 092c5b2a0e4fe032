"""labrl.envs.xrd: XRD phase identification (single turn and with tools)."""

from labrl.envs.xrd.env import PhaseIdEnv, PhaseIdEnvV1, PhaseIdToolsEnv, PhaseIdToolsEnvV1
from labrl.envs.xrd.tasks import PhaseIdConfig

__all__ = ["PhaseIdConfig", "PhaseIdEnv", "PhaseIdEnvV1", "PhaseIdToolsEnv", "PhaseIdToolsEnvV1"]

"""Lab environments: experiments run on an (autonomous or mock) lab through ``labrl.lab_adapters``."""

from labrl.envs.lab.synthesis import SynthesisEnv, SynthesisMultiTurnEnv

__all__ = ["SynthesisEnv", "SynthesisMultiTurnEnv"]

"""Model presets and megatron-core model construction (CPU and GPU)."""

from labrl.harness.models.build import (
    CausalInputs,
    build_gpt_model,
    causal_attention_mask,
    count_parameters,
    ensure_model_parallel,
)
from labrl.harness.models.config import PRESETS, MoEModelConfig, ParallelConfig, Precision, get_preset

__all__ = [
    "PRESETS",
    "CausalInputs",
    "MoEModelConfig",
    "ParallelConfig",
    "Precision",
    "build_gpt_model",
    "causal_attention_mask",
    "count_parameters",
    "ensure_model_parallel",
    "get_preset",
]

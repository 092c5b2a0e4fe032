"""Samplers: inference engines the harness generates from (``labrl.harness.types.Sampler``)."""

from labrl.harness.samplers.local import LocalSampler, LocalSamplerConfig

__all__ = ["LocalSampler", "LocalSamplerConfig"]

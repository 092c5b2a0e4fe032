"""What a run's ``auto`` and mode-derived config keys resolve to: resolved once, written beside config.yaml.

``config.yaml`` keeps the config as written (``learner.precision: auto``,
``pipeline.max_staleness: 4`` under ``mode: sync``); ``effective.json`` says
what acts, keyed by the config key it resolves:

================================  =========================================================
key                               resolves to
================================  =========================================================
``pipeline.max_staleness``        ``sync``: 0, ``one_step_off``: 1, ``pipeline``: as written
``learner.device``                ``auto``: ``cuda:<current>`` where the learner sees CUDA, else ``cpu``
``learner.precision``             ``auto``: ``bf16`` on CUDA from 100M parameters, else ``fp32``
``sampler.local.device``          as ``learner.device``, for the sampler (``sampler.kind: local``)
``sampler.local.precision``       as ``learner.precision``, for the sampler (``sampler.kind: local``)
``sampler.sglang.export_dtype``   ``auto``: the learner's dtype (``sampler.kind: sglang``)
================================  =========================================================

The rules are the components' own (``PipelineSection.effective_max_staleness``,
``labrl.harness.models.device.resolve_device`` and ``param_dtype``); this module
only applies them to a run. Under ``backend: ray`` the learner and the samplers
run in actors that see CUDA exactly when they were given GPUs
(``ray.learner_gpus``, ``ray.gpus_per_sampler``: Ray hides the others), so
``auto`` resolves for the actor, not for the machine running ``labrl train``.
Resume compares the recorded ``learner.precision`` with this run's
(``labrl.harness.pipeline.resume``): a changed ``auto`` never switches a
checkpoint's dtype silently.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labrl.errors import ConfigError
from labrl.harness.config import RunConfig
from labrl.harness.models import device as dev

EFFECTIVE_FILE = "effective.json"

PrecisionName = Literal["fp32", "bf16"]


class EffectiveValues(BaseModel):
    """The resolved values of one run (``effective.json``; the aliases are the config keys)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True, validate_by_alias=True)

    max_staleness: int = Field(alias="pipeline.max_staleness", ge=0)
    learner_device: str = Field(alias="learner.device")
    learner_precision: PrecisionName = Field(alias="learner.precision")
    sampler_device: str | None = Field(default=None, alias="sampler.local.device")
    sampler_precision: PrecisionName | None = Field(default=None, alias="sampler.local.precision")
    export_dtype: str | None = Field(default=None, alias="sampler.sglang.export_dtype")

    def as_config_keys(self) -> dict[str, Any]:
        """``{config key: resolved value}``, the keys of the sampler kind not in use left out."""
        return self.model_dump(by_alias=True, exclude_none=True)


def _seen_by(caps: dev.Capabilities, gpus: float, cfg: RunConfig) -> dev.Capabilities:
    """The capabilities a component sees: a Ray actor sees CUDA only with GPUs of its own (device 0)."""
    if cfg.backend != "ray":
        return caps
    return dataclasses.replace(caps, cuda=gpus > 0, cuda_index=0)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 -> bfloat16, as export_dtype spells it


def effective_values(cfg: RunConfig, caps: dev.Capabilities | None = None) -> EffectiveValues:
    """Resolve every ``auto`` and mode-derived key of ``cfg`` (table in the module docstring).

    ``caps``: the machine's capabilities (``detect_capabilities()`` when None;
    tests pass fakes). A device that is not there (``cuda`` without CUDA) is a
    ``ConfigError``, raised here before anything is written.
    """
    caps = caps if caps is not None else dev.detect_capabilities()
    learner_device = dev.resolve_device(cfg.learner.device, _seen_by(caps, cfg.ray.learner_gpus, cfg))
    parameters = cfg.model.resolve().parameter_count
    learner_dtype = dev.param_dtype(cfg.learner.precision, learner_device, parameters=parameters)
    values: dict[str, Any] = {
        "max_staleness": cfg.pipeline.effective_max_staleness,
        "learner_device": str(learner_device),
        "learner_precision": dev.precision_name(learner_dtype),
    }
    if cfg.sampler.kind == "local":
        local = cfg.sampler.local
        sampler_device = dev.resolve_device(local.device, _seen_by(caps, cfg.ray.gpus_per_sampler, cfg))
        values["sampler_device"] = str(sampler_device)
        sampler_dtype = dev.param_dtype(local.precision, sampler_device, parameters=parameters)
        values["sampler_precision"] = dev.precision_name(sampler_dtype)
    else:
        written = cfg.sampler.sglang.export_dtype
        values["export_dtype"] = _dtype_name(learner_dtype) if written == "auto" else written
    return EffectiveValues.model_validate(values)


def write_effective(run_dir: str | Path, values: EffectiveValues) -> Path:
    """Write ``run_dir/effective.json``; returns its path."""
    path = Path(run_dir) / EFFECTIVE_FILE
    path.write_text(json.dumps(values.as_config_keys(), indent=2) + "\n")
    return path


def read_effective(run_dir: str | Path) -> EffectiveValues | None:
    """The values a run directory's last run resolved (``effective.json``); None if it has none."""
    path = Path(run_dir) / EFFECTIVE_FILE
    if not path.is_file():
        return None
    try:
        return EffectiveValues.model_validate(json.loads(path.read_text()))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise ConfigError(
            f"{path} (the resolved values of the run being resumed) is unreadable: {exc}; "
            "restore it, or train into a new run_dir"
        ) from None

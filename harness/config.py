"""The typed run config of ``labrl train``: one YAML file plus dotted overrides.

::

    cfg = load_run_config("configs/quickstart.yaml", ["pipeline.max_staleness=4", "seed=1"])

Sections: ``env`` (id + constructor options), ``model`` (a preset name, with
optional field overrides), ``sampler`` (local | sglang), ``learner`` (optimizer,
micro-batch, router replay), ``objective`` (``labrl.harness.objectives.ObjectiveConfig``),
``pipeline`` (mode, batch, staleness, concurrency, overlong handling, eval,
checkpoints), ``sft`` (format-only warm start), ``seed``, ``run_dir``.

Override values are parsed as YAML scalars (``lr=3e-4`` is a float,
``objective.corrections=[m2po]`` a list). Any unknown key, in the file or in
an override, is a ``ConfigError`` naming the dotted key and the closest known
key (``pipeline.max_stalness: unknown key; did you mean pipeline.max_staleness?``).
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from labrl.errors import ConfigError
from labrl.harness.learners.config import ReferenceKind, check_reference
from labrl.harness.models.config import MoEModelConfig, Precision, get_preset
from labrl.harness.objectives import ObjectiveConfig

Mode = Literal["sync", "one_step_off", "pipeline"]
OverlongMode = Literal["score", "filter", "force"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvSection(_Section):
    id: str = Field(description="registered env id, e.g. xrd/phase-id-v0")
    options: dict[str, Any] = Field(
        default_factory=dict, description="constructor overrides for labrl.envs.make"
    )
    budgets: dict[str, Any] = Field(
        default_factory=dict, description="Budgets overrides (timeouts, max_turns)"
    )


class ModelSection(_Section):
    preset: str = "tiny-moe"
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="MoEModelConfig fields changed from the preset"
    )
    init_from_hf: str | None = Field(
        default=None,
        description="start from a Hugging Face MoE checkpoint directory (Qwen3-MoE or Mixtral layout): "
        "the shape comes from its config.json (replacing the preset), the tokenizer from its tokenizer files, "
        "and its weights are loaded before the warm start",
    )

    def resolve(self) -> MoEModelConfig:
        if self.init_from_hf is not None:
            from labrl.harness.hf_import import config_from_hf

            path = Path(self.init_from_hf)
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"model.init_from_hf={self.init_from_hf!r}: no config.json in that directory"
                )
            base = config_from_hf(path)
        else:
            base = get_preset(self.preset)
        if not self.overrides:
            return base
        try:
            return MoEModelConfig.model_validate(base.model_dump() | self.overrides)
        except ValidationError as exc:
            raise ConfigError(
                describe_validation_error(exc, MoEModelConfig, prefix="model.overrides")
            ) from None


class SamplerSection(_Section):
    kind: Literal["local", "sglang"] = "local"
    precision: Precision = "fp32"
    max_batch_size: int = Field(default=64, ge=1)
    batch_wait_s: float = Field(default=0.005, ge=0.0)
    urls: list[str] = Field(default_factory=list, description="SGLang server base URLs (kind=sglang)")
    weights_dir: str | None = Field(default=None, description="where HF checkpoints for SGLang are written")
    temperature: float = Field(default=1.0, gt=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=32, ge=1)

    @model_validator(mode="after")
    def _urls(self) -> SamplerSection:
        if self.kind == "sglang" and not self.urls:
            raise ValueError("sampler.kind=sglang needs sampler.urls (e.g. [http://127.0.0.1:30000])")
        return self


class LearnerSection(_Section):
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    grad_clip: float | None = Field(default=1.0, gt=0)
    micro_batch_size: int = Field(default=16, ge=1)
    router_replay: bool = True
    precision: Precision = "fp32"
    reference: ReferenceKind = Field(
        default="none",
        description="reference policy of objective.kl_coef: none | initial (weights frozen when RL starts)",
    )


class OverlongSection(_Section):
    """What to do with a generation that hit ``max_new_tokens`` (finish_reason ``length``).

    - ``score``: score it as it is;
    - ``filter``: keep its reward in the group statistics but mask its tokens
      from the loss (DAPO overlong filtering);
    - ``force``: append ``cue`` (an end-of-thinking marker) and let the model
      answer in ``answer_tokens`` more tokens (ScaleRL interruptions); the cue
      tokens are not trained on.

    ``penalty_tokens`` > 0 adds DAPO's soft length penalty to trainable
    rewards: ``r += clip(((L_max - c) - L) / c, -penalty, 0)`` with ``c =
    penalty_tokens`` and ``L`` the number of generated tokens.
    """

    mode: OverlongMode = "score"
    cue: str = "\nANSWER:"
    answer_tokens: int = Field(default=16, ge=1)
    penalty_tokens: int = Field(default=0, ge=0)
    penalty: float = Field(default=1.0, ge=0.0)


class PipelineSection(_Section):
    mode: Mode = "pipeline"
    batch_groups: int = Field(default=8, ge=1, description="groups (tasks) per learner step")
    group_size: int = Field(default=8, ge=2, description="G: rollouts per task")
    max_staleness: int = Field(default=4, ge=0, description="admission bound on learner-version lag")
    max_concurrent_episodes: int = Field(default=256, ge=1)
    total_steps: int = Field(default=100, ge=1)
    dynamic_sampling: bool = Field(default=True, description="drop zero-variance groups and oversample")
    max_oversample_factor: float = Field(
        default=8.0, ge=1.0, description="stop if more than this many groups per needed group were dropped"
    )
    overlong: OverlongSection = Field(default_factory=OverlongSection)
    eval_every: int = Field(default=10, ge=0, description="0 disables periodic evaluation")
    eval_size: int = Field(default=64, ge=1, description="test-split tasks per evaluation")
    eval_temperature: float = Field(default=0.0, ge=0.0)
    checkpoint_every: int = Field(default=0, ge=0, description="0: only at the end and on shutdown")
    torch_threads: int = Field(
        default=1, ge=1, description="intra-op threads for each of learner and sampler"
    )
    progress: bool = True

    @model_validator(mode="after")
    def _fit(self) -> PipelineSection:
        if self.group_size > self.max_concurrent_episodes:
            raise ValueError(
                f"pipeline.group_size={self.group_size} exceeds pipeline.max_concurrent_episodes="
                f"{self.max_concurrent_episodes}: a group's episodes run at once; raise max_concurrent_episodes"
            )
        return self


class SFTSection(_Section):
    """Format-only supervised warm start: targets are the env's *random* on-format actions, never gold."""

    enabled: bool = False
    steps: int = Field(default=100, ge=1)
    batch_size: int = Field(default=16, ge=1)
    lr: float = Field(default=1e-3, gt=0)
    num_prompts: int = Field(default=256, ge=1, description="distinct train prompts to cycle through")


class RunConfig(_Section):
    env: EnvSection
    model: ModelSection = Field(default_factory=ModelSection)
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    seed: int = 0
    run_dir: str = "runs/default"

    @model_validator(mode="after")
    def _reference_matches_kl(self) -> RunConfig:
        check_reference(self.learner.reference, self.objective.kl_coef, prefix="learner.")
        return self


# -- loading ---------------------------------------------------------------------


def _model_fields(
    model: type[BaseModel] | None, loc: tuple[Any, ...]
) -> tuple[type[BaseModel] | None, list[str]]:
    """Walk ``loc`` through nested pydantic models; the innermost model and its field names."""
    current = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None, []
        annotation = current.model_fields[part].annotation
        current = next(
            (
                a
                for a in (annotation, *typing.get_args(annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
    return current, list(current.model_fields) if current is not None else []


def describe_validation_error(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    """One message naming every bad dotted key; unknown keys get a did-you-mean."""
    parts = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc)
        if err["type"] == "extra_forbidden":
            _, known = _model_fields(root, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
            parent = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc[:-1])
            hint = f"; did you mean {parent + '.' if parent else ''}{close[0]}?" if close else ""
            parts.append(f"{key}: unknown key{hint} (known: {', '.join(known)})")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{key}: {msg}" if key else msg)
    return "invalid run config: " + "; ".join(parts)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b=value'`` -> (['a', 'b'], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {exc}") from None
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    out = dict(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(path[: i + 1])} is a value, not a section")
            node[part] = child = dict(child)
            node = child
        node[path[-1]] = value
    return out


def build_run_config(data: dict[str, Any]) -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"run config must be a mapping, got {type(data).__name__}")
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, RunConfig)) from None


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping at the top level")
    return build_run_config(apply_overrides(data, overrides or []))


def dump_run_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

"""The typed run config of ``labrl train``: one YAML file plus dotted overrides.

::

    cfg = load_run_config("configs/quickstart.yaml", ["pipeline.max_staleness=4", "seed=1"])

The run config is composed of the components' own config classes (each
component owns one pydantic class; a section is that class, or that class
minus the fields another section sets, generated from it so that a field added
to the component is reachable here without edits):

- ``env`` (id + constructor options), ``model`` (a preset, field overrides of
  ``MoEModelConfig``, or ``init_from_hf``), ``parallel`` (``ParallelConfig``:
  TP/PP/EP sizes of the learner);
- ``learner``: ``LearnerConfig`` without model/parallel/objective/temperature/seed
  (``learner.optimizer`` is ``OptimizerConfig``);
- ``sampler``: ``kind``, sampling parameters, ``local`` (``LocalSamplerConfig``
  without seed/pad_token_id) and ``sglang`` (``SGLangSamplerConfig`` without the
  model shape);
- ``objective`` (``ObjectiveConfig``), ``pipeline`` (``PipelineSection`` of
  ``labrl.harness.pipeline.config``, with ``overlong``, ``OverlongSection`` of
  ``labrl.harness.pipeline.overlong``), ``sft`` (``SFTSection`` of
  ``labrl.harness.rollout.sft``: the format-only warm start), ``seed``, ``run_dir``,
  ``backend`` and ``ray`` (``RaySection``), ``cascade`` (``CascadeSection`` of
  ``labrl.envs.cascade.config``: a cascade env's budgets and audits, handed to the env as its
  ``cascade`` option).

``component_configs`` is the one mapping from a run config to the component
configs; ``labrl.harness.effective.effective_values`` says what its ``auto`` and
mode-derived keys resolve to. Fields marked ``IDENTITY``
(``labrl.harness.identity``) identify a run for resume. Reference:
docs/configuration.md.

Override values are parsed as YAML scalars (``lr=3e-4`` is a float,
``objective.corrections=[m2po]`` a list). Any unknown key, in the file or in
an override, is a ``ConfigError`` naming the dotted key and the closest known
key (``pipeline.max_stalness: unknown key; did you mean pipeline.max_staleness?``).
"""

from __future__ import annotations

import copy
import difflib
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from labrl.envs.cascade.config import CascadeSection
from labrl.errors import ConfigError
from labrl.harness.backends.ray.config import RaySection
from labrl.harness.identity import IDENTITY
from labrl.harness.learners.config import LearnerConfig, check_reference
from labrl.harness.models.config import MoEModelConfig, ParallelConfig, get_preset
from labrl.harness.objectives import ObjectiveConfig
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.rollout.sft import SFTSection
from labrl.harness.samplers.local import LocalSamplerConfig
from labrl.harness.samplers.sglang.sampler import MODEL_SHAPE_FIELDS, SGLangSamplerConfig, served_model_shape
from labrl.harness.types import SamplingParams

Backend = Literal["inprocess", "ray"]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EnvSection(_Section):
    id: str = Field(description="registered env id, e.g. xrd/phase-id-v0", json_schema_extra=IDENTITY)
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="constructor overrides for labrl.envs.make",
        json_schema_extra=IDENTITY,
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
        json_schema_extra=IDENTITY,
    )

    def resolve(self) -> MoEModelConfig:
        if self.init_from_hf is not None:
            from labrl.harness.models.hf_import import config_from_hf

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


def component_section(
    component: type[BaseModel],
    name: str,
    *,
    derived: frozenset[str] = frozenset(),
    replace: dict[str, tuple[Any, Any]] | None = None,
) -> type[BaseModel]:
    """A run-config section made of ``component``'s own fields, minus those another section sets.

    The section is generated from the component's ``model_fields``, so a field
    added to the component class is reachable from YAML and overrides without
    touching this module. ``derived`` names the fields the run fills in from
    other sections (``component_configs`` says from which); ``replace`` swaps a
    field's (annotation, FieldInfo), e.g. to make a field that the component
    requires optional in a section that may go unused.
    """
    fields: dict[str, Any] = {
        field: (info.annotation, copy.deepcopy(info))
        for field, info in component.model_fields.items()
        if field not in derived
    }
    unknown = set(derived | set(replace or {})) - set(component.model_fields)
    if unknown:
        raise TypeError(f"{component.__name__} has no fields {sorted(unknown)}")
    fields.update(replace or {})
    return create_model(
        name,
        __base__=_Section,
        __module__=__name__,
        __doc__=f"``{component.__module__}.{component.__name__}`` without {sorted(derived) or 'nothing'} "
        "(set from other sections).",
        **fields,
    )


# Fields of each component that the run sets from another section (one source each):
LEARNER_DERIVED = frozenset({"model", "parallel", "objective", "temperature", "seed"})
LOCAL_SAMPLER_DERIVED = frozenset({"seed", "pad_token_id"})
SGLANG_SAMPLER_DERIVED = frozenset(MODEL_SHAPE_FIELDS)

if typing.TYPE_CHECKING:
    # A generated section has its component's fields (minus the derived ones): the type checker reads it
    # as the component, so ``cfg.learner.precision`` is checked against ``LearnerConfig``.
    LearnerSection = LearnerConfig
    LocalSamplerSection = LocalSamplerConfig
    SGLangSamplerSection = SGLangSamplerConfig
else:
    LearnerSection = component_section(LearnerConfig, "LearnerSection", derived=LEARNER_DERIVED)
    LocalSamplerSection = component_section(
        LocalSamplerConfig, "LocalSamplerSection", derived=LOCAL_SAMPLER_DERIVED
    )
    SGLangSamplerSection = component_section(
        SGLangSamplerConfig,
        "SGLangSamplerSection",
        derived=SGLANG_SAMPLER_DERIVED,
        replace={
            "urls": (
                tuple[str, ...],
                Field(
                    default=(),
                    description="SGLang server base URLs, e.g. http://10.0.0.5:30000 (kind=sglang)",
                ),
            )
        },
    )


class SamplerSection(_Section):
    """Which sampler runs (``kind``), its config (``local`` or ``sglang``), and the sampling parameters."""

    kind: Literal["local", "sglang"] = "local"
    local: LocalSamplerSection = Field(default_factory=LocalSamplerSection)
    sglang: SGLangSamplerSection = Field(default_factory=SGLangSamplerSection)
    temperature: float = Field(default=1.0, gt=0.0, description="also the learner's logits temperature")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=32, ge=1)

    @model_validator(mode="after")
    def _urls(self) -> SamplerSection:
        if self.kind == "sglang" and not self.sglang.urls:
            raise ValueError("sampler.kind=sglang needs sampler.sglang.urls (e.g. [http://127.0.0.1:30000])")
        return self


class RunConfig(_Section):
    env: EnvSection
    model: ModelSection = Field(default_factory=ModelSection)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, json_schema_extra=IDENTITY)
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    learner: LearnerSection = Field(default_factory=LearnerSection)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    pipeline: PipelineSection = Field(default_factory=PipelineSection)
    sft: SFTSection = Field(default_factory=SFTSection)
    seed: int = Field(default=0, json_schema_extra=IDENTITY)
    run_dir: str = Field(
        default="runs/default",
        min_length=1,
        description="where config.yaml, metrics, checkpoints and summary.json are written",
    )
    backend: Backend = Field(
        default="inprocess", description="inprocess: one process; ray: actors on a Ray cluster (docs/ray.md)"
    )
    ray: RaySection = Field(default_factory=RaySection)
    cascade: CascadeSection | None = Field(
        default=None,
        description="budgets and audits of a cascade env's reward stages (docs/rewards-that-cost-money.md)",
    )

    @model_validator(mode="after")
    def _finite_and_consistent(self) -> RunConfig:
        bad = non_finite_keys(self)  # first: the checks below compare numbers
        if bad:
            raise ValueError(
                "every number of a run config must be finite: "
                + ", ".join(f"{key}={value}" for key, value in bad)
            )
        if not self.run_dir.strip():
            raise ValueError("run_dir is empty: name a directory (e.g. runs/my-run)")
        check_reference(self.learner.reference, self.objective.kl_coef, prefix="learner.")
        return self

    @model_validator(mode="after")
    def _sglang_servers_per_sampler_actor(self) -> RunConfig:
        urls = self.sampler.sglang.urls
        if self.backend == "ray" and self.sampler.kind == "sglang" and self.ray.samplers > len(urls):
            raise ValueError(
                f"ray.samplers={self.ray.samplers} sampler actors front {len(urls)} SGLang server(s): "
                "each actor needs at least one of sampler.sglang.urls"
            )
        return self


def non_finite_keys(model: BaseModel, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float field that is NaN or infinite, nested configs and lists walked.

    One rule for every component: no config field of labrl means anything at inf or NaN
    (``learner.optimizer.lr=.inf`` used to be accepted and crash step 1). Free-form dicts
    (``env.options``) belong to their env and are not walked.
    """
    out: list[tuple[str, float]] = []

    def visit(value: Any, key: str) -> None:
        if isinstance(value, BaseModel):
            out.extend(non_finite_keys(value, key + "."))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                visit(item, f"{key}[{i}]")
        elif isinstance(value, float) and not math.isfinite(value):
            out.append((key, value))

    for name in type(model).model_fields:
        visit(getattr(model, name), prefix + name)
    return out


def learnability_warnings(cfg: RunConfig) -> list[str]:
    """Why a valid config is unlikely to learn, one sentence each (``labrl train`` prints them).

    A from-scratch model (no ``model.init_from_hf``) without the format-only warm
    start samples random bytes: it almost never produces a well-formed answer,
    so every group is all-wrong, carries no GRPO signal and is dropped until the
    stall guard stops the run.
    """
    out = []
    if cfg.model.init_from_hf is None and not cfg.sft.enabled:
        out.append(
            "sft.enabled=false with a from-scratch model (no model.init_from_hf): the policy starts as "
            "random bytes and will rarely produce a well-formed answer, so groups are all-wrong and "
            "dropped and the run will likely stall; set sft.enabled=true (format-only warm start, "
            "as configs/quickstart.yaml does) or start from a pretrained model.init_from_hf"
        )
    return out


# -- the component configs of a run ------------------------------------------------


@dataclass(frozen=True)
class ComponentConfigs:
    """What the run builds its learner, sampler and requests from: the one mapping from a RunConfig."""

    model: MoEModelConfig
    learner: LearnerConfig
    sampler: LocalSamplerConfig | SGLangSamplerConfig
    sampling: SamplingParams


def _fields(section: BaseModel) -> dict[str, Any]:
    """A section's field values as objects (nested configs stay models, unlike ``model_dump``)."""
    return {name: getattr(section, name) for name in type(section).model_fields}


def _component(cls: type[BaseModel], prefix: str, values: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, cls, prefix=prefix)) from None


def component_configs(cfg: RunConfig, *, model: MoEModelConfig, pad_token_id: int) -> ComponentConfigs:
    """Compose each component's config from its section plus the fields other sections own.

    Derived fields: the learner's ``model`` (``model``), ``parallel``, ``objective``,
    ``temperature`` (``sampler.temperature``: the learner recomputes the sampler's
    log-probs) and ``seed``; the local sampler's ``seed`` and ``pad_token_id``
    (the tokenizer's); the SGLang sampler's ``num_hidden_layers``, ``moe_layers``
    and ``topk`` (the model's shape). ``model`` is ``cfg.model.resolve()`` in a
    run; pure validation, nothing heavy is built.
    """
    learner = _component(
        LearnerConfig,
        "learner",
        _fields(cfg.learner)
        | {
            "model": model,
            "parallel": cfg.parallel,
            "objective": cfg.objective,
            "temperature": cfg.sampler.temperature,
            "seed": cfg.seed,
        },
    )
    sampler: LocalSamplerConfig | SGLangSamplerConfig
    if cfg.sampler.kind == "local":
        sampler = _component(
            LocalSamplerConfig,
            "sampler.local",
            _fields(cfg.sampler.local) | {"seed": cfg.seed, "pad_token_id": pad_token_id},
        )
    else:
        sampler = _component(
            SGLangSamplerConfig,
            "sampler.sglang",
            _fields(cfg.sampler.sglang) | served_model_shape(model),
        )
    sampling = SamplingParams(
        max_new_tokens=cfg.sampler.max_new_tokens,
        temperature=cfg.sampler.temperature,
        top_p=cfg.sampler.top_p,
    )
    return ComponentConfigs(model=model, learner=learner, sampler=sampler, sampling=sampling)


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


def _nested_key(section: type[BaseModel] | None, name: str) -> str | None:
    """The dotted key of a field called ``name`` in a subsection of ``section`` (``lr`` in ``learner`` ->
    ``optimizer.lr``): where a key of that name lives one section further down, if anywhere."""
    if section is None:
        return None
    for field in section.model_fields:
        sub, known = _model_fields(section, (field,))
        if sub is None:
            continue
        if name in known:
            return f"{field}.{name}"
        deeper = _nested_key(sub, name)
        if deeper is not None:
            return f"{field}.{deeper}"
    return None


def describe_validation_error(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> str:
    """One message naming every bad dotted key.

    An unknown key gets a did-you-mean: the same name in a subsection (``learner.lr`` ->
    ``learner.optimizer.lr``), else the closest sibling (``pipeline.max_stalness`` ->
    ``pipeline.max_staleness``).
    """
    parts = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in ((prefix,) if prefix else ()) + loc)
        if err["type"] == "extra_forbidden":
            section, known = _model_fields(root, loc[:-1])
            nested = _nested_key(section, str(loc[-1]))
            close = [nested] if nested else difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.5)
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

"""The one typed config that composes an objective.

Defaults come from what peers ship (sources per default in docs/objectives.md, "Configure"):

- ``loss="cispo"`` with ``eps_low=1.0, eps_high=0.28`` (MiniMax-M1 sets no lower
  bound on the weight; ScaleRL's recipe is CISPO); ``ppo`` defaults to DAPO's
  clip-higher ``0.2 / 0.28``; ``gspo`` to ``3e-4 / 4e-4``.
- ``corrections=[tis(c=2)]``: token-level TIS with cap 2 (slime, verl, SkyRL,
  open-instruct). Sequence-level TIS defaults to cap 5.
- token mask ``[0.5, 5]`` (INTELLECT-3), IcePop ``[0.5, 5]`` (the IcePop
  paper's alpha / beta; masks like the token mask AND weights the kept tokens
  by the ratio), geometric sequence mask ``[0.99, 1.01]`` (SkyRL), veto floor
  ``1e-4`` (slime), M2PO ``tau=0.04``, OPSM ``delta=1e-4``.
- ``dual_clip_c=None`` (off; 3 is the usual value), SAPO ``tau_pos=1.0,
  tau_neg=1.05`` (arXiv 2511.20347), ``k3_clamped`` clamps the k3 reference KL
  to ``[-10, 10]`` like verl's ``low_var_kl``.

Every new option defaults to off, so a config that names none of them trains
exactly as before.

Built from Python (``ObjectiveConfig(loss="ppo", corrections=[TIS(c=2), M2PO()])``)
or from a plain dict / YAML (``{"loss": "cispo", "corrections": [{"kind": "tis",
"c": 2.0}]}``; a bare ``"m2po"`` string means the correction with its defaults).
``ObjectiveConfig.from_dict`` / ``from_yaml`` turn pydantic's validation error
into a ``ConfigError`` whose message names every bad field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from labrl.errors import ConfigError
from labrl.harness.identity import IDENTITY

LossKind = Literal["reinforce", "ppo", "cispo", "gspo", "sapo"]
AdvantageKind = Literal["grpo", "dr_grpo", "rloo", "whiten"]
AggregationKind = Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"]
KLEstimator = Literal["k1", "k2", "k3", "k3_clamped"]

# (eps_low, eps_high) per loss; reinforce has no clip.
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "ppo": (0.2, 0.28),
    "cispo": (1.0, 0.28),
    "gspo": (3e-4, 4e-4),
}
DEFAULT_TIS_CAP = {"token": 2.0, "sequence": 5.0}


class _Correction(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @property
    def name(self) -> str:
        """Metric prefix; unique within one config."""
        return str(getattr(self, "kind"))  # noqa: B009 - every subclass defines kind


class _BandCorrection(_Correction):
    """A correction that keeps what has its ratio in ``[low, high]``; the band must hold 1.

    Subclasses declare ``kind``, ``low`` and ``high`` themselves, so the fields keep
    that order in a written config.
    """

    if TYPE_CHECKING:
        low: float
        high: float

    @model_validator(mode="after")
    def _band(self) -> Self:
        # A band that excludes 1 would mask perfectly on-policy tokens.
        if not (self.low <= 1.0 <= self.high):
            raise ValueError(
                f"{self.name} needs low <= 1 <= high so on-policy tokens are kept "
                f"(got low={self.low}, high={self.high})"
            )
        return self


class TIS(_Correction):
    """Truncated importance sampling: weight = min(w, c), stop-gradient.

    ``level="token"``: ``w_t = exp(logp_old_t - logp_mu_t)``;
    ``level="sequence"``: ``w_i = exp(sum_t (logp_old_t - logp_mu_t))``, one weight per sequence.
    """

    kind: Literal["tis"] = "tis"
    level: Literal["token", "sequence"] = "token"
    c: float = Field(ge=1.0, description="cap; default 2 (token) or 5 (sequence)")

    @model_validator(mode="before")
    @classmethod
    def _default_cap(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("c") is None:
            level = data.get("level", "token")
            if level in DEFAULT_TIS_CAP:
                data = {**data, "c": DEFAULT_TIS_CAP[level]}
        return data

    @property
    def name(self) -> str:
        return f"tis_{self.level}"


class TokenMask(_BandCorrection):
    """Token mask ("MIS"): drop tokens with ``w_t`` outside ``[low, high]``; kept tokens keep weight 1."""

    kind: Literal["token_mask"] = "token_mask"
    low: float = Field(default=0.5, gt=0.0)
    high: float = Field(default=5.0, gt=0.0)


class IcePop(_BandCorrection):
    """IcePop (Ring-1T): ``weight_t = w_t`` if ``low <= w_t <= high`` else 0 (stop-gradient).

    Unlike ``TokenMask`` the kept tokens are importance-weighted by the
    train/inference ratio, without truncation. ``low = 1 / beta, high = beta``
    gives the symmetric band ``[1/beta, beta]``; the defaults are the paper's
    ``alpha = 0.5, beta = 5``.
    """

    kind: Literal["icepop"] = "icepop"
    low: float = Field(default=0.5, gt=0.0)
    high: float = Field(default=5.0, gt=0.0)


class OPSM(_Correction):
    """Off-policy sequence masking (DeepSeek-V3.2): drop sequence ``i`` when ``A_i < 0`` and
    ``mean_{t in i} (logp_mu_t - logp_t) > delta``, ``logp`` the CURRENT policy (recomputed at every
    optimizer step of the batch, not fixed at batch start)."""

    kind: Literal["opsm"] = "opsm"
    delta: float = Field(default=1e-4, ge=0.0, description="per-token KL(mu || pi) threshold")


class GeoMask(_BandCorrection):
    """Geometric sequence mask: drop a sequence if ``exp(mean_t log w_t)`` is outside ``[low, high]``."""

    kind: Literal["geo_mask"] = "geo_mask"
    low: float = Field(default=0.99, gt=0.0)
    high: float = Field(default=1.01, gt=0.0)


class Veto(_Correction):
    """Drop a whole sequence if any of its tokens has ``w_t < floor``."""

    kind: Literal["veto"] = "veto"
    floor: float = Field(default=1e-4, gt=0.0, lt=1.0)


class M2PO(_Correction):
    """Second-moment mask: among active-quadrant tokens ((A > 0, w > 1) or (A < 0, w < 1)),
    drop those with the largest ``(log w)^2`` until their ``mean((log w)^2)`` is at most ``tau``."""

    kind: Literal["m2po"] = "m2po"
    tau: float = Field(default=0.04, gt=0.0)


Correction = Annotated[TIS | TokenMask | IcePop | GeoMask | Veto | M2PO | OPSM, Field(discriminator="kind")]


class ObjectiveConfig(BaseModel):
    """Loss, advantages, behaviour corrections and aggregation of one objective."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loss: LossKind = Field(default="cispo", json_schema_extra=IDENTITY)  # resume needs the same family
    eps_low: float | None = Field(
        default=None, gt=0.0, le=1.0, description="lower clip 1 - eps_low; default per loss"
    )
    eps_high: float | None = Field(
        default=None, gt=0.0, description="upper clip 1 + eps_high; default per loss"
    )
    advantages: AdvantageKind = "grpo"
    advantage_eps: float = Field(default=1e-6, gt=0.0, description="added to the std in grpo / whiten")
    corrections: list[Correction] = Field(default_factory=lambda: [TIS()])
    aggregation: AggregationKind = "token_mean"
    aggregation_constant: float | None = Field(
        default=None, gt=0.0, description="tokens per sequence for seq_sum_constant (max generation length)"
    )
    kl_coef: float = Field(default=0.0, ge=0.0, description="reference-KL coefficient; 0 turns the term off")
    kl_estimator: KLEstimator = "k3"
    kl_clamp: float = Field(
        default=10.0, gt=0.0, description="k3_clamped: the per-token k3 is clamped to [-kl_clamp, kl_clamp]"
    )
    dual_clip_c: float | None = Field(
        default=None, gt=1.0, description="dual-clip PPO: loss of a negative-advantage token <= c * |A|"
    )
    sapo_tau_pos: float = Field(default=1.0, gt=0.0, description="SAPO gate temperature for A > 0")
    sapo_tau_neg: float = Field(default=1.05, gt=0.0, description="SAPO gate temperature for A < 0")
    log_ratio_clamp: float = Field(default=20.0, gt=0.0, le=80.0, description="|log ratio| cap before exp")

    @field_validator("corrections", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        # "m2po" is short for {"kind": "m2po"} with its defaults.
        if isinstance(value, list | tuple):
            return [{"kind": v} if isinstance(v, str) else v for v in value]
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_clip(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        loss = data.get("loss", "cispo")
        if loss in DEFAULT_CLIP:
            low, high = DEFAULT_CLIP[loss]
            data = dict(data)
            if data.get("eps_low") is None:
                data["eps_low"] = low
            if data.get("eps_high") is None:
                data["eps_high"] = high
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> ObjectiveConfig:
        if self.loss in ("reinforce", "sapo") and (self.eps_low is not None or self.eps_high is not None):
            raise ValueError(
                f"eps_low / eps_high have no effect with loss={self.loss}: remove them or use ppo/cispo"
            )
        if self.dual_clip_c is not None:
            if self.loss not in ("ppo", "gspo"):
                raise ValueError(
                    f"dual_clip_c only applies to loss=ppo or gspo (got loss={self.loss}): remove it"
                )
            assert self.eps_high is not None  # filled by _default_clip for ppo / gspo
            if self.dual_clip_c <= 1.0 + self.eps_high:
                raise ValueError(
                    f"dual_clip_c={self.dual_clip_c} must exceed 1 + eps_high={1.0 + self.eps_high}, "
                    "or it would cut the clip region itself"
                )
        if self.aggregation == "seq_sum_constant" and self.aggregation_constant is None:
            raise ValueError(
                "aggregation=seq_sum_constant requires aggregation_constant: set it to the max generation length"
            )
        if self.aggregation != "seq_sum_constant" and self.aggregation_constant is not None:
            raise ValueError(
                f"aggregation_constant is only used by aggregation=seq_sum_constant (got aggregation={self.aggregation})"
            )
        names = [c.name for c in self.corrections]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"corrections lists {', '.join(dupes)} more than once: keep one of each")
        return self

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(1 - eps_low, 1 + eps_high)``; ``(0, inf)`` for reinforce and sapo (no hard clip)."""
        if self.eps_low is None or self.eps_high is None:
            return 0.0, math.inf
        return 1.0 - self.eps_low, 1.0 + self.eps_high

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ObjectiveConfig:
        """Validate a plain dict; errors become one ``ConfigError`` naming each bad field."""
        if not isinstance(data, dict):
            raise ConfigError(f"objective config must be a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None

    @classmethod
    def from_yaml(cls, text_or_path: str | Path) -> ObjectiveConfig:
        """Load from YAML text or a ``.yaml`` file path (an ``objective:`` top-level key is unwrapped)."""
        text = str(text_or_path)
        if isinstance(text_or_path, Path) or (text.endswith((".yaml", ".yml")) and "\n" not in text):
            path = Path(text_or_path)
            if not path.is_file():
                raise ConfigError(f"objective config file not found: {path}")
            text = path.read_text()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"objective config is not valid YAML: {exc}") from None
        if isinstance(data, dict) and set(data) == {"objective"}:
            data = data["objective"]
        return cls.from_dict(data)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        # Cross-field checks have no single location; their message names the fields.
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid objective config: " + "; ".join(parts)

"""The cascade contract: ordered reward stages of rising cost, and what an episode records of them.

A cascade env scores one candidate with stages ``s_0, s_1, ..., s_K`` of rising fidelity and cost
(an ML potential, then DFT, then a lab). Every stage answers on the same scale, the episode's
reward scale: ``s_K`` is the truth the policy is trained for, the earlier stages are proxies of
it. A ``Stage`` declares:

- ``cost_unit`` and ``cost`` per call: what the budget ledger charges (``cpu_s``: CPU-seconds,
  ``gpu_h``: GPU-hours, ``lab_h``: lab-hours);
- ``latency``: the distribution of its wall time, log-normal with median ``median_s`` and log-space
  spread ``sigma`` (``t = median_s * exp(sigma * z)``, ``z ~ N(0, 1)``), for planning admission;
- ``pass_on``: whether a candidate scored by this stage goes on to the next one. ``Threshold``
  passes a candidate whose value is at least ``min_reward``; ``TopK`` passes the ``k`` best of the
  episode's GRPO group and needs the group's values (``labrl.envs.cascade.group.GroupGate``);
  ``Informative`` passes the members whose group advantage the next stage could flip (its docstring).
  A candidate that does not pass still goes on with the audit probability (``CascadeSection``),
  which is what keeps the reward unbiased (``labrl.envs.cascade.estimator``).

The last stage's ``pass_on`` must be None. An episode's ``StepResult.info["cascade"]`` is a
``CascadeRecord``: every stage it reached, with that stage's value, charged cost, wall time and
the probability with which it ran.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CostUnit(StrEnum):
    """The unit a stage's cost and its budget are counted in."""

    CPU_S = "cpu_s"
    GPU_H = "gpu_h"
    LAB_H = "lab_h"


class Latency(_Record):
    """Log-normal wall time of a stage: ``t = median_s * exp(sigma * z)``, ``z ~ N(0, 1)``.

    Mean ``median_s * exp(sigma**2 / 2)``; ``sigma = 0`` is a fixed latency.
    """

    median_s: float = Field(gt=0, le=30 * 24 * 3600.0)
    sigma: float = Field(default=0.0, ge=0, le=5.0)

    @property
    def mean_s(self) -> float:
        return self.median_s * math.exp(self.sigma**2 / 2)

    def sample(self, rng: random.Random) -> float:
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))


class Threshold(_Record):
    """Pass on a candidate whose value at this stage is at least ``min_reward``."""

    kind: Literal["threshold"] = "threshold"
    min_reward: float

    def passes(self, value: float) -> bool:
        return value >= self.min_reward


class TopK(_Record):
    """Pass on the ``k`` best candidates of the episode's group (ties broken by member order)."""

    kind: Literal["top_k"] = "top_k"
    k: int = Field(ge=1)


class Informative(_Record):
    """Pass on the members of the group whose next stage could flip the sign of their group advantage.

    With ``v_i`` the values the ``n`` members reported at this stage, ``m`` their mean and ``g_i``
    the gap to the next stage (``s_next = v + g``, mean ``mu``, standard deviation ``sigma``,
    independent across members), the next stage's group advantage is
    ``(v_i - m) + (g_i - mean_j g_j)``: the constant ``mu`` cancels and the second term has standard
    deviation ``sigma * sqrt(1 - 1/n)``. So a member passes when

        |v_i - m| < margin = z * sigma * sqrt(1 - 1/n)

    (its sign is uncertain at ``z`` standard deviations); elsewhere the next stage cannot flip the
    sign but with small probability and runs only as an audit. ``sigma`` is ``noise`` until
    ``min_residuals`` pairs of (this stage, next stage) values have been seen in the process
    (``learn``), then their measured standard deviation. A group of one has no advantage: nobody passes.
    The decision uses this stage's values only, never the next one's, so the estimator stays unbiased.
    """

    kind: Literal["informative"] = "informative"
    noise: float = Field(
        ge=0, description="sigma before any is measured: the proxy's noise against the next stage"
    )
    z: float = Field(default=2.0, gt=0, le=10)
    learn: bool = Field(default=True, description="replace noise by the std of the measured gaps")
    min_residuals: int = Field(default=20, ge=2)

    def margin(self, members: int, sigma: float) -> float:
        """``z * sigma * sqrt(1 - 1/n)``: how far from the group mean a sign can still flip."""
        return self.z * sigma * math.sqrt(1.0 - 1.0 / members) if members > 1 else 0.0

    def passing(self, values: Mapping[int, float], sigma: float) -> frozenset[int]:
        """The members (keys of ``values``) within the margin of the group mean."""
        if not values:
            return frozenset()
        mean = sum(values.values()) / len(values)
        margin = self.margin(len(values), sigma)
        return frozenset(member for member, v in values.items() if abs(v - mean) < margin)


PassRule = Annotated[Threshold | TopK | Informative, Field(discriminator="kind")]
#: the rules that decide from the group's values, so a group's envs share a ``GroupGate``
GROUP_RULES: tuple[type, ...] = (TopK, Informative)


class Stage(_Record):
    """One reward stage of a cascade (module docstring)."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    cost_unit: CostUnit
    cost: float = Field(ge=0, description="charged per call, in cost_unit")
    latency: Latency
    pass_on: PassRule | None = None


def check_stages(stages: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """Validate an ordered cascade: at least two stages, unique names, a rule on all but the last."""
    if len(stages) < 2:
        raise ValueError(f"a cascade needs at least two stages, got {len(stages)}")
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"stage names must be unique, got {names}")
    for stage in stages[:-1]:
        if stage.pass_on is None:
            raise ValueError(f"stage {stage.name!r} is not the last: it needs a pass_on rule")
    if stages[-1].pass_on is not None:
        raise ValueError(
            f"the last stage {stages[-1].name!r} has nothing to pass on to: pass_on must be None"
        )
    return stages


class StageRecord(_Record):
    """What one stage did for one episode."""

    stage: str
    value: float = Field(description="the stage's reward for the candidate")
    cost: float = Field(ge=0, description="charged to the budget (0 when the ledger had already paid)")
    cost_unit: CostUnit
    seconds: float = Field(ge=0, description="wall time of the stage")
    run_probability: float = Field(
        gt=0, le=1, description="P(this stage ran | the previous one ran); 1 for the first stage"
    )
    passed_rule: bool = Field(description="the previous stage's rule passed the candidate on (False: audit)")
    reused: bool = Field(default=False, description="the value came from the ledger (paid before)")


class CascadeRecord(_Record):
    """Every stage an episode reached, in order, and the reward the estimator made of them."""

    stages: tuple[StageRecord, ...] = Field(min_length=1)
    reward: float
    declared: tuple[str, ...] = Field(description="the names of all the env's stages, in order")
    baseline: float | None = Field(
        default=None,
        description="the learnt b that stood in for the first stage's value (None: the value itself)",
    )

    @model_validator(mode="after")
    def _a_prefix_of_the_declared_stages(self) -> CascadeRecord:
        reached = tuple(s.stage for s in self.stages)
        if reached != self.declared[: len(reached)]:
            raise ValueError(f"stages {reached} are not a prefix of the declared cascade {self.declared}")
        return self

    @property
    def values(self) -> tuple[float, ...]:
        return tuple(s.value for s in self.stages)

    @property
    def run_probabilities(self) -> tuple[float, ...]:
        return tuple(s.run_probability for s in self.stages[1:])

"""The ``cascade:`` section: per-stage budgets, the audit probability and the seed of the audit draws.

Owned by the cascade component (not ``env.budgets``, which are per-episode time limits)::

    cascade:
      audit_probability: 0.1          # p: a candidate the rule stops still goes on with probability p
      seed: 0                         # seeds the audit draws (labrl.envs.cascade.env)
      test_split_at_truth: false      # true: the test split runs every stage, held-out reward = truth
      ledger_path: runs/x/cascade-ledger.sqlite   # None: RUN_DIR/cascade-ledger.sqlite under labrl train, else in memory
      budgets:
        dft: {limit: 2.0, unit: gpu_h}  # the run may charge stage "dft" at most 2 GPU-hours
      control_variate:                # what an unaudited episode is rewarded with (labrl.envs.cascade.baseline)
        kind: proxy                   # the cheap stage's value; nearest_truths: learnt from paid truths

A stage without a budget is unlimited (but still recorded, so it is never paid twice). A budget
names its unit so that a limit written in the wrong unit is refused against the stage's
declaration (``check_against``) instead of silently meaning something 3600 times larger.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from labrl.envs.cascade.stages import CostUnit, Stage
from labrl.errors import ConfigError

#: the most any one budget may say, per unit: beyond it a number is a typo (a year of GPU time, ...)
ABSURD_LIMITS = {CostUnit.CPU_S: 1e9, CostUnit.GPU_H: 1e6, CostUnit.LAB_H: 1e5}
#: below this an audit cannot correct anything in a run's lifetime and weights of 1/p explode
MIN_AUDIT_PROBABILITY = 1e-4


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StageBudget(_Section):
    limit: float = Field(gt=0, description="the most the run may charge this stage, in unit")
    unit: CostUnit

    @model_validator(mode="after")
    def _not_absurd(self) -> StageBudget:
        ceiling = ABSURD_LIMITS[self.unit]
        if self.limit > ceiling:
            raise ValueError(f"a budget of {self.limit:g} {self.unit.value} is absurd (at most {ceiling:g})")
        return self


class ControlVariate(_Section):
    """The baseline ``b`` in ``r = b + (A / q)(e - b)`` (``labrl.envs.cascade.baseline``).

    ``proxy``: ``b = c``, the cheap stage's value. ``nearest_truths``: ``b`` is the mean truth of the
    ``neighbours`` nearest of the last ``window`` paid candidates of other tasks, once ``min_truths``
    are stored (``c`` until then).
    """

    kind: Literal["proxy", "nearest_truths"] = "proxy"
    neighbours: int = Field(default=8, ge=1, le=4096)
    min_truths: int = Field(default=64, ge=1, le=100_000)
    window: int = Field(default=4096, ge=1, le=100_000)

    @model_validator(mode="after")
    def _fits_the_window(self) -> ControlVariate:
        if max(self.neighbours, self.min_truths) > self.window:
            raise ValueError(
                f"neighbours ({self.neighbours}) and min_truths ({self.min_truths}) must fit in the window ({self.window})"
            )
        return self


class CascadeSection(_Section):
    audit_probability: float = Field(
        default=0.1,
        ge=MIN_AUDIT_PROBABILITY,
        le=1.0,
        description="probability that a candidate a rule stops still runs the next stage (the audit)",
    )
    seed: int = Field(default=0, ge=0, description="seeds the audit draws")
    test_split_at_truth: bool = Field(
        default=False,
        description="test-split episodes run every stage (q = 1), so a held-out reward is the truth itself",
    )
    ledger_path: str | None = Field(
        default=None,
        min_length=1,
        description="SQLite budget ledger; None: RUN_DIR/cascade-ledger.sqlite under labrl train, else in memory",
    )
    budgets: dict[str, StageBudget] = Field(default_factory=dict, description="per-stage budgets")
    control_variate: ControlVariate = Field(
        default_factory=ControlVariate, description="what stands in for the truth where it did not run"
    )

    def check_against(self, stages: Sequence[Stage], env_id: str) -> None:
        """Every budget names a stage of the env, in that stage's unit; ``ConfigError`` otherwise."""
        declared = {s.name: s for s in stages}
        for name, budget in self.budgets.items():
            if name not in declared:
                close = difflib.get_close_matches(name, list(declared), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"cascade.budgets.{name}: {env_id} has no stage {name!r} (stages: {sorted(declared)}){hint}"
                )
            unit = declared[name].cost_unit
            if budget.unit is not unit:
                raise ConfigError(
                    f"cascade.budgets.{name}: unit {budget.unit.value}, but stage {name!r} is charged in {unit.value}"
                )

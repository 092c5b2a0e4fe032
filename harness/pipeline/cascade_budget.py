"""A cascade env's budgets as the pipeline sees them: spend per stage, admission by predicted spend, metrics.

For a cascade env (``labrl.envs.cascade``), per stage ``k``:

- ``spent_k``: what the run's budget ledger has charged (``CascadeEnv.ledger_spent``), read when
  the run starts, after each group and before each step's record;
- ``c_k``: the mean charge per episode, over the episodes finished so far, from their
  ``Trajectory.info["cascade"]`` records (an episode that did not reach the stage, or whose value
  came from the ledger, was charged 0). Until ``MIN_OBSERVED`` episodes have finished it is the
  stage's declared cost per call, as if every episode reached the stage (pessimistic).

Admission (``admits``): a group of ``G`` episodes may start while ``n`` episodes are in flight iff,
for every stage with a budget ``L_k``,

    spent_k + c_k * (n + G) <= L_k

The episodes in flight are counted at their full predicted cost although some of it is already in
``spent_k``, so the prediction errs towards stopping early. As the budget's end nears, fewer
episodes may be in flight (at most ``(L_k - spent_k) / c_k - G``): admission slows. Once
``L_k - spent_k < c_k * G`` no group starts, and when nothing is in flight either the run stops with
``BudgetExhaustedError`` (``exhausted_error``), after its checkpoint, instead of waiting forever.

Step metrics (``step_metrics``), for each stage: ``cascade/<stage>/spent``, ``/cost_per_episode``
(``c_k``), and with a budget ``/limit`` and ``/left`` (``L_k - spent_k``); for each stage with a rule,
``/pass_rate``: of the episodes finished since the last step that reached the stage, the fraction
its rule passed on (audits excluded). With a learnt baseline (``cascade.control_variate``),
``cascade/learnt_baseline_frac``: of the episodes finished since the last step that had a cascade
record, the fraction rewarded with the learnt ``b`` in the proxy's place (0 until it has its first
truths).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from labrl.envs.base import Env
from labrl.envs.cascade import CascadeEnv, CascadeRecord, Stage
from labrl.errors import BudgetExhaustedError
from labrl.harness.types import Trajectory

#: episodes to finish before the measured mean charge replaces the declared cost per call
MIN_OBSERVED = 8


class CascadeBudget:
    """See the module docstring."""

    def __init__(self, env: CascadeEnv) -> None:
        self.env = env
        self.stages: tuple[Stage, ...] = env.stages
        self.limits = {name: budget.limit for name, budget in env.cascade.budgets.items()}
        self.spent: dict[str, float] = {}
        self.episodes = 0
        self._charged: dict[str, float] = {}
        self._reached: Counter[str] = Counter()  # since the last step record
        self._passed: Counter[str] = Counter()
        self._with_baseline = [
            0,
            0,
        ]  # episodes with a learnt b, episodes with a record; since the last record

    @classmethod
    def of(cls, env: Env) -> CascadeBudget | None:
        """The budget view of ``env`` when it is a cascade env; None otherwise."""
        inner = env.unwrapped
        return cls(inner) if isinstance(inner, CascadeEnv) else None

    async def refresh(self) -> None:
        """Read what the ledger has charged per stage."""
        self.spent = await self.env.ledger_spent()

    def observe(self, trajectories: Iterable[Trajectory]) -> None:
        """Count the charges and rule decisions of finished episodes (with or without a cascade record)."""
        for t in trajectories:
            self.episodes += 1
            if "cascade" not in t.info:
                continue
            record = CascadeRecord.model_validate(t.info["cascade"])
            self._with_baseline[0] += record.baseline is not None
            self._with_baseline[1] += 1
            for index, stage in enumerate(record.stages):
                self._charged[stage.stage] = self._charged.get(stage.stage, 0.0) + stage.cost
                self._reached[stage.stage] += 1
                if index > 0 and stage.passed_rule:
                    self._passed[record.stages[index - 1].stage] += 1

    def cost_per_episode(self, stage: Stage) -> float:
        """``c_k``: the measured mean charge per episode, or the declared cost before ``MIN_OBSERVED`` episodes."""
        if self.episodes < MIN_OBSERVED:
            return stage.cost
        return self._charged.get(stage.name, 0.0) / self.episodes

    def _short(self, inflight: int, group_size: int) -> Stage | None:
        """The first budgeted stage whose predicted spend passes its limit, or None."""
        for stage in self.stages:
            limit = self.limits.get(stage.name)
            predicted = self.spent.get(stage.name, 0.0) + self.cost_per_episode(stage) * (
                inflight + group_size
            )
            if limit is not None and predicted > limit:
                return stage
        return None

    def admits(self, inflight: int, group_size: int) -> bool:
        """Whether a group of ``group_size`` may start with ``inflight`` episodes running (module docstring)."""
        return self._short(inflight, group_size) is None

    def exhausted_error(self, group_size: int) -> BudgetExhaustedError:
        """The error that stops a run no group of which can start any more."""
        stage = self._short(0, group_size)
        assert stage is not None, "exhausted_error called while a group may still start"
        limit, spent = self.limits[stage.name], self.spent.get(stage.name, 0.0)
        need = self.cost_per_episode(stage) * group_size
        return BudgetExhaustedError(
            f"cascade stage {stage.name!r}: {spent:.4g} of its {limit:g} {stage.cost_unit.value} budget is spent "
            f"and a group of {group_size} episodes is predicted to cost {need:.4g}: "
            f"raise cascade.budgets.{stage.name}.limit to go on"
        )

    def step_metrics(self) -> dict[str, Any]:
        """This step's ``cascade/<stage>/...`` metrics (module docstring); resets the pass-rate window."""
        out: dict[str, Any] = {}
        for stage in self.stages:
            prefix = f"cascade/{stage.name}"
            spent = self.spent.get(stage.name, 0.0)
            out[f"{prefix}/spent"] = spent
            out[f"{prefix}/cost_per_episode"] = self.cost_per_episode(stage)
            if stage.name in self.limits:
                out[f"{prefix}/limit"] = self.limits[stage.name]
                out[f"{prefix}/left"] = self.limits[stage.name] - spent
            if stage.pass_on is not None:
                reached = self._reached[stage.name]
                out[f"{prefix}/pass_rate"] = self._passed[stage.name] / reached if reached else None
        if self.env.cascade.control_variate.kind != "proxy":
            learnt, recorded = self._with_baseline
            out["cascade/learnt_baseline_frac"] = learnt / recorded if recorded else None
        self._reached.clear()
        self._passed.clear()
        self._with_baseline = [0, 0]
        return out

"""``CascadeEnv``: the base of an env whose reward is a cascade of stages (``labrl.envs.cascade.stages``).

A subclass declares its stages (``self.stages``, validated by ``set_stages``) and implements:

- ``candidate(action)``: the thing to score, parsed from the model's turn (``InvalidActionError``
  for an unusable one, as in any env);
- ``candidate_text(candidate)``: its canonical text, hashed into the ledger key;
- ``evaluate(stage, candidate)``: the stage's value for the candidate (a coroutine; run CPU-heavy
  work with ``run_cpu`` as any env does).

``step`` runs the cascade for a single-turn env (a multi-turn env calls ``run_cascade`` in its final
step). For each stage after the first, the previous stage's rule decides (``Threshold``, or
``TopK`` and ``Informative`` through the group's ``GroupGate``); a candidate it stops still runs the stage when the
audit draw ``u < p`` (``cascade.audit_probability``), so the stage ran with probability ``q = 1``
(passed) or ``q = p`` (audited); with ``cascade.test_split_at_truth`` a test-split episode runs
every stage with ``q = 1`` and no rule consulted, so ``r = e`` exactly (a held-out measurement of the
truth, charged under the test split's keys). ``u`` is a uniform drawn from a hash of ``(cascade.seed, stage
key)``: deterministic for a candidate, so replaying an episode gives the same reward, and
independent of the candidate's values at the stage being decided. Each stage call is paid through
the budget ledger (``labrl.envs.cascade.ledger``) under ``stage_key``; the reward is
``cascade_reward`` of the values reached (``labrl.envs.cascade.estimator``), and
``info["cascade"]`` holds the ``CascadeRecord``. With ``cascade.control_variate.kind: nearest_truths``
a learnt baseline ``b`` (``labrl.envs.cascade.baseline``; its inputs ``baseline_inputs``, by
default the first stage's value) stands in for the first stage's value, predicted before the second stage's
draw; every train-split candidate that reaches the second stage teaches it (test-split truths
never do, so no held-out truth shapes a training reward).

A stage that fails or answers NaN is ``VerifierError`` naming the stage (outcome
``verifier_failed``, no reward); a spent budget is ``BudgetExhaustedError``, which stops the run.
The env accepts the run's ``cascade:`` section as its ``cascade`` option.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from labrl.envs.base import Env
from labrl.envs.cascade.baseline import NearestTruths, shared_baseline
from labrl.envs.cascade.config import CascadeSection
from labrl.envs.cascade.estimator import cascade_reward
from labrl.envs.cascade.group import GroupGate
from labrl.envs.cascade.ledger import BudgetLedger, MemoryLedger, SqliteLedger
from labrl.envs.cascade.residuals import shared_gaps
from labrl.envs.cascade.stages import (
    GROUP_RULES,
    CascadeRecord,
    Informative,
    Stage,
    StageRecord,
    Threshold,
    TopK,
    check_stages,
)
from labrl.envs.types import Action, StepResult, Task
from labrl.errors import ConfigError, EnvError, VerifierError

_LEDGERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, BudgetLedger]] = (
    weakref.WeakKeyDictionary()
)


def shared_ledger(section: CascadeSection) -> BudgetLedger:
    """The process-wide ledger of ``section`` on the running loop (every episode charges the same one)."""
    ledgers = _LEDGERS.setdefault(asyncio.get_running_loop(), {})
    key = section.model_dump_json()
    if key not in ledgers:
        path = section.ledger_path
        ledgers[key] = SqliteLedger(path, section.budgets) if path else MemoryLedger(section.budgets)
    return ledgers[key]


def stage_key(task: Task, stage: str, candidate_text: str) -> str:
    """The ledger key of one stage call: ``env/split/seed/task/stage/sha256(candidate)[:16]``."""
    digest = hashlib.sha256(candidate_text.encode()).hexdigest()[:16]
    return f"{task.env_id}/{task.split}/{task.seed}/{task.task_id}/{stage}/{digest}"


def audit_uniform(seed: int, key: str) -> float:
    """A uniform in [0, 1) from ``sha256(seed/key)``: the audit draw of the stage call ``key``."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class CascadeEnv(Env):
    """See the module docstring."""

    stages: tuple[Stage, ...]

    def __init__(self, cascade: CascadeSection | Mapping[str, Any] | None = None) -> None:
        try:
            self.cascade = CascadeSection.model_validate(cascade if cascade is not None else {})
        except ValueError as exc:
            raise ConfigError(f"invalid cascade section: {exc}") from exc
        self._gate: tuple[GroupGate, int] | None = None

    def set_stages(self, stages: tuple[Stage, ...], env_id: str) -> None:
        """Declare the cascade; ``ConfigError`` for a malformed one or a budget that names no stage."""
        try:
            self.stages = check_stages(tuple(stages))
        except ValueError as exc:
            raise ConfigError(f"{env_id}: {exc}") from exc
        self.cascade.check_against(self.stages, env_id)

    @property
    def needs_group_gate(self) -> bool:
        """Whether a rule decides by the group (``TopK``): its G envs must then share one ``GroupGate``."""
        return any(isinstance(s.pass_on, GROUP_RULES) for s in self.stages)

    def join_group(self, gate: GroupGate, member: int) -> None:
        """Take part in ``gate`` as ``member``: what ``TopK`` rules rank by."""
        self._gate = (gate, member)

    async def ledger_spent(self) -> dict[str, float]:
        """What the run's budget ledger (the one every episode of this process pays through) charged per stage."""
        return await shared_ledger(self.cascade).spent()

    @abstractmethod
    def candidate(self, action: Action) -> Any:
        """The thing the stages score, from the model's turn; ``InvalidActionError`` if unusable."""

    @abstractmethod
    def candidate_text(self, candidate: Any) -> str:
        """The canonical text of ``candidate`` (the same candidate always gives the same text)."""

    @abstractmethod
    async def evaluate(self, stage: Stage, candidate: Any) -> float:
        """``stage``'s value for ``candidate``, on the episode's reward scale."""

    def baseline_inputs(self, candidate: Any, first_value: float) -> tuple[float, ...]:
        """What the learnt baseline predicts the next stage from: by default the first stage's value
        alone (a calibration of the proxy); an env that knows more of the candidate (its offset from
        a hint, a geometry relative to experiment) says so here. Fixed length per env."""
        return (first_value,)

    async def step(self, action: Action) -> StepResult:
        task = self.episode_task()
        record = await self.run_cascade(task, self.candidate(action))
        return StepResult(reward=record.reward, done=True, info={"cascade": record.model_dump(mode="json")})

    async def run_cascade(self, task: Task, candidate: Any) -> CascadeRecord:
        """Run the stages on ``candidate`` as far as the rules and audits go (module docstring)."""
        ledger = shared_ledger(self.cascade)
        text = self.candidate_text(candidate)
        records: list[StageRecord] = []
        every_stage = self.cascade.test_split_at_truth and task.split == "test"
        baseline: float | None = None
        for index, stage in enumerate(self.stages):
            key = stage_key(task, stage.name, text)
            probability, passed = 1.0, True
            if index == 1 and not every_stage:  # before the draw: b must not depend on it
                baseline = self._baseline(task, records[0].value, candidate)
            if index > 0 and not every_stage:
                passed = await self._passes(self.stages[index - 1], records[-1].value)
                probability = 1.0 if passed else self.cascade.audit_probability
                if audit_uniform(self.cascade.seed, key) >= probability:
                    break
            records.append(await self._run_stage(ledger, key, stage, candidate, probability, passed))
            if index > 0 and isinstance(self.stages[index - 1].pass_on, Informative):
                shared_gaps(task.env_id, self.stages[index - 1].name).add(
                    records[-1].value - records[-2].value
                )
            if index == 1 and task.split == "train":  # held-out truths never shape a training reward
                self._teach_baseline(task, records[0].value, candidate, records[1].value)
        self._withdraw_after(len(records))
        values = [r.value for r in records]
        reward = cascade_reward(values, [r.run_probability for r in records[1:]], baseline)
        return CascadeRecord(
            stages=tuple(records),
            reward=reward,
            declared=tuple(s.name for s in self.stages),
            baseline=baseline,
        )

    def _baseline(self, task: Task, first_value: float, candidate: Any) -> float | None:
        """The learnt ``b`` for this candidate, or None (the plain estimator) when none is configured or learnt yet."""
        return self._with_baseline_model(
            task, lambda model, key, x: model.predict(key, x), first_value, candidate
        )

    def _teach_baseline(self, task: Task, first_value: float, candidate: Any, next_value: float) -> None:
        self._with_baseline_model(
            task, lambda model, key, x: model.add(key, x, next_value), first_value, candidate
        )

    def _with_baseline_model(
        self,
        task: Task,
        use: Callable[[NearestTruths, str, tuple[float, ...]], Any],
        first_value: float,
        candidate: Any,
    ) -> Any:
        section = self.cascade.control_variate
        if section.kind == "proxy":
            return None
        model = shared_baseline(task.env_id, self.stages[0].name, section)
        inputs = self.baseline_inputs(candidate, first_value)
        try:
            return use(model, f"{task.split}/{task.task_id}", inputs)
        except ValueError as exc:  # the env's baseline_inputs broke its contract
            raise EnvError(f"{task.env_id}: baseline_inputs {inputs!r}: {exc}") from exc

    async def _run_stage(
        self, ledger: BudgetLedger, key: str, stage: Stage, candidate: Any, probability: float, passed: bool
    ) -> StageRecord:
        try:
            payment = await ledger.pay(key, stage)
            started = time.perf_counter()
            value = payment.value if payment.value is not None else await self._evaluate(stage, candidate)
            if payment.value is None:
                await ledger.settle(key, value, time.perf_counter() - started)
        except BaseException:  # this episode ends here: its group must not wait for its ranks
            self._withdraw_after(self.stages.index(stage))
            raise
        return StageRecord(
            stage=stage.name,
            value=value,
            cost=payment.charged,
            cost_unit=stage.cost_unit,
            seconds=time.perf_counter() - started,
            run_probability=probability,
            passed_rule=passed,
            reused=payment.value is not None,
        )

    async def _evaluate(self, stage: Stage, candidate: Any) -> float:
        """``evaluate`` under the scoring deadline; a failure or a non-finite value is ``VerifierError``."""
        try:
            value = float(await self.score(self.evaluate, stage, candidate))
        except VerifierError as exc:
            raise VerifierError(f"cascade stage {stage.name!r} failed: {exc}") from exc
        except (TypeError, ValueError) as exc:  # float() of what the stage answered
            raise VerifierError(f"cascade stage {stage.name!r} answered no number: {exc}") from exc
        if not math.isfinite(value):
            raise VerifierError(f"cascade stage {stage.name!r} answered a non-finite value {value}")
        return value

    async def _passes(self, stage: Stage, value: float) -> bool:
        rule = stage.pass_on
        if rule is None:
            raise AssertionError(f"stage {stage.name!r} has no pass_on rule")  # check_stages forbids it
        if isinstance(rule, Threshold):
            return rule.passes(value)
        if self._gate is None:  # every other rule decides by the group
            raise EnvError(
                f"{self.spec.id}: stage {stage.name!r} passes on by its group ({rule.kind}), "
                "but the env joined no group (CascadeEnv.join_group)"
            )
        gate, member = self._gate
        if isinstance(rule, TopK):
            return await gate.rank(member, stage.name, value) < rule.k
        sigma = rule.noise
        gaps = shared_gaps(self.episode_task().env_id, stage.name)
        if rule.learn and gaps.count >= rule.min_residuals:
            sigma = gaps.std  # read before reporting: no gap of this group is in it yet
        return member in rule.passing(await gate.reported(member, stage.name, value), sigma)

    def _withdraw_after(self, reached: int) -> None:
        """Withdraw from the group's rankings of every stage from ``reached - 1`` on that this
        episode will not report at (it stopped or failed before)."""
        if self._gate is None:
            return
        gate, member = self._gate
        for stage in self.stages[max(reached - 1, 0) :]:
            if isinstance(stage.pass_on, GROUP_RULES):
                gate.withdraw(member, stage.name)

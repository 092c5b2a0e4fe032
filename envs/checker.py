"""The contract checker behind ``labrl envs check ID``.

Runs a registered env through the checks every env must pass and returns a
machine-readable ``CheckReport``:

- ``spec``: the spec is valid, its id is the registered id, it round-trips JSON;
- ``determinism``: the same (split, seed) gives the same task, the same
  opening observation, and the same reward for the same actions;
- ``splits``: train and test tasks for the first seeds share no task id and
  no content;
- ``json``: tasks, observations and step results round-trip through JSON;
- ``timeout``: a step made deliberately slow ends with outcome ``timeout``
  at the step deadline (the framework's budget, not the env's goodwill);
- ``invalid_action``: garbage actions give outcome ``invalid_action``, never
  an exception or a scored answer;
- ``gold``: where the env knows the answer, playing it earns full reward (a cascade env plays it
  with every stage audited, ``audit_probability=1``: its reward is then the last stage's value);
- ``max_turns``: a random policy's episode ends within ``max_turns``;
- ``rewards``: gold and random actions on several seeds never give a NaN or
  infinite reward (the budget wrapper turns one into ``verifier_failed``;
  this check names the env that produced it);
- ``cascade``: for a cascade env (``labrl.envs.cascade.CascadeEnv``), every scored step's
  ``info["cascade"]`` is a ``CascadeRecord`` of a prefix of the declared stages, in their units,
  each run with probability 1 (passed on) or the audit probability, and its reward is the
  estimator's (``cascade_reward``); under full audit every stage runs and the reward is the last
  stage's value; a stage that raises ends the step ``verifier_failed`` naming the stage;
- ``event_loop``: reset and step never hold the event loop longer than
  ``LOOP_STALL_LIMIT_S`` (a heartbeat coroutine measures the longest gap):
  an env that computes or sleeps synchronously stalls every other episode.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from labrl.envs.actions import parse_action
from labrl.envs.base import Env
from labrl.envs.cascade.env import CascadeEnv
from labrl.envs.cascade.estimator import cascade_reward
from labrl.envs.cascade.group import GroupGate
from labrl.envs.cascade.stages import CascadeRecord, Stage
from labrl.envs.episode import run_episode, scripted_policy
from labrl.envs.registry import make
from labrl.envs.types import Action, EnvSpec, Observation, Outcome, StepResult, Task

GARBAGE_ACTIONS = (
    "",
    "\x00\x01\x02\x7f",
    "{",
    "<tool_call>{not json</tool_call>",
    "}}}{{{ ]][[ \ufffd\ufffd",
)
FULL_REWARD = 1.0
TIMEOUT_SLACK_S = 1.0
LOOP_STALL_LIMIT_S = 0.5  # generous for a loaded 2-core machine; a blocking env stalls far longer
HEARTBEAT_S = 0.005


class CheckResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    passed: bool
    detail: str = ""
    seconds: float = 0.0


class CheckReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    env_id: str
    passed: bool
    checks: tuple[CheckResult, ...]


class CheckFailed(AssertionError):
    """A check's expectation was not met (the message says which)."""


def _fingerprint(task: Task) -> str:
    content = json.dumps({"prompt": task.prompt, "answer": task.answer}, sort_keys=True, default=str)
    return hashlib.sha256(content.encode()).hexdigest()


def _roundtrip(model: BaseModel) -> None:
    again = type(model).model_validate_json(model.model_dump_json())
    if again != model:
        raise CheckFailed(f"{type(model).__name__} changes when round-tripped through JSON")


async def _random_step(env: Env) -> tuple[Task, Observation, StepResult, float]:
    """Reset ``env`` to the train task of seed 0, take one random action, close ``env``: the task, the
    observation, the step result and the step's wall time (s)."""
    try:
        task = env.make_task("train", 0)
        observation = await env.reset(task)
        t0 = time.perf_counter()
        result = await env.step(env.random_action(task, random.Random(0)))
        return task, observation, result, time.perf_counter() - t0
    finally:
        await env.close()


def _alone(env: Env) -> Env:
    """``env``, joined to a group of one where it is a cascade whose rules decide by the group.

    The checker plays single episodes; as a group of one, ``TopK`` passes the candidate (rank 0)
    and ``Informative`` passes nobody (a group of one has no advantage), so the audit decides."""
    inner = env.unwrapped
    if isinstance(inner, CascadeEnv) and inner.needs_group_gate:
        inner.join_group(GroupGate(1), 0)
    return env


class _Checker:
    def __init__(self, env_id: str, seeds: int, make_kwargs: dict[str, Any]) -> None:
        self.env_id = env_id
        self.seeds = list(range(seeds))
        self.make_kwargs = make_kwargs

    def fresh(self, **budgets: Any) -> Env:
        return _alone(make(self.env_id, budgets=budgets or None, **self.make_kwargs))

    def fully_audited(self) -> Env:
        """A fresh cascade env whose every stage runs (``cascade.audit_probability = 1``)."""
        cascade = {**(self.make_kwargs.get("cascade") or {}), "audit_probability": 1.0}
        return _alone(make(self.env_id, **{**self.make_kwargs, "cascade": cascade}))

    async def cascade_stages(self) -> tuple[tuple[Stage, ...], float] | None:
        """The stages and audit probability of a cascade env; None for any other env."""
        env = self.fresh()
        try:
            inner = env.unwrapped
            return (inner.stages, inner.cascade.audit_probability) if isinstance(inner, CascadeEnv) else None
        finally:
            await env.close()

    async def play(self, task: Task, actions: list[Action]) -> list[StepResult]:
        env = self.fresh()
        try:
            await env.reset(task)
            results = []
            for action in actions:
                result = await env.step(action)
                results.append(result)
                if result.done or result.truncated:
                    break
            return results
        finally:
            await env.close()

    async def check_spec(self) -> str:
        env = self.fresh()
        try:
            spec = env.spec
        finally:
            await env.close()
        if spec.id != self.env_id:
            raise CheckFailed(f"spec.id is {spec.id!r}, registered as {self.env_id!r}")
        _roundtrip(spec)
        EnvSpec.model_validate(spec.model_dump())
        return f"version {spec.version}, max_turns {spec.budgets.max_turns}, {len(spec.tools)} tools"

    async def check_determinism(self) -> str:
        env = self.fresh()
        try:
            for split in ("train", "test"):
                for seed in self.seeds[:3]:
                    a, b = env.make_task(split, seed), env.make_task(split, seed)
                    if a != b:
                        raise CheckFailed(f"make_task({split!r}, {seed}) differs between two calls")
        finally:
            await env.close()
        for seed in self.seeds[:3]:
            task = env.make_task("train", seed)
            envs = [self.fresh(), self.fresh()]
            try:
                obs = [await e.reset(task) for e in envs]
            finally:
                for e in envs:
                    await e.close()
            if obs[0] != obs[1]:
                raise CheckFailed(f"reset on train seed {seed} gives different observations")
            gold = env.gold_actions(task)
            actions = list(gold) if gold else [env.random_action(task, random.Random(seed))]
            first, second = await self.play(task, actions), await self.play(task, actions)
            key = [(r.reward, r.outcome, r.done, r.truncated) for r in first]
            if key != [(r.reward, r.outcome, r.done, r.truncated) for r in second]:
                raise CheckFailed(f"the same actions on train seed {seed} give different results: {key}")
        return f"{len(self.seeds[:3])} seeds x 2 splits"

    async def check_splits(self) -> str:
        env = self.fresh()
        try:
            train = [env.make_task("train", s) for s in self.seeds]
            test = [env.make_task("test", s) for s in self.seeds]
        finally:
            await env.close()
        if any(t.split != "train" for t in train) or any(t.split != "test" for t in test):
            raise CheckFailed("make_task does not record the split it was asked for")
        shared_ids = {t.task_id for t in train} & {t.task_id for t in test}
        if shared_ids:
            raise CheckFailed(f"train and test share task ids {sorted(shared_ids)[:3]}")
        shared = {_fingerprint(t) for t in train} & {_fingerprint(t) for t in test}
        if shared:
            raise CheckFailed(f"{len(shared)} task(s) appear in both train and test with the same content")
        return f"{len(self.seeds)} train vs {len(self.seeds)} test tasks disjoint"

    async def check_json(self) -> str:
        task, observation, result, _ = await _random_step(self.fresh())
        for model in (task, observation, result):
            _roundtrip(model)
        Observation.model_validate_json(observation.model_dump_json())
        return "task, observation, step result"

    async def check_timeout(self) -> str:
        deadline = 0.3
        env = self.fresh(step_timeout_s=deadline)
        inner = env.unwrapped
        original_step = inner.step

        async def slow_step(action: Action) -> StepResult:
            await asyncio.sleep(60)
            return await original_step(action)

        inner.step = slow_step  # type: ignore[method-assign]
        _, _, result, elapsed = await _random_step(env)
        if result.outcome is not Outcome.TIMEOUT or result.reward is not None:
            raise CheckFailed(
                f"a step slower than its deadline ended with {result.outcome.value}, reward {result.reward}"
            )
        if elapsed > deadline + TIMEOUT_SLACK_S:
            raise CheckFailed(f"the slow step returned after {elapsed:.2f} s, deadline {deadline} s")
        return f"timeout after {elapsed:.2f} s (deadline {deadline} s)"

    async def check_invalid_action(self) -> str:
        env = self.fresh()
        try:
            task = env.make_task("train", 0)
        finally:
            await env.close()
        for text in GARBAGE_ACTIONS:
            (result,) = await self.play(task, [parse_action(text)])
            if result.outcome is not Outcome.INVALID_ACTION:
                raise CheckFailed(
                    f"garbage action {text!r} gave outcome {result.outcome.value}, not invalid_action"
                )
            if not result.observation.messages:
                raise CheckFailed(f"garbage action {text!r} got no message telling the model what was wrong")
        return f"{len(GARBAGE_ACTIONS)} garbage actions -> invalid_action"

    async def check_gold(self) -> str:
        env = self.fresh()
        played = 0
        player = self.fully_audited if await self.cascade_stages() else self.fresh
        try:
            for seed in self.seeds[:3]:
                task = env.make_task("test", seed)
                gold = env.gold_actions(task)
                if gold is None:
                    continue
                episode = await run_episode(player(), task, scripted_policy(list(gold)))
                if episode.outcome is not Outcome.OK or episode.reward is None:
                    raise CheckFailed(
                        f"gold answer on test seed {seed} ended {episode.outcome.value}: {episode.error}"
                    )
                if abs(episode.reward - FULL_REWARD) > 1e-6:
                    raise CheckFailed(
                        f"gold answer on test seed {seed} scored {episode.reward}, not {FULL_REWARD}"
                    )
                played += 1
        finally:
            await env.close()
        return (
            f"gold scores {FULL_REWARD} on {played} tasks" if played else "env has no gold answer (skipped)"
        )

    async def check_max_turns(self) -> str:
        env = self.fresh()
        task = env.make_task("train", 1)
        rng = random.Random(1)

        async def random_policy(messages: Any, tools: Any) -> Action:
            return env.random_action(task, rng)

        episode = await run_episode(env, task, random_policy, max_turns=env.spec.budgets.max_turns + 5)
        await env.close()
        if episode.num_turns > env.spec.budgets.max_turns:
            raise CheckFailed(
                f"episode ran {episode.num_turns} turns, max_turns is {env.spec.budgets.max_turns}"
            )
        return f"random episode ended after {episode.num_turns} turn(s), outcome {episode.outcome.value}"

    def _probe_actions(self, env: Env, task: Task, seed: int) -> list[list[Action]]:
        gold = env.gold_actions(task)
        plays = [[env.random_action(task, random.Random(seed))]]
        if gold:
            plays.append(list(gold))
        return plays

    async def check_rewards(self) -> str:
        env = self.fresh()
        steps = 0
        try:
            for split in ("train", "test"):
                for seed in self.seeds[:3]:
                    task = env.make_task(split, seed)
                    for actions in self._probe_actions(env, task, seed):
                        for result in await self.play(task, actions):
                            steps += 1
                            if result.info.get("non_finite_reward"):
                                raise CheckFailed(
                                    f"a step on {split} seed {seed} returned a non-finite reward: "
                                    f"{result.info.get('error')}"
                                )
        finally:
            await env.close()
        return f"{steps} steps, every reward finite or None"

    async def check_cascade(self) -> str:
        declared = await self.cascade_stages()
        if declared is None:
            return "not a cascade env (skipped)"
        stages, audit = declared
        records = 0
        for player, full in ((self.fresh, False), (self.fully_audited, True)):
            for split in ("train", "test"):
                for seed in self.seeds[:3]:
                    probe = self.fresh()
                    task = probe.make_task(split, seed)
                    plays = self._probe_actions(probe, task, seed)
                    await probe.close()
                    for actions in plays:
                        env = player()
                        try:
                            await env.reset(task)
                            result = await env.step(actions[0])
                        finally:
                            await env.close()
                        if result.outcome is Outcome.OK:
                            _check_record(result, stages, 1.0 if full else audit, full)
                            records += 1
        failed = await self._failing_stage(stages[-1].name)
        return f"{records} records of {len(stages)} stages consistent; {failed}"

    async def _failing_stage(self, name: str) -> str:
        """Make stage ``name`` raise under full audit: the step must be ``verifier_failed`` naming it."""
        env = self.fully_audited()
        inner = env.unwrapped
        assert isinstance(inner, CascadeEnv)
        original = inner.evaluate

        async def broken(stage: Stage, candidate: Any) -> float:
            if stage.name == name:
                raise RuntimeError("stage broken by the checker")
            return await original(stage, candidate)

        inner.evaluate = broken  # type: ignore[method-assign]
        # a task no other check played: the ledger has no stored value to answer it with
        task = env.make_task("train", self.seeds[-1] + 1)
        gold = env.gold_actions(task)
        action = next(iter(gold)) if gold else env.random_action(task, random.Random(0))
        try:
            await env.reset(task)
            result = await env.step(action)
        finally:
            await env.close()
        if result.outcome is not Outcome.VERIFIER_FAILED or name not in str(result.info.get("error")):
            raise CheckFailed(
                f"a failing stage {name!r} ended the step {result.outcome.value} (reward {result.reward}), "
                f"not verifier_failed naming the stage: {result.info.get('error')}"
            )
        return f"failing stage {name!r} -> verifier_failed"

    async def check_event_loop(self) -> str:
        env = self.fresh()
        worst = (0.0, "")
        try:
            for seed in self.seeds[:2]:
                task = env.make_task("train", seed)
                for actions in self._probe_actions(env, task, seed):
                    played = self.fresh()
                    try:
                        async with _LoopWatch() as watch:
                            await played.reset(task)
                        worst = max(worst, (watch.longest, f"reset on train seed {seed}"), key=_stall)
                        for action in actions:
                            async with _LoopWatch() as watch:
                                result = await played.step(action)
                            worst = max(worst, (watch.longest, f"step on train seed {seed}"), key=_stall)
                            if result.done or result.truncated:
                                break
                    finally:
                        await played.close()
        finally:
            await env.close()
        stall, where = worst
        if stall > LOOP_STALL_LIMIT_S:
            raise CheckFailed(
                f"{where} blocked the event loop for {stall:.2f} s (limit {LOOP_STALL_LIMIT_S} s): "
                "run CPU-heavy work with run_cpu / self.score, blocking calls with run_killable, "
                "and sleep with asyncio.sleep"
            )
        return f"longest event-loop stall {stall * 1000:.0f} ms ({where or 'none'})"


def _check_record(result: StepResult, stages: tuple[Stage, ...], audit: float, full: bool) -> None:
    """``result.info["cascade"]`` is consistent with the declared ``stages`` and the estimator."""
    if "cascade" not in result.info:
        raise CheckFailed("a scored step of a cascade env has no info['cascade'] record")
    record = CascadeRecord.model_validate(result.info["cascade"])
    if record.declared != tuple(s.name for s in stages):
        raise CheckFailed(f"the record declares stages {record.declared}, the env {[s.name for s in stages]}")
    for reached, stage in zip(record.stages, stages, strict=False):
        if reached.cost_unit is not stage.cost_unit:
            raise CheckFailed(
                f"stage {stage.name!r} charged in {reached.cost_unit.value}, declared {stage.cost_unit.value}"
            )
    for reached in record.stages[1:]:
        expected = 1.0 if reached.passed_rule else audit
        if abs(reached.run_probability - expected) > 1e-12:
            raise CheckFailed(
                f"stage {reached.stage!r} ran with probability {reached.run_probability}, not {expected}"
            )
    estimate = cascade_reward(record.values, record.run_probabilities, record.baseline)
    if result.reward is None or abs(result.reward - estimate) > 1e-9 or abs(record.reward - estimate) > 1e-9:
        raise CheckFailed(f"reward {result.reward} is not the estimator's {estimate} of the record")
    if full and (len(record.stages) != len(stages) or abs(estimate - record.values[-1]) > 1e-9):
        raise CheckFailed("under full audit not every stage ran, or the reward is not the last stage's value")


def _stall(measured: tuple[float, str]) -> float:
    return measured[0]


class _LoopWatch:
    """Measures the longest time the event loop went without running a heartbeat coroutine."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last - HEARTBEAT_S)
            last = now

    async def __aenter__(self) -> _LoopWatch:
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0)  # let the heartbeat take its first timestamp
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(HEARTBEAT_S * 2)  # a stall just before exit is measured too
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


async def check_env_async(env_id: str, *, seeds: int = 8, **make_kwargs: Any) -> CheckReport:
    checker = _Checker(env_id, seeds, make_kwargs)
    checks: list[tuple[str, Callable[[], Awaitable[str]]]] = [
        ("spec", checker.check_spec),
        ("determinism", checker.check_determinism),
        ("splits", checker.check_splits),
        ("json", checker.check_json),
        ("timeout", checker.check_timeout),
        ("invalid_action", checker.check_invalid_action),
        ("gold", checker.check_gold),
        ("max_turns", checker.check_max_turns),
        ("rewards", checker.check_rewards),
        ("cascade", checker.check_cascade),
        ("event_loop", checker.check_event_loop),
    ]
    results = []
    for name, run in checks:
        t0 = time.perf_counter()
        try:
            detail, passed = await run(), True
        except CheckFailed as exc:
            detail, passed = str(exc), False
        except Exception as exc:
            detail = f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
            passed = False
        results.append(CheckResult(name=name, passed=passed, detail=detail, seconds=time.perf_counter() - t0))
    return CheckReport(env_id=env_id, passed=all(r.passed for r in results), checks=tuple(results))


def check_env(env_id: str, *, seeds: int = 8, **make_kwargs: Any) -> CheckReport:
    """Run every contract check on ``env_id`` (see the module docstring)."""
    return asyncio.run(check_env_async(env_id, seeds=seeds, **make_kwargs))

"""``synthetic/cascade-v0`` through the contract: records, unbiased rewards, budgets, failures, top-k."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from cascade_fakes import play_one_step

from labrl.envs import Outcome, StepResult, check_env, make
from labrl.envs.cascade import CascadeRecord, GroupGate, Stage
from labrl.errors import BudgetExhaustedError, ConfigError

FAST = {"proxy_latency_s": 1e-4, "truth_latency_s": 1e-4}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"proxy_shift": 0.3, "proxy_offset": -0.2, "cascade": {"audit_probability": 0.2}},
        # the group rules: the checker plays each episode as a group of one
        {"top_k": 1, "cascade": {"audit_probability": 0.3}},
        {"informative_z": 0.5, "cascade": {"audit_probability": 0.3}},
    ],
)
def test_the_contract_checker_passes_the_synthetic_cascade(options):
    report = check_env("synthetic/cascade-v0", seeds=4, **options)
    assert report.passed, [c for c in report.checks if not c.passed]
    cascade = next(c for c in report.checks if c.name == "cascade")
    assert "failing stage 'truth' -> verifier_failed" in cascade.detail


async def test_the_trained_reward_is_unbiased_for_the_truth():
    """Random answers on many tasks: the mean cascade reward matches the mean truth within 4 SE."""
    options = {**FAST, "proxy_offset": 0.3, "proxy_noise": 0.2, "cascade": {"audit_probability": 0.3}}
    rewards, truths, proxies = [], [], []
    rng = random.Random(0)
    for seed in range(600):
        env = make("synthetic/cascade-v0", **options)
        task = env.make_task("train", seed)
        text = f"<answer>{rng.random():.4f}</answer>"
        result = await play_one_step(env, task, text)
        record = CascadeRecord.model_validate(result.info["cascade"])
        full = await play_one_step(
            make("synthetic/cascade-v0", **{**options, "cascade": {"audit_probability": 1}}), task, text
        )
        rewards.append(result.reward)
        truths.append(full.reward)
        proxies.append(record.values[0])
    n = len(rewards)
    diff = [r - t for r, t in zip(rewards, truths, strict=True)]
    mean = sum(diff) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diff) / (n - 1) / n)
    assert abs(mean) < 4 * se
    assert sum(proxies) / n - sum(truths) / n > 0.25  # the proxy alone keeps its +0.3 offset


async def test_a_repeated_candidate_is_answered_from_the_ledger():
    env = make("synthetic/cascade-v0", **FAST, cascade={"audit_probability": 1})
    task = env.make_task("train", 3)
    first = await play_one_step(env, task, "<answer>0.5</answer>")
    second = await play_one_step(
        make("synthetic/cascade-v0", **FAST, cascade={"audit_probability": 1}), task, "<answer>0.5</answer>"
    )
    assert first.reward == second.reward
    stages = CascadeRecord.model_validate(second.info["cascade"]).stages
    assert [(s.reused, s.cost) for s in stages] == [(True, 0.0), (True, 0.0)]


async def test_a_spent_budget_stops_the_run():
    options = {**FAST, "truth_cost_gpu_h": 1.0}
    cascade = {"audit_probability": 1, "budgets": {"truth": {"limit": 2.5, "unit": "gpu_h"}}}
    for seed in range(2):
        env = make("synthetic/cascade-v0", **options, cascade=cascade)
        assert (
            await play_one_step(env, env.make_task("train", seed), "<answer>0.5</answer>")
        ).outcome is Outcome.OK
    env = make("synthetic/cascade-v0", **options, cascade=cascade)
    with pytest.raises(BudgetExhaustedError, match=r"'truth': 2 of its 2\.5 gpu_h"):
        await play_one_step(env, env.make_task("train", 2), "<answer>0.5</answer>")


async def test_a_failing_stage_is_verifier_failed_with_no_reward():
    env = make("synthetic/cascade-v0", **FAST, cascade={"audit_probability": 1})

    async def broken(stage: Stage, candidate: float) -> float:
        return math.nan if stage.name == "truth" else 0.5

    env.unwrapped.evaluate = broken
    result = await play_one_step(env, env.make_task("train", 5), "<answer>0.5</answer>")
    assert result.outcome is Outcome.VERIFIER_FAILED and result.reward is None
    assert "cascade stage 'truth' answered a non-finite value" in result.info["error"]


async def test_top_k_passes_the_best_of_the_group_and_needs_a_group():
    options = {**FAST, "top_k": 1, "proxy_noise": 0.0, "cascade": {"audit_probability": 1e-4}}
    answers = ["0.1", "0.9", "0.45", "0.6"]
    envs = [make("synthetic/cascade-v0", **options) for _ in answers]
    task = envs[0].make_task("train", 0)
    gate = GroupGate(len(envs))
    for member, env in enumerate(envs):
        env.unwrapped.join_group(gate, member)
    results = await asyncio.gather(
        *(play_one_step(e, task, f"<answer>{a}</answer>") for e, a in zip(envs, answers, strict=True))
    )
    reached = [len(r.info["cascade"]["stages"]) for r in results]
    target = float(task.answer)
    best = min(range(len(answers)), key=lambda i: abs(float(answers[i]) - target))
    assert reached == [2 if i == best else 1 for i in range(len(answers))]

    alone = make("synthetic/cascade-v0", **options)
    result = await play_one_step(alone, task, "<answer>0.5</answer>")
    assert result.outcome is Outcome.ENV_ERROR and "joined no group" in result.info["error"]


async def test_a_member_that_fails_early_does_not_hold_up_its_group():
    options = {**FAST, "top_k": 1, "cascade": {"audit_probability": 1e-4}}
    envs = [make("synthetic/cascade-v0", **options) for _ in range(2)]
    task = envs[0].make_task("train", 0)
    gate = GroupGate(2)
    for member, env in enumerate(envs):
        env.unwrapped.join_group(gate, member)

    async def broken(stage: Stage, candidate: float) -> float:
        raise RuntimeError("proxy down")

    envs[1].unwrapped.evaluate = broken
    ok, failed = await asyncio.wait_for(
        asyncio.gather(
            play_one_step(envs[0], task, "<answer>0.5</answer>"),
            play_one_step(envs[1], task, "<answer>0.5</answer>"),
        ),
        timeout=10,
    )
    assert failed.outcome is Outcome.VERIFIER_FAILED and ok.outcome is Outcome.OK
    assert len(ok.info["cascade"]["stages"]) == 2  # alone in its ranking, it is the top 1


def test_the_checker_catches_a_reward_that_is_not_the_estimators(monkeypatch):
    """An env that trains on its cheap proxy alone, recording the cascade honestly, fails the check."""
    from labrl.envs.cascade.synthetic import SyntheticCascadeEnv

    async def proxy_only(self, action):
        record = await self.run_cascade(self.episode_task(), self.candidate(action))
        return StepResult(
            reward=record.values[0], done=True, info={"cascade": record.model_dump(mode="json")}
        )

    monkeypatch.setattr(SyntheticCascadeEnv, "step", proxy_only)
    report = check_env("synthetic/cascade-v0", seeds=4, proxy_offset=0.2)
    cascade = next(c for c in report.checks if c.name == "cascade")
    assert not cascade.passed and "is not the estimator's" in cascade.detail


def test_a_restarted_process_pays_nothing_twice(tmp_path):
    """Two event loops (a process before and after a crash) on one persisted ledger."""
    cascade = {"audit_probability": 1, "ledger_path": str(tmp_path / "ledger.sqlite")}

    def play():
        env = make("synthetic/cascade-v0", **FAST, cascade=cascade)
        result = asyncio.run(play_one_step(env, env.make_task("train", 4), "<answer>0.3</answer>"))
        return CascadeRecord.model_validate(result.info["cascade"])

    before, after = play(), play()
    assert [(s.reused, s.cost) for s in before.stages] == [(False, 0.01), (False, 0.001)]
    assert [(s.reused, s.cost) for s in after.stages] == [(True, 0.0), (True, 0.0)]
    assert after.reward == before.reward


async def test_the_test_split_at_truth_scores_the_truth_and_the_train_split_keeps_its_cascade():
    """Threshold out of reach, the smallest audit: train episodes get the proxy alone (r = s_0), while
    ``test_split_at_truth`` runs both stages on the test split, so r = e exactly."""
    options = {
        **FAST,
        "proxy_shift": 0.15,
        "proxy_offset": 0.1,
        "pass_threshold": 1e9,
        "cascade": {"audit_probability": 1e-4, "test_split_at_truth": True},
    }
    env = make("synthetic/cascade-v0", **options)
    text = "<answer>0.5</answer>"
    test_task, train_task = env.make_task("test", 3), env.make_task("train", 3)
    held_out = CascadeRecord.model_validate((await play_one_step(env, test_task, text)).info["cascade"])
    assert [s.stage for s in held_out.stages] == ["proxy", "truth"]
    assert held_out.stages[1].run_probability == 1.0
    assert held_out.reward == pytest.approx(max(0.0, 1 - abs(0.5 - test_task.answer) / 0.25))
    trained = await play_one_step(make("synthetic/cascade-v0", **options), train_task, text)
    record = CascadeRecord.model_validate(trained.info["cascade"])
    assert [s.stage for s in record.stages] == ["proxy"]
    assert (
        trained.reward == record.values[0] != pytest.approx(max(0.0, 1 - abs(0.5 - train_task.answer) / 0.25))
    )


def test_the_default_targets_are_todays_draws_bit_for_bit():
    env = make("synthetic/cascade-v0")
    drawn = [env.make_task(split, seed).answer for split, seed in [("train", 0), ("train", 7), ("test", 3)]]
    # recorded from the env before target_low/target_high existed
    assert drawn == [0.7893371629727243, 0.8624576161277666, 0.8603679804253543]


def test_a_target_band_maps_the_same_draws_onto_it():
    default, band = (
        make("synthetic/cascade-v0"),
        make("synthetic/cascade-v0", target_low=0.3, target_high=0.4),
    )
    for seed in range(50):
        t = band.make_task("train", seed)
        u = (default.make_task("train", seed).answer - 0.1) / 0.8  # the one uniform draw behind both
        assert t.answer == pytest.approx(0.3 + 0.1 * u, abs=1e-12)
        assert 0.3 <= t.answer <= 0.4 and t.prompt["hint"] == round(t.answer, 2)
    assert make("synthetic/cascade-v0", target_low=0.5, target_high=0.5).make_task("test", 9).answer == 0.5


@pytest.mark.parametrize("band", [{"target_low": 0.6, "target_high": 0.4}, {"target_high": 1.2}])
def test_a_band_that_is_not_one_is_a_config_error(band):
    with pytest.raises(ConfigError, match="target_"):
        make("synthetic/cascade-v0", **band)

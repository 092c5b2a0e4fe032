from __future__ import annotations

import json
import re

import pytest

from labrl.cli import main
from labrl.envs import Action, check_env


@pytest.mark.parametrize("env_id", ["test/echo-v0", "test/calculator-v0"])
def test_well_behaved_envs_pass(env_id):
    report = check_env(env_id, seeds=4)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert [c.name for c in report.checks] == [
        "spec",
        "determinism",
        "splits",
        "json",
        "timeout",
        "invalid_action",
        "gold",
        "max_turns",
        "rewards",
        "cascade",
        "event_loop",
    ]
    gold = next(c for c in report.checks if c.name == "gold")
    assert gold.detail == "gold scores 1.0 on 3 tasks"


def test_checker_catches_a_nondeterministic_env(monkeypatch):
    from labrl_test_envs import EchoEnv

    counter = iter(range(10_000))
    monkeypatch.setattr(
        EchoEnv,
        "make_task",
        lambda self, split, seed, _orig=EchoEnv.make_task: _orig(self, split, seed + next(counter)),
    )
    report = check_env("test/echo-v0", seeds=2)
    determinism = next(c for c in report.checks if c.name == "determinism")
    assert not report.passed and not determinism.passed
    assert determinism.detail == "make_task('train', 0) differs between two calls"


def test_checker_catches_garbage_scored_as_ok(monkeypatch):
    from labrl_test_envs import EchoEnv

    async def lenient_step(self, action: Action):
        from labrl.envs import StepResult

        return StepResult(reward=0.0, done=True)

    monkeypatch.setattr(EchoEnv, "step", lenient_step)
    report = check_env("test/echo-v0", seeds=2)
    failed = {c.name: c.detail for c in report.checks if not c.passed}
    assert failed["invalid_action"] == "garbage action '' gave outcome ok, not invalid_action"
    assert failed["gold"] == "gold answer on test seed 0 scored 0.0, not 1.0"


def test_checker_catches_a_leaky_split(monkeypatch):
    from labrl_test_envs import EchoEnv

    original = EchoEnv.make_task
    monkeypatch.setattr(
        EchoEnv,
        "make_task",
        lambda self, split, seed: original(self, "train", seed).model_copy(
            update={"split": split, "task_id": f"{split}-{seed}"}
        ),
    )
    report = check_env("test/echo-v0", seeds=3)
    splits = next(c for c in report.checks if c.name == "splits")
    assert splits.detail == "3 task(s) appear in both train and test with the same content"


def test_cli_check_json_and_exit_codes(capsys, monkeypatch):
    assert main(["envs", "check", "test/echo-v0", "--seeds", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report[0]["env_id"] == "test/echo-v0" and report[0]["passed"] is True
    from labrl_test_envs import EchoEnv

    async def crash(self, action):
        raise RuntimeError("boom")

    monkeypatch.setattr(EchoEnv, "step", crash)
    assert main(["envs", "check", "test/echo-v0", "--seeds", "2"]) == 1
    assert "FAIL test/echo-v0" in capsys.readouterr().out


def test_checker_fails_an_env_that_blocks_the_event_loop():
    report = check_env("test/blocking-v0", seeds=2)
    loop = next(c for c in report.checks if c.name == "event_loop")
    assert not report.passed and not loop.passed
    assert re.match(
        r"step on train seed \d blocked the event loop for 1\.\d\d s \(limit 0\.5 s\)", loop.detail
    )
    assert all(c.passed for c in report.checks if c.name not in ("event_loop", "timeout")), report.checks


def test_checker_fails_an_env_with_a_nan_reward():
    report = check_env("test/nan-reward-v0", seeds=2)
    rewards = next(c for c in report.checks if c.name == "rewards")
    assert not report.passed and not rewards.passed
    assert "non-finite reward" in rewards.detail and "reward nan" in rewards.detail


async def test_nan_reward_is_verifier_failed_not_trained():
    from labrl.envs import Outcome, make, run_episode, scripted_policy

    env = make("test/nan-reward-v0")
    episode = await run_episode(env, env.make_task("train", 0), scripted_policy(["ANSWER: wrong"]))
    assert episode.outcome is Outcome.VERIFIER_FAILED and episode.reward is None

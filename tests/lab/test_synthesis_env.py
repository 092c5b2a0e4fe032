"""lab/synthesis-v0 and lab/synthesis-multiturn-v0: end to end against the mock lab."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopback_lab import serve_mock_lab

import labrl.envs
from labrl.envs.actions import parse_action
from labrl.envs.checker import check_env_async
from labrl.envs.lab import SynthesisEnv, SynthesisMultiTurnEnv
from labrl.envs.lab.session import close_connections
from labrl.envs.types import Action, Outcome
from labrl.errors import ConfigError
from labrl.lab_adapters.recipes import gold_recipe

from .conftest import TOKEN


def answer(recipe: dict) -> Action:
    return Action(text=f"I propose:\n<answer>{json.dumps(recipe)}</answer>")


@pytest.fixture
def loopback_lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, object]]:
    monkeypatch.setenv("LABRL_MOCK_LAB_TOKEN", TOKEN)
    monkeypatch.setenv("LABRL_LAB_API_KEY", TOKEN)
    with serve_mock_lab(tmp_path / "lab", latency_median_s=0.05) as served:
        yield served


async def test_end_to_end_over_loopback_http(loopback_lab, tmp_path):
    url, asgi = loopback_lab
    env = labrl.envs.make("lab/synthesis-v0", lab_url=url, journal_path=str(tmp_path / "journal.sqlite"))
    try:
        task = env.make_task("train", 0)
        target = task.metadata["target"]
        await env.reset(task)
        good = await env.step(answer(gold_recipe(target)))
        assert good.outcome is Outcome.OK and good.done and good.reward == 1.0
        assert good.info["target_fraction"] >= 0.95

        # a recipe that only half reacts (too cold, too short) scores less, label-free
        env2 = labrl.envs.make("lab/synthesis-v0", lab_url=url, journal_path=str(tmp_path / "journal.sqlite"))
        await env2.reset(task)
        bad_recipe = {
            **gold_recipe(target),
            "temperature_c": gold_recipe(target)["temperature_c"] - 250,
            "time_h": 2,
        }
        bad = await env2.step(answer(bad_recipe))
        assert bad.outcome is Outcome.OK and 0.0 <= bad.reward < good.reward
        await env2.close()
    finally:
        await env.close()
        await close_connections()
    stats = asgi.app.state.lab.stats()  # the lab's own count: two experiments, each run once
    assert (stats["jobs"], stats["max_runs_per_job"], stats["states"]) == (2, 1, {"completed": 2})


@pytest.mark.slow
async def test_gold_beats_bad_recipes_on_every_target():
    env = SynthesisEnv()
    try:
        for split in ("train", "test"):
            for seed in range(len(env.tasks[split])):
                task = env.make_task(split, seed)
                target = task.metadata["target"]
                await env.reset(task)
                gold = await env.step(answer(gold_recipe(target)))
                bad = [{**gold_recipe(target), "temperature_c": 100}]
                if gold_recipe(target)["atmosphere"] != "air":  # metals and sulfides in air: oxides, lost S
                    bad.append({**gold_recipe(target), "atmosphere": "air"})
                rewards = []
                for recipe in bad:
                    await env.reset(task)
                    rewards.append((await env.step(answer(recipe))).reward)
                assert gold.reward == 1.0 and max(rewards) < 0.5, (target, rewards)
    finally:
        await close_connections()


async def test_invalid_recipes_are_invalid_actions():
    env = labrl.envs.make("lab/synthesis-v0")
    try:
        task = env.make_task("train", 1)
        cases = [
            ("no recipe here", "no JSON answer found in the reply"),
            (
                json.dumps(
                    {
                        "precursors": [{"formula": "Qq", "mmol": 1}],
                        "temperature_c": 900,
                        "time_h": 1,
                        "atmosphere": "air",
                    }
                ),
                "formula 'Qq': 'Qq' is not an element symbol",
            ),
            (
                json.dumps({**gold_recipe("CaTiO3_62"), "temperature_c": -500}),
                "invalid recipe: temperature_c: Input should be greater than or equal to 20",
            ),
            (
                json.dumps({**gold_recipe("CaTiO3_62"), "temperature_c": float("nan")}),
                "invalid recipe: temperature_c:",
            ),
            (
                json.dumps({**gold_recipe("CaTiO3_62"), "time_h": 0}),
                "invalid recipe: time_h: Input should be greater than 0",
            ),
            ('<tool_call>{"name": 1}</tool_call>', 'tool call 0 must be an object with a string "name"'),
        ]
        for text, message in cases:
            await env.reset(task)
            result = await env.step(Action(text=text) if "tool_call" not in text else parse_action(text))
            assert result.outcome is Outcome.INVALID_ACTION and result.reward == 0.0 and result.done
            assert message in result.observation.messages[0].content, result.observation.messages[0].content
    finally:
        await env.close()
        await close_connections()


async def test_multiturn_revision_path():
    env = labrl.envs.make("lab/synthesis-multiturn-v0")
    try:
        task = env.make_task("train", 0)
        target = task.metadata["target"]
        obs = await env.reset(task)
        assert "You have 3 experiments" in obs.messages[0].content
        # 1: too cold -> mostly precursors; the model sees peaks and the phase analysis
        first = await env.step(
            answer({**gold_recipe(target), "temperature_c": gold_recipe(target)["temperature_c"] - 300})
        )
        assert first.outcome is Outcome.OK and not first.done and first.reward < 0.5
        report = first.observation.messages[0].content
        assert report.startswith("XRD peaks 2θ:I ") and "Phase analysis (weight fractions):" in report
        assert report.endswith("2 experiment(s) left: send a revised recipe.")
        # 2: an invalid recipe costs a turn, not an experiment
        second = await env.step(Action(text='<answer>{"precursors": []}</answer>'))
        assert second.outcome is Outcome.INVALID_ACTION and not second.done
        # 3: the revised (gold) recipe reaches full reward; step rewards sum to the best score
        third = await env.step(answer(gold_recipe(target)))
        assert third.outcome is Outcome.OK and third.done
        assert first.reward + third.reward == pytest.approx(1.0)
        assert third.info["experiment"] == 2
    finally:
        await env.close()
        await close_connections()


async def test_deterministic_per_seed_and_options():
    env = SynthesisEnv()
    task = env.make_task("test", 2)
    assert task == env.make_task("test", 2) and task.split == "test"
    assert {env.make_task("test", s).metadata["target"] for s in range(3)} == {
        "ZrSiO4_141",
        "CuAu_123",
        "MoS2_194",
    }
    rewards = []
    try:
        for _ in range(2):
            e = SynthesisEnv()
            await e.reset(task)
            rewards.append((await e.step(env.random_action(task, random.Random(4)))).reward)
    finally:
        await close_connections()
    assert rewards[0] == rewards[1]
    with pytest.raises(ConfigError, match=re.escape("unknown target(s) ['NaCl_225']")):
        SynthesisEnv(targets=["NaCl_225"])
    with pytest.raises(ConfigError, match=re.escape("lab/synthesis-v0 runs one experiment")):
        SynthesisEnv(max_experiments=3)
    assert SynthesisMultiTurnEnv().spec.budgets.max_turns == 3
    assert SynthesisEnv().spec.budgets.pools == {"lab": 8}


def test_real_lab_needs_its_api_key(monkeypatch):
    monkeypatch.delenv("LABRL_LAB_API_KEY", raising=False)
    with pytest.raises(
        ConfigError, match=re.escape("lab API key missing: set the environment variable LABRL_LAB_API_KEY")
    ):
        SynthesisEnv(lab_url="http://127.0.0.1:9")


@pytest.mark.slow
async def test_checker_passes_for_both_envs():
    for env_id in ("lab/synthesis-v0", "lab/synthesis-multiturn-v0"):
        report = await check_env_async(env_id, seeds=4)
        assert report.passed, [(c.name, c.detail) for c in report.checks if not c.passed]
    await close_connections()
    await asyncio.sleep(0)

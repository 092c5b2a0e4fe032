"""The v1 xrd envs: cited library, experimental answers, v1 physics in measurement, tools and fit."""

from __future__ import annotations

import json
import math

import pytest

from labrl.envs.checker import check_env_async
from labrl.envs.registry import make
from labrl.envs.types import Action, Outcome, ToolCall
from labrl.envs.xrd.tasks import MONOCHROMATOR_TWO_THETA
from labrl.verifiers.xrd.library import load_library


@pytest.mark.parametrize("env_id", ["xrd/phase-id-v1", "xrd/phase-id-tools-v1"])
async def test_contract_checker_passes_v1(env_id):
    report = await check_env_async(env_id, seeds=3, offload=False)
    assert report.passed, [c for c in report.checks if not c.passed]


@pytest.mark.parametrize("tier", [1, 2, 3])
def test_v1_answers_are_experimental_v1_phases(tier):
    env = make("xrd/phase-id-v1", tier=tier, offload=False)
    library = load_library("v1")
    for seed in range(25):
        task = env.make_task("train", seed)
        for p in task.answer["phases"]:
            assert library.get(p["id"]).experimental, p["id"]
        sample = task.prompt["sample"]
        assert sample["instrument"]["anomalous_dispersion"] is True
        assert sample["instrument"]["monochromator_two_theta"] == MONOCHROMATOR_TWO_THETA
        assert all(0.2 <= c["b_iso"] <= 1.0 for c in sample["components"])
    # the same option on the v0 env (default all) may draw hypothetical answers
    v0 = make("xrd/phase-id-v0", library="v1", offload=False)
    drawn = {v0.make_task("train", s).answer["phases"][0]["id"] for s in range(60)}
    assert any(not library.get(pid).experimental for pid in drawn)


async def test_v1_gold_scores_one_and_prompt_names_ka1():
    env = make("xrd/phase-id-v1", tier=2, offload=False)
    task = env.make_task("test", 2)
    obs = await env.reset(task)
    assert "Cu Ka1 1.54056" in obs.messages[0].content
    result = await env.step(env.gold_actions(task)[0])
    assert (result.outcome, result.reward) == (Outcome.OK, 1.0)


async def test_v1_simulate_tool_reports_ka1_positions():
    env = make("xrd/phase-id-tools-v1", tier=2, offload=False)
    task = env.make_task("test", 0)
    await env.reset(task)
    call = ToolCall(id="c", name="simulate", arguments={"phase_id": "Si_227_cF8"})
    reply = json.loads((await env.step(Action(text="", tool_calls=(call,)))).observation.messages[0].content)
    first = reply["peaks"][0][0]
    ka1 = 2 * math.degrees(math.asin(1.54056 / (2 * 5.431195 / math.sqrt(3))))
    averaged = 2 * math.degrees(math.asin(1.54184 / (2 * 5.431195 / math.sqrt(3))))
    assert first == pytest.approx(round(ka1, 2), abs=1e-9)
    assert abs(first - averaged) > 0.02
    assert reply["wavelength"].startswith("Ka1 1.54056")


@pytest.mark.parametrize("tier", [1, 2, 3])
async def test_v1_label_free_reward_of_gold_answers_is_at_least_0_9(tier):
    """The v1 envs score with the v1 fit (per-phase B, the task's dispersion and monochromator)."""
    env = make("xrd/phase-id-v1", tier=tier, reward_mode="label_free", offload=False)
    for seed in range(6):
        task = env.make_task("test", seed)
        await env.reset(task)
        result = await env.step(env.gold_actions(task)[0])
        assert result.reward >= 0.9, (seed, result.info["fit"])
        assert result.info["fit"]["version"] == "v1" and result.info["fit"]["b_iso"]
        assert result.info["fit"]["superfluous"] == []

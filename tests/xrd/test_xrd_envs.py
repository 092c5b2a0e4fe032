"""The xrd envs through the registry and the contract checker."""

from __future__ import annotations

import json
import re
import time

import pytest

from labrl.envs.actions import format_tool_call, parse_action
from labrl.envs.checker import check_env_async
from labrl.envs.registry import make
from labrl.envs.types import Action, Outcome
from labrl.errors import ConfigError
from labrl.verifiers.xrd.library import is_held_out, load_library


@pytest.mark.parametrize("env_id", ["xrd/phase-id-v0", "xrd/phase-id-tools-v0"])
async def test_contract_checker_passes(env_id):
    report = await check_env_async(env_id, seeds=4, offload=False)
    assert report.passed, [c for c in report.checks if not c.passed]


async def test_tier1_prompt_is_compact_and_gold_scores_one():
    env = make("xrd/phase-id-v0", offload=False)
    for seed in range(5):
        task = env.make_task("train", seed)
        obs = await env.reset(task)
        (message,) = obs.messages
        assert len(message.content) < 400
        assert "A) " in message.content and "D) " in message.content
        result = await env.step(Action(text=task.answer["letter"]))
        assert (result.outcome, result.reward, result.done) == (Outcome.OK, 1.0, True)


async def test_offloaded_reset_matches_inline():
    task = make("xrd/phase-id-v0", tier=2).make_task("test", 3)
    pooled = await make("xrd/phase-id-v0", tier=2).reset(task)
    inline = await make("xrd/phase-id-v0", tier=2, offload=False).reset(task)
    assert pooled == inline


async def test_tier3_label_free_and_blend_rewards():
    env = make("xrd/phase-id-v0", tier=3, reward_mode="label_free", offload=False)
    task = env.make_task("train", 1)
    assert 2 <= len(task.answer["phases"]) <= 3
    assert sum(p["weight_fraction"] for p in task.answer["phases"]) == pytest.approx(1.0)
    await env.reset(task)
    gold = await env.step(env.gold_actions(task)[0])
    # per-phase crystallite sizes and texture are fitted with one global size: gold is good, not perfect
    assert gold.outcome is Outcome.OK and gold.reward > 0.6
    wrong = make("xrd/phase-id-v0", tier=3, reward_mode="label_free", offload=False)
    await wrong.reset(task)
    rnd = await wrong.step(
        Action(text='{"phases": [{"formula": "NaCl", "space_group": 225, "weight_fraction": 1}]}')
    )
    assert rnd.reward < gold.reward
    assert set(gold.info["fit"]["weight_fractions"]) == {p["id"] for p in task.answer["phases"]}
    blend = make("xrd/phase-id-v0", tier=3, reward_mode="blend", blend_weight=0.5, offload=False)
    await blend.reset(task)
    mixed = await blend.step(blend.gold_actions(task)[0])
    assert mixed.reward == pytest.approx(0.5 * 1.0 + 0.5 * gold.reward)


async def test_garbage_and_out_of_library_are_invalid_actions():
    env = make("xrd/phase-id-v0", tier=2, offload=False)
    task = env.make_task("train", 0)
    await env.reset(task)
    result = await env.step(parse_action('{"phases": [{"formula": "Na3Cl"}]}'))
    assert result.outcome is Outcome.INVALID_ACTION
    assert (
        result.observation.messages[0].content
        == "Invalid action: no phase with formula 'Na3Cl' in the phase library"
    )


async def test_tools_episode_search_simulate_fit_submit():
    env = make("xrd/phase-id-tools-v0", tier=2, offload=False, max_tool_calls=3)
    task = env.make_task("train", 2)
    truth = task.answer["phases"][0]
    await env.reset(task)
    calls = "".join(
        [
            format_tool_call("search_phases", {"elements": task.prompt["elements"]}),
            format_tool_call("simulate", {"phase_id": truth["id"]}),
            format_tool_call("fit", {"phase_ids": [truth["id"]]}),
        ]
    )
    result = await env.step(parse_action(calls))
    assert result.outcome is Outcome.OK and not result.done
    search, simulate, fit = (json.loads(m.content) for m in result.observation.messages)
    assert truth["id"] in [row["id"] for row in search["phases"]]
    assert len(simulate["peaks"]) <= 10
    assert fit["rwp"] < fit["rwp_background_only"] and fit["weight_fractions"] == {truth["id"]: 1.0}
    over = await env.step(parse_action(format_tool_call("simulate", {"phase_id": truth["id"]})))
    assert over.outcome is Outcome.INVALID_ACTION
    assert "tool-call budget of 3 used up: call submit" in over.observation.messages[0].content
    answer = {"phases": [{"formula": truth["formula"], "space_group": truth["space_group"]}]}
    done = await env.step(parse_action(format_tool_call("submit", {"answer": answer})))
    assert (done.outcome, done.reward, done.done) == (Outcome.OK, 1.0, True)


async def test_unknown_tool_message():
    env = make("xrd/phase-id-tools-v0", offload=False)
    task = env.make_task("train", 0)
    await env.reset(task)
    result = await env.step(parse_action(format_tool_call("refine", {})))
    assert result.observation.messages[0].content == (
        "Invalid action: unknown tool 'refine'; available: search_phases, simulate, fit, submit"
    )


def test_holdout_phases_never_in_train():
    env = make("xrd/phase-id-v0", tier=3, holdout_fraction=0.2, checked=False)
    for seed in range(30):
        train = env.make_task("train", seed).metadata["phases"]
        test = env.make_task("test", seed).metadata["phases"]
        assert not any(is_held_out(p, 0.2) for p in train)
        assert is_held_out(test[0], 0.2)
    assert 0.1 < sum(is_held_out(p.id, 0.2) for p in load_library()) / len(load_library()) < 0.3


def test_tasks_deterministic_and_split_disjoint():
    env = make("xrd/phase-id-v0", tier=2, checked=False)
    assert env.make_task("train", 5) == env.make_task("train", 5)
    assert env.make_task("train", 5).prompt != env.make_task("test", 5).prompt


def test_bad_option_names_field():
    with pytest.raises(
        ConfigError, match=re.escape("xrd/phase-id-v0: invalid option(s): tier: Input should be 1, 2 or 3")
    ):
        make("xrd/phase-id-v0", tier=4)


async def test_instrument_latency_is_awaited_not_blocking():
    env = make("xrd/phase-id-v0", instrument_latency_s=0.2, offload=False)
    task = env.make_task("train", 0)
    t0 = time.perf_counter()
    await env.reset(task)
    assert time.perf_counter() - t0 >= 0.2


async def test_tasks_are_labelled_by_gold_phase_and_episodes_by_the_claimed_one():
    from labrl.envs.episode import run_episode, scripted_policy
    from labrl.harness.rollout.play import episode_labels

    options = {"tier": 1, "n_candidates": 4, "phase_pool": 8, "answer_format": "formula", "offload": False}
    env = make("xrd/phase-id-v0", **options)
    task = env.make_task("test", 0)
    assert task.prompt["candidates"] == {"A": "CaSi6_166", "B": "Sr7Ge_225", "C": "Os_194", "D": "GeF4_217"}
    assert env.task_label(task) == "GeF4_217"
    for reply, answer in (("GeF4", "GeF4_217"), ("Os", "Os_194"), ("C", "Os_194"), ("no idea", "(unparsed)")):
        episode = await run_episode(make("xrd/phase-id-v0", **options), task, scripted_policy([reply]))
        assert episode_labels(env, episode) == {"task_label": "GeF4_217", "answer_label": answer}, reply

    mixtures = make("xrd/phase-id-v0", tier=3, offload=False)
    task = mixtures.make_task("test", 0)
    assert [p["id"] for p in task.answer["phases"]] == ["ZrNi_11", "MgNi2_194"]
    assert mixtures.task_label(task) == "MgNi2_194+ZrNi_11"
    gold = await run_episode(mixtures, task, scripted_policy(mixtures.gold_actions(task)))
    assert episode_labels(mixtures, gold) == {
        "task_label": "MgNi2_194+ZrNi_11",
        "answer_label": "MgNi2_194+ZrNi_11",
    }

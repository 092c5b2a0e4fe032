from __future__ import annotations

import asyncio

from labrl.envs import Episode, Outcome, format_tool_call, make, run_episode, scripted_policy


async def test_multi_turn_episode_transcript_and_reward():
    env = make("test/calculator-v0")
    task = env.make_task("test", 2)
    a, b, c = task.prompt["numbers"]
    policy = scripted_policy(
        [format_tool_call("add", {"a": a, "b": b}), format_tool_call("submit", {"answer": a + b + c})]
    )
    episode = await run_episode(env, task, policy)
    assert episode.outcome is Outcome.OK and episode.reward == 1.0 and episode.done and not episode.truncated
    assert [m.role for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.messages[2].content == str(a + b)
    assert episode.num_turns == 2
    assert Episode.model_validate_json(episode.model_dump_json()) == episode


async def test_policy_sees_tools_and_growing_transcript():
    env = make("test/calculator-v0", max_turns=3)
    task = env.make_task("train", 0)
    seen = []

    async def policy(messages, tools):
        seen.append((len(messages), [t.name for t in tools]))
        return format_tool_call("add", {"a": 1, "b": 1})

    episode = await run_episode(env, task, policy)
    assert seen == [(1, ["add", "submit"]), (3, ["add", "submit"]), (5, ["add", "submit"])]
    assert episode.truncated and episode.reward == 0.0 and episode.outcome is Outcome.OK


async def test_failed_reset_is_recorded_not_raised():
    env = make("test/crashing-v0", where="reset")
    episode = await run_episode(env, env.make_task("train", 0), scripted_policy(["ANSWER: x"]))
    assert episode.outcome is Outcome.ENV_ERROR and episode.reward is None and episode.turns == ()
    assert "missing instrument calibration" in episode.error


async def test_timeout_episode_has_no_reward():
    env = make("test/slow-v0", delay=2.0, budgets={"step_timeout_s": 0.1})
    episode = await run_episode(env, env.make_task("train", 0), scripted_policy(["ANSWER: x"]))
    assert episode.outcome is Outcome.TIMEOUT and episode.reward is None
    assert episode.timings["env_s"] >= 0.1


async def test_thousand_slow_episodes_overlap():
    """Env latency is hidden by concurrency: 1,000 episodes of 0.2 s steps take ~0.2 s, not 200 s."""

    async def one(seed: int) -> float:
        env = make("test/echo-v0", step_delay=0.2)
        task = env.make_task("train", seed)
        episode = await run_episode(env, task, scripted_policy([f"ANSWER: {task.answer}"]))
        return episode.reward

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    rewards = await asyncio.gather(*(one(s) for s in range(1000)))
    assert rewards == [1.0] * 1000
    assert loop.time() - t0 < 5.0

from __future__ import annotations

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from labrl.envs.gym_adapter import GymnasiumEnv, render_messages
from labrl.envs.types import Message


@pytest.mark.parametrize("env_id", ["test/echo-v0", "test/calculator-v0"])
def test_passes_gymnasiums_own_checker(env_id):
    env = GymnasiumEnv(env_id)
    gymnasium_check_env(env, skip_render_check=True)
    env.close()


def test_episode_through_gymnasium_api():
    env = GymnasiumEnv("test/echo-v0", split="test")
    obs, info = env.reset(seed=4)
    task = env.env.make_task("test", 4)
    assert obs == f"[user] Say {task.answer} as 'ANSWER: <word>'" and info["task_id"] == "echo-test-4"
    obs, reward, terminated, truncated, info = env.step(f"ANSWER: {task.answer}")
    assert (reward, terminated, truncated, info["outcome"]) == (1.0, True, False, "ok")
    with pytest.raises(gymnasium.error.ResetNeeded):
        env.step("again")
    env.close()


def test_non_ascii_is_escaped_into_the_charset():
    text = render_messages((Message(role="user", content="d = 3.5 Å, 2θ"),), 100)
    assert text == "[user] d = 3.5 \\xc5, 2\\u03b8"
    assert render_messages((Message(role="user", content="x" * 50),), 10) == "[user] xxx"

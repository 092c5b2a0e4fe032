"""labrl envs in Gymnasium's own registry: gymnasium.make finds them under the labrl/ namespace."""

from __future__ import annotations

import subprocess
import sys

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from labrl.envs import deregister, gym_adapter, register, registered_ids
from labrl.envs.gym_adapter import gymnasium_id, labrl_id, register_gymnasium_envs
from labrl.errors import RegistryError


def test_mapping_is_documented_and_one_to_one():
    assert gymnasium_id("xrd/phase-id-v0") == "labrl/xrd-phase-id-v0"
    assert gymnasium_id("lab/synthesis-multiturn-v0") == "labrl/lab-synthesis-multiturn-v0"
    table = register_gymnasium_envs()
    assert sorted(table.values()) == registered_ids()  # every labrl env, each once
    for gym_id, env_id in table.items():
        assert gymnasium_id(env_id) == gym_id and labrl_id(gym_id) == env_id
        assert gymnasium.spec(gym_id).kwargs == {"env": env_id}


def test_gymnasium_make_and_its_checker():
    env = gymnasium.make("labrl/xrd-phase-id-v0", tier=1, split="test")
    try:
        check_env(env.unwrapped, skip_render_check=True)
        observation, info = env.reset(seed=5)
        assert observation.startswith("[user] XRD") and info["task_id"].startswith("xrd/phase-id-v0:t1:test:")
        _, reward, terminated, truncated, info = env.step("not an answer")
        assert not truncated
        assert (reward, terminated, info["outcome"]) == (0.0, True, "invalid_action")
    finally:
        env.close()


def test_fresh_interpreter_finds_envs_through_the_module_prefix():
    code = (
        "import gymnasium\n"
        "env = gymnasium.make('labrl.envs.gym_adapter:labrl/xrd-phase-id-v0')\n"
        "obs, info = env.reset(seed=1)\n"
        "print(info['task_id'])\n"
        "env.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "xrd/phase-id-v0:t1:train:1"


def test_two_ids_mapping_to_one_gymnasium_id_are_refused():
    register("ab-c/de-v0", entry_point="labrl_test_envs:EchoEnv", source="tests")
    register("ab/c-de-v0", entry_point="labrl_test_envs:EchoEnv", source="tests")
    try:
        with pytest.raises(RegistryError, match="both map to the Gymnasium id labrl/ab-c-de-v0"):
            register_gymnasium_envs()
    finally:
        deregister("ab-c/de-v0")
        deregister("ab/c-de-v0")
        gym_adapter._GYM_TO_LABRL.pop("labrl/ab-c-de-v0", None)  # leave both registries as found
        gymnasium.registry.pop("labrl/ab-c-de-v0", None)

from __future__ import annotations

import re

import pytest

from labrl.envs import make
from labrl.errors import ConfigError


def _phases_seen(env, split, n):
    seen = set()
    for seed in range(n):
        task = env.make_task(split, seed)
        seen.update(task.prompt["candidates"].values())
    return seen


def test_phase_pool_restricts_answers_and_candidates_to_a_fixed_subset():
    env = make("xrd/phase-id-v0", tier=1, phase_pool=8, offload=False)
    train, test = _phases_seen(env, "train", 60), _phases_seen(env, "test", 60)
    assert len(train) == 8 and train == test  # same 8 phases on both splits, different tasks
    again = _phases_seen(make("xrd/phase-id-v0", tier=1, phase_pool=8, offload=False), "train", 60)
    assert again == train
    assert len(_phases_seen(make("xrd/phase-id-v0", tier=1, offload=False), "train", 60)) > 8


def test_phase_pool_larger_than_library_is_a_config_error():
    env = make("xrd/phase-id-v0", tier=1, phase_pool=100_000, offload=False)
    with pytest.raises(ConfigError, match=re.escape("phase_pool=100000 exceeds the library's")):
        env.make_task("train", 0)

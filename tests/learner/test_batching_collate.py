import re

import numpy as np
import pytest

from labrl.errors import ConfigError
from labrl.harness.rollout.batching import collate
from labrl.harness.types import Trajectory


def _traj(tokens, mask, reward=1.0, group="g", routed=True):
    n = len(tokens)
    return Trajectory(
        env_id="test/x-v0", task_id=f"t{n}", group_id=group, tokens_T=tokens, loss_mask_T=mask,
        logprobs_T=[-0.5 if m else 0.0 for m in mask], versions_T=[3 if m else -1 for m in mask],
        reward=reward, outcome="ok", finish_reason="stop", num_turns=1,
        routed_experts_T_L_K=np.full((n, 2, 2), 5, dtype=np.int32) if routed else None,
    )  # fmt: skip


def test_collate_pads_right_and_renumbers_groups():
    batch = collate(
        [_traj([1, 2, 3], [0, 1, 1], group="x"), _traj([4, 5], [0, 1], 0.0, group="y")], 9, pad_to_multiple=4
    )
    assert batch.tokens_B_T.tolist() == [[1, 2, 3, 9], [4, 5, 9, 9]]
    assert batch.attention_mask_B_T.tolist() == [[True, True, True, False], [True, True, False, False]]
    assert batch.loss_mask_B_T.tolist() == [[False, True, True, False], [False, True, False, False]]
    assert batch.versions_B_T.tolist() == [[-1, 3, 3, -1], [-1, 3, -1, -1]]
    assert batch.behaviour_logprobs_B_T[0].tolist() == [0.0, -0.5, -0.5, 0.0]
    assert batch.group_ids_B.tolist() == [0, 1] and batch.rewards_B.tolist() == [1.0, 0.0]
    assert batch.routed_experts_B_T_L_K.shape == (2, 4, 2, 2)
    assert batch.routed_experts_B_T_L_K[1, 2].tolist() == [[0, 1], [0, 1]]  # padding routes to 0..K-1
    assert batch.routed_experts_B_T_L_K[1, 1].tolist() == [[5, 5], [5, 5]]


def test_collate_refuses_untrainable_and_mixed_routing():
    with pytest.raises(
        ConfigError, match=re.escape("1 trajectories have no reward (outcome not trainable), e.g. task 't2'")
    ):
        collate([_traj([1, 2], [0, 1], reward=None)], 0)
    with pytest.raises(ConfigError, match=re.escape("1 of 2 trajectories lack routed experts")):
        collate([_traj([1, 2], [0, 1]), _traj([1, 2, 3], [0, 1, 1], routed=False)], 0)
    with pytest.raises(ConfigError, match=re.escape("collate needs at least one trajectory")):
        collate([], 0)

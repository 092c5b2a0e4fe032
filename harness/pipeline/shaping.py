"""Training-reward shaping that belongs to the run, not to the env: the reward of an invalid action.

An env ends an episode on an unusable answer with its own ``invalid_action_reward``
(0 for every shipped env, the same as a wrong answer). ``pipeline.invalid_action_reward``
replaces it for *training* only; held-out evaluation scores what the env says.

Why a run would want it below 0: with GRPO's group baseline, a group whose
answers are all wrong carries no signal, even when some of them named no listed
candidate at all. Scoring those at ``-p`` splits the group into
``{-p: invalid, 0: valid but wrong}``, and the advantage then moves probability
onto the answers the task allows, among them the right one. Under ``grpo``'s
per-group std normalisation a two-valued group gets full-size advantages whatever
``p`` is; ``p`` sets how much an invalid answer weighs against a wrong one only in
groups that also hold a correct answer::

    group {-p, 0, 1}:  A_i = (R_i - mean_g) / std_g
"""

from __future__ import annotations

import dataclasses

from labrl.envs.types import Outcome
from labrl.harness.types import Trajectory


def shape_invalid_action(traj: Trajectory, reward: float | None) -> Trajectory:
    """``traj`` scored ``reward`` if it ended on an invalid action; unchanged when ``reward`` is None
    (the env's own reward) or the episode ended otherwise (an unscored episode stays unscored)."""
    if reward is None or traj.reward is None or traj.outcome != Outcome.INVALID_ACTION.value:
        return traj
    return dataclasses.replace(traj, reward=float(reward))

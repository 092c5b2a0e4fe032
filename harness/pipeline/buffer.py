"""The group buffer: finished groups wait here until the learner takes a batch of them.

A *group* is the G rollouts of one task. When a group arrives:

- members whose outcome is not trainable (timeout, env_error,
  verifier_failed: ``reward is None``) are masked out of the group and
  counted, never scored 0;
- with dynamic sampling on, a group whose trainable rewards all agree (or
  that has fewer than 2 trainable members) carries no learning signal under a
  group-relative advantage: it is dropped and counted, and the producer
  starts another task in its place (oversampling), so every batch is full;
- otherwise the group is kept, in arrival order.

``pop_batch`` hands the learner the ``batch_groups`` kept groups that
*started* first (lowest sampler version at start, then start time), not the
first to arrive: a group that took long is the stalest, and training it before
younger groups that overtook it keeps it nearest the staleness bound its
admission predicted (``admission``).

The buffer also remembers the verdicts of the last ``KEEP_WINDOW`` groups
(``recent_kept``), from which admission estimates the keep rate.

The whole buffer (kept groups with their trajectories, counters, recent
verdicts) is part of a checkpoint, so a resumed run trains each of them
exactly once.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Literal

from labrl.harness.types import Trajectory

Verdict = Literal["kept", "zero_variance", "untrainable"]

#: groups whose verdicts the keep-rate estimate looks at: recent enough to follow dynamic sampling
#: as the policy changes, long enough that one unlucky batch does not swing it
KEEP_WINDOW = 64


@dataclass
class Group:
    """The rollouts of one task, as they finished."""

    index: int  # position in the run's task schedule: unique, also after resume
    task_seed: int
    trajectories: list[Trajectory]
    start_version: int  # sampler version when the group started
    started_at: float = 0.0
    finished_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def trainable(self) -> list[Trajectory]:
        return [t for t in self.trajectories if t.reward is not None]


def started_first(group: Group) -> tuple[int, float, int]:
    """Sort key of ``pop_batch``: sampler version at start, then start time, then schedule index."""
    return (group.start_version, group.started_at, group.index)


ConstantKind = Literal["all_correct", "all_wrong", "constant"]


def constant_kind(rewards: list[float]) -> ConstantKind:
    """What an all-equal group says: solved every time (reward 1), failed every time (0), or another reward."""
    if min(rewards) >= 1.0 - 1e-9:
        return "all_correct"
    if max(rewards) <= 1e-9:
        return "all_wrong"
    return "constant"


def reward_spread(rewards: list[float]) -> float:
    return max(rewards) - min(rewards) if rewards else 0.0


class GroupBuffer:
    def __init__(
        self, batch_groups: int, *, dynamic_sampling: bool = True, variance_eps: float = 1e-9
    ) -> None:
        self.batch_groups = batch_groups
        self.dynamic_sampling = dynamic_sampling
        self.variance_eps = variance_eps
        self._groups: deque[Group] = deque()
        self.counters: Counter[str] = Counter()
        self.recent_kept: deque[bool] = deque(maxlen=KEEP_WINDOW)

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def ready(self) -> bool:
        return len(self._groups) >= self.batch_groups

    def classify(self, group: Group) -> Verdict:
        rewards = [float(t.reward) for t in group.trainable]  # type: ignore[arg-type]
        if not rewards:
            return "untrainable"
        if self.dynamic_sampling and (len(rewards) < 2 or reward_spread(rewards) <= self.variance_eps):
            return "zero_variance"
        return "kept"

    def add(self, group: Group) -> Verdict:
        """Classify ``group``; keep it (untrainable members removed) or drop it. Counts everything."""
        masked = [t for t in group.trajectories if t.reward is None]
        self.counters["groups_added"] += 1
        self.counters["episodes"] += len(group.trajectories)
        self.counters["episodes_masked"] += len(masked)
        for t in masked:
            self.counters[f"episodes_masked_{t.outcome}"] += 1
        verdict = self.classify(group)
        self.counters[f"groups_{verdict}"] += 1
        if verdict == "zero_variance":  # the kind tells converged tasks from collapsed ones
            rewards = [float(t.reward) for t in group.trainable]  # type: ignore[arg-type]
            self.counters[f"groups_zero_variance_{constant_kind(rewards)}"] += 1
        self.recent_kept.append(verdict == "kept")
        if verdict == "kept":
            self._groups.append(dataclasses.replace(group, trajectories=group.trainable))
        return verdict

    def pop_batch(self) -> list[Group]:
        if not self.ready:
            raise RuntimeError(
                f"pop_batch with {len(self._groups)} groups buffered, {self.batch_groups} needed"
            )
        oldest = sorted(self._groups, key=started_first)[: self.batch_groups]
        taken = {id(g) for g in oldest}
        self._groups = deque(g for g in self._groups if id(g) not in taken)
        return oldest

    def peek(self) -> list[Group]:
        return list(self._groups)

    @property
    def keep_rate(self) -> float:
        """Fraction of finished groups kept so far (1.0 before any arrived)."""
        added = self.counters["groups_added"]
        return self.counters["groups_kept"] / added if added else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": list(self._groups),
            "counters": dict(self.counters),
            "recent_kept": list(self.recent_kept),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._groups = deque(state["groups"])
        self.counters = Counter(state["counters"])
        # checkpoints written before the window existed start it empty: the estimate is then pessimistic
        self.recent_kept = deque(state.get("recent_kept", ()), maxlen=KEEP_WINDOW)

"""``run_dir/episodes.jsonl``: one line per episode, what the planner calibrates from (docs/planning.md).

::

    {"group": 12, "member": 3, "env_id": "xrd/identify-v0", "task_id": "...", "outcome": "ok",
     "reward": 1.0, "start_s": 41.2, "end_s": 44.9, "turns": 2, "generation_s": [0.8, 0.6],
     "generated_tokens": [61, 40], "env_s": [0.01, 1.9, 0.4], "version_at_start": 5,
     "token_versions": [5, 6], "fate": "trained", "version_at_train": 7, "step": 8}

- ``start_s``: when the episode's group started, on the clock of ``metrics.jsonl``'s
  ``time_s`` (training seconds, across resumes); ``end_s = start_s +`` the episode's
  own wall seconds, so ``end_s >= start_s``.
- ``generation_s[i]``, ``generated_tokens[i]``: policy turn ``i``'s sampler call;
  ``env_s``: every env call in order, ``reset`` first (``EpisodeTimeline``).
- ``version_at_start``: the sampler's version when the group started; ``token_versions``:
  the least and greatest version of its generated tokens (null when it generated none).
- ``fate``: ``trained``; ``masked`` (its outcome is not trainable, in a kept group);
  ``zero_variance`` or ``untrainable`` (its group was dropped: ``buffer``).
- ``version_at_train``: the learner's version when the step that trained it began (its
  staleness is ``version_at_train - token_versions[0]``), and ``step`` that step's number
  (as ``trained.jsonl``); an episode not trained has ``version_at_train`` null and ``step``
  the learner steps done when its group finished (as ``errors.jsonl``).

A line is written once an episode's fate is known: at the step that trains it, or
when its group is dropped or it is masked. Groups still buffered or in flight when a
run ends have no line yet (the checkpoint holds them; a resumed run writes them).

Resume: ``resume.truncate_run_logs`` drops the lines of steps after the checkpoint's
(those groups are played or trained again) and the resumed run appends. An episode
that finished after the checkpoint was written but during its step is played again
and written twice; ``read_episode_traces`` keeps the last line of each
``(group, member)``.

Cost: one dict and one ``JsonlWriter`` line per episode, on the loop, as
``metrics.jsonl`` and ``errors.jsonl`` are written; ``pipeline.episode_traces=false``
turns it off.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from labrl.harness.metrics import JsonlWriter, read_jsonl
from labrl.harness.pipeline.buffer import Group, Verdict
from labrl.harness.types import NO_VERSION, EpisodeTimeline, Trajectory

EPISODES_FILE = "episodes.jsonl"
#: ``Trajectory.info`` key of an episode's trace record as it finished (fate not yet known)
TRACE = "trace"


def finished_record(
    trajectory: Trajectory, *, group: int, member: int, version_at_start: int, start_s: float
) -> dict[str, Any]:
    """What is known of an episode when it finishes: every field but ``fate``, ``version_at_train``, ``step``."""
    timeline = trajectory.timeline or EpisodeTimeline()
    versions = [v for v in trajectory.versions_T if v != NO_VERSION]
    return {
        "group": group,
        "member": member,
        "env_id": trajectory.env_id,
        "task_id": trajectory.task_id,
        "outcome": trajectory.outcome,
        "reward": trajectory.reward,
        "start_s": start_s,
        "end_s": start_s + float(trajectory.timings.get("wall_s", 0.0)),
        "turns": trajectory.num_turns,
        "generation_s": list(timeline.generation_s),
        "generated_tokens": list(timeline.generated_tokens),
        "env_s": list(timeline.env_s),
        "version_at_start": version_at_start,
        "token_versions": [min(versions), max(versions)] if versions else None,
    }


class EpisodeTraces:
    """Appends each episode's record to ``run_dir/episodes.jsonl`` once its fate is known (module docstring)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / EPISODES_FILE
        self._writer = JsonlWriter(self.path)

    def group_finished(self, group: Group, verdict: Verdict, *, steps_done: int) -> None:
        """A dropped group's episodes, or a kept group's masked ones (its trainable ones wait for ``trained``)."""
        for t in group.trajectories:
            if verdict == "kept" and t.reward is not None:
                continue
            fate = "masked" if verdict == "kept" else verdict
            self._write(t, fate=fate, version_at_train=None, step=steps_done)

    def trained(self, groups: Iterable[Group], *, version_at_train: int, step: int) -> None:
        for group in groups:
            for t in group.trajectories:
                self._write(t, fate="trained", version_at_train=version_at_train, step=step)

    def _write(self, t: Trajectory, *, fate: str, version_at_train: int | None, step: int) -> None:
        base = t.info.get(TRACE)
        if base is None:  # a group checkpointed before traces existed
            return
        self._writer.write(base | {"fate": fate, "version_at_train": version_at_train, "step": step})

    def close(self) -> None:
        self._writer.close()


def read_episode_traces(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's episode records, the last line of each ``(group, member)``, in file order of those lines."""
    latest: dict[tuple[int, int], dict[str, Any]] = {}
    for record in read_jsonl(Path(run_dir) / EPISODES_FILE, skip_torn=True):
        key = (record["group"], record["member"])
        latest.pop(key, None)  # re-inserted: dict order is then the order of the last lines
        latest[key] = record
    return list(latest.values())

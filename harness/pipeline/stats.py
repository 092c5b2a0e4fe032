"""The pipeline's statistics: why groups are dropped (the stall guard's diagnosis), token staleness, and
the per-step metrics record.

``StepStats`` gathers what happens between two learner steps (episodes
finished, rewards, env and generation latencies, overlong flags) and turns it
into the record written to ``metrics.jsonl``:

- ``busy/learner`` = seconds inside ``train_step`` / wall seconds since the run started;
- ``busy/learner_step`` = seconds of the learner's whole step (``train_step``, the weight export
  and its publication to the sampler) / the same wall seconds: a learner-bound run steps at
  ``1 / (busy/learner_step x time_s / step)``, not at ``train_step``'s rate;
- ``busy/sampler`` = (sampler ``stats["busy_s"]`` now - at the start) / wall seconds;
- ``throughput/*`` = tokens (samples) since the previous step / seconds since it;
- ``staleness/*`` over the trained tokens: learner version at the step minus the
  version that produced the token (``token_staleness``);
- ``errors/<outcome>_frac`` = episodes finished since the previous step that
  ended in ``<outcome>`` (env_error, verifier_failed, timeout) / episodes
  finished since it (None when none finished); ``errors/<outcome>_total`` since
  the run started (this process); ``errors/by_env`` the same totals per env id;
- ``time_s`` = wall seconds of training so far, across resumes (``time_offset_s``
  is the previous processes' share, from the checkpoint).
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any

from labrl.harness.metrics import percentile
from labrl.harness.pipeline.buffer import Group, GroupBuffer, constant_kind
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.pipeline.errors_log import FAILED_OUTCOMES, normalise_message
from labrl.harness.types import NO_VERSION, ReportsSamplerStats, Sampler, Trajectory


@dataclasses.dataclass
class DropStreak:
    """The groups dropped since the last kept group (or learner step), by kind, and why their episodes failed."""

    all_correct: int = 0  # every trainable reward 1: the policy solves the task
    all_wrong: int = 0  # every trainable reward 0: the policy fails it
    constant: int = 0  # one identical partial reward
    untrainable: int = 0  # no trainable episode (timeouts, env / verifier errors)
    reward_sum: float = 0.0  # sum of the mean trainable reward of each scored dropped group
    # failed (masked) episodes of the dropped groups: "outcome: message" with numbers normalised -> count,
    # and the first such episode's own one-line message
    failures: Counter[str] = dataclasses.field(default_factory=Counter)
    failure_examples: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def count(self) -> int:
        return self.all_correct + self.all_wrong + self.constant + self.untrainable

    @property
    def scored(self) -> int:
        return self.all_correct + self.all_wrong + self.constant

    def add(self, group: Group) -> None:
        for t in group.trajectories:
            if t.reward is None:
                message = (t.info.get("error") or "no message").splitlines()[0]
                key = f"{t.outcome}: {normalise_message(message)}"
                self.failures[key] += 1
                self.failure_examples.setdefault(key, f"{t.outcome}: {message}")
        rewards = [float(t.reward) for t in group.trainable]  # type: ignore[arg-type]
        if not rewards:
            self.untrainable += 1
            return
        self.reward_sum += sum(rewards) / len(rewards)
        kind = constant_kind(rewards)
        if kind == "all_correct":
            self.all_correct += 1
        elif kind == "all_wrong":
            self.all_wrong += 1
        else:
            self.constant += 1

    def most_frequent_failure(self) -> str:
        """``in K of M failed episodes: <outcome>: <message>`` for the commonest failure (ties: the first seen)."""
        key, k = self.failures.most_common(1)[0]
        return f"in {k} of {self.failures.total()} failed episodes: {self.failure_examples[key]}"


_DIAGNOSIS = {
    "all_correct": (
        "Most dropped groups were all-correct: the policy solves these train tasks every time, so they "
        "hold nothing left to learn (the reward is not broken; training may have converged)"
    ),
    "all_wrong": (
        "Most dropped groups were all-wrong: the policy fails these train tasks every time, so "
        "group-relative advantages carry no signal (check the env's rewards, or warm-start closer to the task)"
    ),
    "constant": (
        "Most dropped groups got one identical partial reward: check that the env's reward varies with the answer"
    ),
    "untrainable": (
        "Most dropped groups had no trainable episode (timeouts, env or verifier errors); the commonest "
        "failure, {failure} (errors.jsonl has every distinct error with its count)"
    ),
}
_REMEDY = {
    "scored": (
        "To go on, raise pipeline.max_oversample_factor, or set pipeline.dynamic_sampling=false with "
        "objective.advantages=whiten (trains on every group)."
    ),
    "untrainable": (
        "To go on, fix that failure: a group with no trainable episode is dropped whatever "
        "pipeline.dynamic_sampling says; raise pipeline.max_oversample_factor only if such failures come in bursts."
    ),
}


def stall_message(streak: DropStreak, cfg: PipelineSection) -> str:
    """What the stall guard says, on one line: how many groups of which kind, why, and the knobs.

    The guard fires when ``streak.count > max_oversample_factor x batch_groups``, with dynamic
    sampling on (zero-variance and untrainable groups are dropped) or off (untrainable groups only).
    """
    kinds = {k: getattr(streak, k) for k in _DIAGNOSIS}
    dominant = max(kinds, key=lambda k: kinds[k])  # ties: the first listed
    mean = f"{streak.reward_sum / streak.scored:.3f}" if streak.scored else "n/a"
    limit = cfg.max_oversample_factor * cfg.batch_groups
    diagnosis = _DIAGNOSIS[dominant]
    if dominant == "untrainable":
        diagnosis = diagnosis.format(failure=streak.most_frequent_failure())
    return (
        f"the batch cannot fill: {streak.count} groups in a row were dropped, more than "
        f"pipeline.max_oversample_factor x pipeline.batch_groups = {cfg.max_oversample_factor:g} x "
        f"{cfg.batch_groups} = {limit:g}: {streak.all_correct} all-correct, {streak.all_wrong} all-wrong, "
        f"{streak.constant} with another constant reward, {streak.untrainable} untrainable; mean reward of "
        f"the dropped groups {mean}. {diagnosis}. {_REMEDY['untrainable' if dominant == 'untrainable' else 'scored']}"
    )


def token_staleness(trajectories: list[Trajectory], learner_version: int) -> list[int]:
    """``learner_version - version`` for every loss-mask token."""
    return [
        learner_version - v
        for t in trajectories
        for v, m in zip(t.versions_T, t.loss_mask_T, strict=True)
        if m and v != NO_VERSION
    ]


#: ``Trajectory.info`` key set on an episode played again from its transcript after a fault or a
#: resume (its tokens keep the versions of the first attempt): its staleness is counted apart
REPLAYED = "replayed"


def episodes_over_staleness(
    trajectories: list[Trajectory], learner_version: int, limit: int
) -> tuple[int, int]:
    """Episodes with at least one trained token staler than ``limit``: ``(first plays, replays)``."""
    over = [t for t in trajectories if max(token_staleness([t], learner_version), default=0) > limit]
    replayed = sum(1 for t in over if t.info.get(REPLAYED))
    return len(over) - replayed, replayed


def _new_window() -> dict[str, Any]:
    return {
        "rewards": [],
        "env_s": [],
        "generation_s": [],
        "tokens": 0,
        "episodes": 0,
        "overlong": Counter(),
        "outcomes": Counter(),
    }


def failure_rates(outcomes: Counter, episodes: int) -> dict[str, float | None]:
    """``{outcome}_frac`` for each of ``FAILED_OUTCOMES``: count / episodes (None for no episodes)."""
    return {f"{o}_frac": (outcomes[o] / episodes if episodes else None) for o in FAILED_OUTCOMES}


class StepStats:
    """Counts what happens between learner steps; ``step_record`` turns it into one metrics record."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.learner_busy_s = 0.0
        self.learner_step_s = 0.0  # train_step + export + publish (busy/learner_step)
        self.time_offset_s = 0.0  # training seconds of earlier processes of this run (resume)
        self._window = _new_window()
        self._outcomes_by_env: dict[str, Counter] = {}
        self.start()

    def start(self) -> None:
        """Wall-clock origin of this process's part of the run (the busy fractions; ``time_s`` adds the offset)."""
        self.started = time.perf_counter()
        self._last_step_at = self.started
        self._sampler_busy_at_start = self.sampler_busy_s()

    def wall_s(self) -> float:
        """Training seconds so far, earlier processes of the run included: monotone across resumes."""
        return self.time_offset_s + time.perf_counter() - self.started

    def sampler_busy_s(self) -> float:
        return (
            float(self.sampler.stats.get("busy_s", 0.0))
            if isinstance(self.sampler, ReportsSamplerStats)
            else 0.0
        )

    def record_overlong(self, flags: Any) -> None:
        self._window["overlong"].update(flags)

    def record_episodes(self, trajectories: list[Trajectory]) -> None:
        w = self._window
        for t in trajectories:
            w["episodes"] += 1
            w["tokens"] += sum(1 for v in t.versions_T if v != NO_VERSION)
            if t.reward is not None:
                w["rewards"].append(t.reward)
            w["env_s"].append(t.timings.get("env_s", 0.0))
            w["generation_s"].append(t.timings.get("generation_s", 0.0))
            w["outcomes"][t.outcome] += 1
            by_env = self._outcomes_by_env.setdefault(t.env_id, Counter())
            by_env["episodes"] += 1
            by_env[t.outcome] += 1

    def step_record(
        self,
        *,
        step: int,
        cfg: PipelineSection,
        max_staleness: int,
        learner_version: int,
        buffer: GroupBuffer,
        inflight_groups: int,
        trained_groups: int,
        trajectories: list[Trajectory],
        staleness: list[int],
        over_max: tuple[int, int],
        queue_s: list[float],
        learner_metrics: dict[str, float],
    ) -> dict[str, Any]:
        """The ``metrics.jsonl`` record of ``step``; starts the next window."""
        now = time.perf_counter()
        dt = max(now - self._last_step_at, 1e-9)
        self._last_step_at = now
        w, self._window = self._window, _new_window()
        wall = max(now - self.started, 1e-9)
        rewards = [float(t.reward) for t in trajectories]  # type: ignore[arg-type]
        counters = buffer.counters
        record: dict[str, Any] = {
            "step": step,
            "time_s": self.time_offset_s + wall,
            "mode": cfg.mode,
            "learner_version": learner_version,
            "sampler_version": self.sampler.version,
            "reward/mean": sum(rewards) / len(rewards),
            "reward/accuracy": sum(r >= 1.0 - 1e-9 for r in rewards) / len(rewards),
            "reward/episodes_mean": sum(w["rewards"]) / len(w["rewards"]) if w["rewards"] else None,
            "samples/trained": len(trajectories),
            "samples/trained_total": trained_groups * cfg.group_size,
            "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness/max": max(staleness) if staleness else 0,
            "staleness/hist": dict(sorted(Counter(staleness).items())),
            "staleness/over_max_episodes": over_max[0],
            "staleness/over_max_replayed_episodes": over_max[1],
            "staleness/limit": max_staleness,
            "queue_s/mean": sum(queue_s) / len(queue_s),
            "episodes/finished": w["episodes"],
            "episodes/total": counters["episodes"],
            "episodes/masked_total": counters["episodes_masked"],
            "episodes/masked_frac": counters["episodes_masked"] / max(1, counters["episodes"]),
            "groups/zero_variance_total": counters["groups_zero_variance"],
            "groups/all_correct_total": counters["groups_zero_variance_all_correct"],
            "groups/all_wrong_total": counters["groups_zero_variance_all_wrong"],
            "groups/retried_total": counters["groups_retried"],
            "groups/untrainable_total": counters["groups_untrainable"],
            "groups/kept_total": counters["groups_kept"],
            "groups/inflight": inflight_groups,
            "groups/buffered": len(buffer),
            "groups/keep_rate": buffer.keep_rate,
            "overlong/episodes": w["overlong"]["overlong"],
            "overlong/forced": w["overlong"]["forced"],
            "overlong/filtered": w["overlong"]["filtered"],
            "overlong/penalised": w["overlong"]["penalised"],
            "env_latency/p50": percentile(w["env_s"], 50),
            "env_latency/p90": percentile(w["env_s"], 90),
            "env_latency/p99": percentile(w["env_s"], 99),
            "generation_s/p50": percentile(w["generation_s"], 50),
            "throughput/tokens_per_s": w["tokens"] / dt,
            "throughput/samples_per_s": len(trajectories) / dt,
            "busy/learner": self.learner_busy_s / wall,
            "busy/learner_step": self.learner_step_s / wall,
            "busy/sampler": (self.sampler_busy_s() - self._sampler_busy_at_start) / wall,
            "step_s": dt,
        }
        for key, rate in failure_rates(w["outcomes"], w["episodes"]).items():
            record[f"errors/{key}"] = rate
        for outcome in FAILED_OUTCOMES:
            record[f"errors/{outcome}_total"] = sum(c[outcome] for c in self._outcomes_by_env.values())
        record["errors/by_env"] = {
            env: {"episodes": c["episodes"], **{o: c[o] for o in FAILED_OUTCOMES}}
            for env, c in sorted(self._outcomes_by_env.items())
        }
        for k, v in learner_metrics.items():
            record.setdefault(k, v)
        for k, v in counters.items():
            if k.startswith("episodes_masked_"):
                record[f"episodes/{k.removeprefix('episodes_')}_total"] = v
        return record

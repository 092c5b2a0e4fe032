"""What a finished run says about its workload and its machines: the simulator's inputs, from its files.

From ``episodes.jsonl`` (``pipeline.traces``), over every episode with a line:

- ``turns``, ``tokens_per_turn`` and ``env_s`` (every env call: resets and steps, pooled):
  empirical distributions (``draws.Empirical``), drawn as observed; the closed form takes
  their means;
- ``groups``: each traced group's played episodes (tokens per turn, env call seconds), which
  the simulator replays whole (``EpisodeModel``), keeping the correlation of a group's
  episodes (one task) and of an episode's calls;
- ``decode_tokens_per_s`` ``r = sum(generated_tokens) / sum(generation_s)``: one sequence's
  mean rate as the run saw it, its sampler's contention included;
- ``windows``: every policy turn's generation with its start (``decode.generation_windows``),
  from which ``decode.fit_decode`` fits the decode step ``t(b) = a + c b`` (``plan.calibrate_sampler``:
  the fit needs the sampler's slots, a config's);
- ``keep_rate`` = kept groups / groups with a line (a group is kept when any episode of it
  was trained or masked).

From ``metrics.jsonl`` (its last record ``L`` and the mean over records):

- ``learner_step_s`` ``D = L[busy/learner_step] x L[time_s] / L[step]``: the learner's whole step,
  ``train_step`` and the weight export and publication after it, which a learner-bound run waits
  for (0.2-2 % of the wall time beyond ``train_step`` in the planner benchmark's runs); ``busy/learner``
  (``train_step`` alone) for a run recorded before ``busy/learner_step`` existed. Exact for a run
  that was never resumed; a resumed one scales the last process's busy fraction to the whole run;
- ``sampler_tokens_per_s`` ``R = mean(throughput/tokens_per_s) / L[busy/sampler]``: the rate the
  sampler would sustain busy all the time (``mean`` alone where the sampler reports no busy
  time); used where the decode fit falls back to the fixed rate: ``kv_slots = max(1, round(R / r))``
  then makes ``R = kv_slots x r`` as the model has it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labrl.errors import ConfigError
from labrl.harness.metrics import read_jsonl
from labrl.harness.pipeline.traces import EPISODES_FILE, read_episode_traces
from labrl.harness.planning.decode import GenerationWindow, generation_windows
from labrl.harness.planning.draws import Empirical
from labrl.harness.planning.model import Workload
from labrl.harness.planning.simulate import EpisodeModel, TracedEpisode

KEPT_FATES = frozenset({"trained", "masked"})


@dataclass(frozen=True)
class EpisodeCalibration:
    episode: EpisodeModel
    decode_tokens_per_s: float
    episodes: int
    groups: int
    windows: tuple[GenerationWindow, ...] = ()

    def workload(self) -> Workload:
        """The means the closed form takes; an episode makes ``turns + 1`` env calls (the reset)."""
        return self.episode.workload()


@dataclass(frozen=True)
class MachineCalibration:
    learner_step_s: float
    sampler_tokens_per_s: float


def calibrate_episodes(records: list[dict[str, Any]]) -> EpisodeCalibration:
    """The episode model of ``records`` (``read_episode_traces``): module docstring."""
    played = [r for r in records if r["turns"] > 0]
    tokens = [n for r in played for n in r["generated_tokens"]]
    seconds = sum(s for r in played for s in r["generation_s"])
    if not tokens or seconds <= 0:
        raise ConfigError("the traces hold no generation to calibrate the sampler from")
    groups: dict[int, bool] = {}
    for r in records:
        groups[r["group"]] = groups.get(r["group"], False) or r["fate"] in KEPT_FATES
    members: dict[int, list[TracedEpisode]] = {}
    for r in played:
        members.setdefault(r["group"], []).append(
            TracedEpisode(tuple(r["generated_tokens"]), tuple(r["env_s"]))
        )
    episode = EpisodeModel(
        turns=Empirical.of([r["turns"] for r in played], "turns"),
        tokens_per_turn=Empirical.of(tokens, "generated tokens"),
        env_s=Empirical.of([s for r in records for s in r["env_s"]], "env calls"),
        keep_rate=sum(groups.values()) / len(groups),
        groups=tuple(tuple(m) for m in members.values()),
    )
    return EpisodeCalibration(
        episode, sum(tokens) / seconds, len(records), len(groups), tuple(generation_windows(played))
    )


def calibrate_machines(metrics: list[dict[str, Any]]) -> MachineCalibration:
    """Learner step seconds and sampler tokens/s from ``metrics.jsonl`` records: module docstring."""
    if not metrics:
        raise ConfigError("metrics.jsonl has no step to calibrate the learner from")
    last = metrics[-1]
    busy_learner = last.get("busy/learner_step", last["busy/learner"])
    learner_step_s = float(busy_learner) * float(last["time_s"]) / int(last["step"])
    rates = [float(m["throughput/tokens_per_s"]) for m in metrics]
    busy = float(last.get("busy/sampler") or 0.0)
    mean_rate = sum(rates) / len(rates)
    sampler = mean_rate / busy if busy > 0 else mean_rate
    if learner_step_s <= 0 or sampler <= 0:
        raise ConfigError(f"metrics.jsonl gives no positive learner step time or sampler rate ({last})")
    return MachineCalibration(learner_step_s, sampler)


def calibrate_run(run_dir: str | Path) -> tuple[EpisodeCalibration, MachineCalibration]:
    """Both calibrations from a run directory; ``ConfigError`` naming what is missing."""
    run_dir = Path(run_dir)
    records = read_episode_traces(run_dir)
    if not records:
        raise ConfigError(
            f"{run_dir / EPISODES_FILE} is missing or empty: calibrate from a run trained with "
            "pipeline.episode_traces=true (the default)"
        )
    return calibrate_episodes(records), calibrate_machines(read_jsonl(run_dir / "metrics.jsonl"))

"""The orchestrator: rollout workers and the learner, running concurrently over one asyncio loop.

::

    producer:  while admitted: start a group (G episodes of one task) as an asyncio task
    group:     rollout_group(...) -> overlong handling -> buffer.add (keep / drop + count)
    trainer:   wait for a full batch -> collate -> learner.train_step in a worker thread
               -> export weights -> sampler.update_weights (in flight) -> metrics, eval, checkpoint

Episodes are asyncio tasks, so thousands can wait on slow envs at once; the
learner's ``train_step`` is synchronous and CPU-heavy and runs in a worker
thread (torch releases the GIL), so the loop keeps driving episodes and the
sampler while it trains. The three modes are one loop with different
admission parameters (see ``admission``):

============== ============== ================ ===============================
mode           max staleness  keep-rate guess  weight update
============== ============== ================ ===============================
sync           0              1                after each step (nothing in flight)
one_step_off   1              1                deferred until no episode is in flight
pipeline       config         measured         immediately, between decode steps
============== ============== ================ ===============================

Per-token staleness at training = learner version when the step starts minus
the version that produced the token, so time spent queued in the buffer counts.

Shutdown (``request_stop``): no new groups start, the running train step
finishes, in-flight groups are cancelled and their (index, task seed) saved;
the checkpoint holds learner, optimizer, buffer and that list. A resumed run
restarts the in-flight groups first and never trains a group twice (each
group index is trained at most once; ``trained.jsonl`` lists them per step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from labrl.envs.base import Env
from labrl.errors import LabrlError
from labrl.harness.batching import collate
from labrl.harness.config import PipelineSection
from labrl.harness.metrics import JsonlWriter, StepTimer, percentile
from labrl.harness.pipeline.admission import AdmissionState, may_start
from labrl.harness.pipeline.buffer import Group, GroupBuffer
from labrl.harness.pipeline.overlong import process_overlong
from labrl.harness.rollout import rollout, rollout_group
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import NO_VERSION, Learner, Sampler, SamplingParams, Trajectory

STATE_FILE = "pipeline.pt"
LEARNER_FILE = "learner.pt"


SUMMARY_FILE = "summary.json"


class PipelineStalledError(LabrlError, RuntimeError):
    """Dynamic sampling keeps dropping groups: the batch cannot fill with a learning signal.

    Raised after the run was checkpointed (when it has a run directory), so it is resumable.
    """


@dataclasses.dataclass
class DropStreak:
    """The groups dropped since the last kept group (or learner step), by kind."""

    all_correct: int = 0  # every trainable reward 1: the policy solves the task
    all_wrong: int = 0  # every trainable reward 0: the policy fails it
    constant: int = 0  # one identical partial reward
    untrainable: int = 0  # no trainable episode (timeouts, env / verifier errors)
    reward_sum: float = 0.0  # sum of the mean trainable reward of each scored dropped group

    @property
    def count(self) -> int:
        return self.all_correct + self.all_wrong + self.constant + self.untrainable

    @property
    def scored(self) -> int:
        return self.all_correct + self.all_wrong + self.constant

    def add(self, group: Group) -> None:
        rewards = [float(t.reward) for t in group.trainable]  # type: ignore[arg-type]
        if not rewards:
            self.untrainable += 1
            return
        mean = sum(rewards) / len(rewards)
        self.reward_sum += mean
        if min(rewards) >= 1.0 - 1e-9:
            self.all_correct += 1
        elif max(rewards) <= 1e-9:
            self.all_wrong += 1
        else:
            self.constant += 1


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
        "Most dropped groups had no trainable episode (timeouts, env or verifier errors): "
        "see episodes/masked_* in metrics.jsonl"
    ),
}


def stall_message(streak: DropStreak, cfg: PipelineSection) -> str:
    """What the stall guard says: how many groups of which kind, why, and the knobs."""
    kinds = {k: getattr(streak, k) for k in _DIAGNOSIS}
    dominant = max(kinds, key=lambda k: kinds[k])  # ties: the first listed
    mean = f"{streak.reward_sum / streak.scored:.3f}" if streak.scored else "n/a"
    limit = cfg.max_oversample_factor * cfg.batch_groups
    return (
        f"dynamic sampling dropped {streak.count} groups in a row, more than pipeline.max_oversample_factor x "
        f"pipeline.batch_groups = {cfg.max_oversample_factor:g} x {cfg.batch_groups} = {limit:g}: "
        f"{streak.all_correct} all-correct, {streak.all_wrong} all-wrong, {streak.constant} with another "
        f"constant reward, {streak.untrainable} untrainable; mean reward of the dropped groups {mean}. "
        f"{_DIAGNOSIS[dominant]}. To go on, raise pipeline.max_oversample_factor, or set "
        f"pipeline.dynamic_sampling=false with objective.advantages=whiten (trains on every group)."
    )


def task_seed(run_seed: int, index: int) -> int:
    """Seed of the train task of group ``index``: disjoint ranges per run seed."""
    return run_seed * 1_000_003 + index


def sampling_seed(run_seed: int, index: int, group_size: int) -> int:
    """Seed of member 0 of group ``index``; member i uses ``+ i`` (rollout_group)."""
    return (run_seed * 1_000_003 + index) * group_size


def token_staleness(trajectories: list[Trajectory], learner_version: int) -> list[int]:
    """``learner_version - version`` for every loss-mask token."""
    return [
        learner_version - v
        for t in trajectories
        for v, m in zip(t.versions_T, t.loss_mask_T, strict=True)
        if m and v != NO_VERSION
    ]


class Orchestrator:
    def __init__(
        self,
        cfg: PipelineSection,
        *,
        make_env: Callable[[], Env],
        sampler: Sampler,
        learner: Learner,
        tokenizer: Tokenizer,
        sampling: SamplingParams,
        seed: int = 0,
        run_dir: str | Path | None = None,
        return_routed_experts: bool = False,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        on_eval: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.make_env = make_env
        self.sampler = sampler
        self.learner = learner
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.seed = seed
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.return_routed_experts = return_routed_experts
        self.on_step = on_step
        self.on_eval = on_eval
        self.max_staleness = {"sync": 0, "one_step_off": 1}.get(cfg.mode, cfg.max_staleness)
        self.defer_weight_sync = cfg.mode == "one_step_off"
        self.buffer = GroupBuffer(cfg.batch_groups, dynamic_sampling=cfg.dynamic_sampling)
        self._task_env = make_env()  # only for make_task (pure); never reset
        # run state (checkpointed)
        self.step = 0
        self.next_group_index = 0
        self.trained_groups: list[int] = []
        self.restart_queue: list[tuple[int, int]] = []
        self.eval_history: list[dict[str, Any]] = []
        # live state
        self._inflight: dict[int, tuple[int, asyncio.Task]] = {}
        self._inflight_episodes = 0
        self._learner_busy = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._wake = asyncio.Event()
        self._pending_weights: tuple[dict[str, torch.Tensor], int] | None = None
        self._sync_lock = asyncio.Lock()
        self._eval_task: asyncio.Task | None = None
        self._drops = DropStreak()
        self._window = self._new_window()
        self._learner_busy_s = 0.0
        self._started = time.perf_counter()
        self._last_step_at = self._started
        self._sampler_busy_at_start = self._sampler_busy()
        self._trained_log = JsonlWriter(self.run_dir / "trained.jsonl") if self.run_dir else None

    # -- public -------------------------------------------------------------------

    def request_stop(self) -> None:
        """Graceful stop: finish the running step, checkpoint, return (signal-handler safe)."""
        self._stopping = True
        self._wake.set()

    @property
    def inflight_groups(self) -> list[int]:
        return sorted(self._inflight)

    def admission_state(self) -> AdmissionState:
        return AdmissionState(
            learner_version=self.learner.version,
            learner_busy=self._learner_busy,
            sampler_version=self.sampler.version,
            buffered_groups=len(self.buffer),
            inflight_groups=len(self._inflight),
        )

    @property
    def keep_rate(self) -> float:
        """Expected fraction of started groups that are kept: 1 outside pipeline mode.

        Estimated as ``(kept + 4) / (finished + 4)`` (four pseudo-groups, all
        kept) and floored at 0.25: a few early drops must not let dozens of
        groups run ahead of the learner.
        """
        if self.cfg.mode != "pipeline":
            return 1.0
        c = self.buffer.counters
        return max(0.25, (c["groups_kept"] + 4) / (c["groups_added"] + 4))

    async def run(self) -> dict[str, Any]:
        """Train until ``total_steps`` or a stop request; returns a summary."""
        self._started = time.perf_counter()
        self._last_step_at = self._started
        self._sampler_busy_at_start = self._sampler_busy()
        timer = StepTimer(self.step)
        producer = asyncio.create_task(self._produce(), name="producer")
        try:
            if self.cfg.eval_every > 0 and self.step == 0:
                await self._evaluate(self.step)
            await self._train_loop(timer)
            if (
                self._failure is None
                and self.cfg.eval_every > 0
                and not self._stopping
                and (not self.eval_history or self.eval_history[-1]["step"] != self.step)
            ):
                if self._eval_task is not None:
                    await self._eval_task
                await self._evaluate(self.step)
        finally:
            self._stopping = True
            self._wake.set()
            inflight = sorted((idx, seed) for idx, (seed, _) in self._inflight.items())
            producer.cancel()
            tasks = [t for _, t in self._inflight.values()]
            for t in tasks:
                t.cancel()
            if self._eval_task is not None:
                self._eval_task.cancel()
            await asyncio.gather(
                producer, *tasks, *([self._eval_task] if self._eval_task else []), return_exceptions=True
            )
            # groups cancelled mid-flight restart on resume, ahead of new ones
            self.restart_queue = sorted(set(self.restart_queue) | set(inflight))
            stalled = isinstance(self._failure, PipelineStalledError)
            if self.run_dir is not None and (self._failure is None or stalled):
                target = self.save_checkpoint()
                if stalled:
                    self._failure = self._stalled_with_checkpoint(self._failure, target)  # type: ignore[arg-type]
            if self._trained_log is not None:
                self._trained_log.close()
        if self._failure is not None:
            raise self._failure
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "wall_s": time.perf_counter() - self._started,
            "counters": dict(self.buffer.counters),
            "eval": self.eval_history[-1] if self.eval_history else None,
        }

    def _stalled_with_checkpoint(self, exc: PipelineStalledError, target: Path) -> PipelineStalledError:
        """Write ``summary.json`` for the stalled run; the error, extended with where to resume from."""
        assert self.run_dir is not None
        message = (
            f"{exc} Nothing is lost: the run stopped at step {self.step} and wrote {target} and "
            f"{self.run_dir / SUMMARY_FILE}; rerun the same command with the change (e.g. "
            f"pipeline.max_oversample_factor={2 * self.cfg.max_oversample_factor:g}) to resume from step {self.step}."
        )
        summary = self.summary() | {
            "interrupted": True,
            "stalled": True,
            "error": message,
            "checkpoint": str(target),
            "eval_history": self.eval_history,
        }
        tmp = self.run_dir / (SUMMARY_FILE + ".tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=str))
        os.replace(tmp, self.run_dir / SUMMARY_FILE)
        return PipelineStalledError(message)

    # -- producer -----------------------------------------------------------------

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._wake.clear()
            await self._wake.wait()

    def _can_start(self) -> bool:
        if self._inflight_episodes + self.cfg.group_size > self.cfg.max_concurrent_episodes:
            return False
        return may_start(self.admission_state(), self.cfg.batch_groups, self.keep_rate, self.max_staleness)

    async def _produce(self) -> None:
        while True:
            await self._wait_until(lambda: self._stopping or self._failure is not None or self._can_start())
            if self._stopping or self._failure is not None:
                return
            if self.restart_queue:
                index, seed = self.restart_queue.pop(0)
            else:
                index, seed = self.next_group_index, task_seed(self.seed, self.next_group_index)
                self.next_group_index += 1
            self._start_group(index, seed)

    def _start_group(self, index: int, seed: int) -> None:
        task = asyncio.create_task(self._run_group(index, seed), name=f"group-{index}")
        self._inflight[index] = (seed, task)
        self._inflight_episodes += self.cfg.group_size

    async def _run_group(self, index: int, seed: int) -> None:
        try:
            start_version = self.sampler.version
            started = time.perf_counter()
            task = self._task_env.make_task("train", seed)
            sampling = self.sampling.model_copy(
                update={"seed": sampling_seed(self.seed, index, self.cfg.group_size)}
            )
            trajectories = await rollout_group(
                self.make_env, task, self.sampler, self.tokenizer, sampling, self.cfg.group_size,
                return_routed_experts=self.return_routed_experts,
            )  # fmt: skip
            processed = []
            for t in trajectories:
                t, flags = process_overlong(t, self.cfg.overlong, self.sampling.max_new_tokens)
                self._window["overlong"].update(flags)
                processed.append(dataclasses.replace(t, group_id=f"g{index}"))
            group = Group(index, seed, processed, start_version, started, time.perf_counter())
            verdict = self.buffer.add(group)
            self._record_episodes(processed)
            if verdict == "kept":
                self._drops = DropStreak()
            else:
                self._drops.add(group)
                limit = self.cfg.max_oversample_factor * self.cfg.batch_groups
                if self.cfg.dynamic_sampling and self._drops.count > limit:
                    raise PipelineStalledError(stall_message(self._drops, self.cfg))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._failure is None:  # the first failure is the cause; later ones are echoes
                self._failure = exc
        finally:
            self._inflight.pop(index, None)
            self._inflight_episodes -= self.cfg.group_size
            self._wake.set()
            if self.defer_weight_sync and not self._inflight and self._pending_weights is not None:
                asyncio.get_running_loop().create_task(self._sync_weights())

    # -- trainer ------------------------------------------------------------------

    async def _train_loop(self, timer: StepTimer) -> None:
        while self.step < self.cfg.total_steps and not self._stopping:
            await self._wait_until(lambda: self._stopping or self._failure is not None or self.buffer.ready)
            if self._failure is not None or self._stopping:
                return
            groups = self.buffer.pop_batch()
            trajectories = [t for g in groups for t in g.trajectories]
            batch = collate(trajectories, self.tokenizer.pad_token_id)
            version = self.learner.version
            staleness = token_staleness(trajectories, version)
            over_max = sum(
                1
                for t in trajectories
                if token_staleness([t], version) and max(token_staleness([t], version)) > self.max_staleness
            )
            now = time.perf_counter()
            queue_s = [now - g.finished_at for g in groups]
            self._learner_busy = True
            self._wake.set()
            t0 = time.perf_counter()
            try:
                learner_metrics = await asyncio.to_thread(self.learner.train_step, batch)
            finally:
                self._learner_busy = False
                self._learner_busy_s += time.perf_counter() - t0
            self.step += 1
            self._drops = DropStreak()
            indices = [g.index for g in groups]
            self.trained_groups.extend(indices)
            if self._trained_log is not None:
                self._trained_log.write({"step": self.step, "groups": indices})
            weights = await asyncio.to_thread(self.learner.export_weights)
            self._pending_weights = (weights, self.learner.version)
            if not self.defer_weight_sync or not self._inflight:
                await self._sync_weights()
            record = self._step_record(trajectories, staleness, over_max, queue_s, learner_metrics)
            record["eta_s"] = timer.eta_s(self.step, self.cfg.total_steps)
            if self.eval_history:
                record["eval/accuracy"] = self.eval_history[-1]["accuracy"]
            if self.on_step is not None:
                self.on_step(record)
            if (
                self.cfg.eval_every > 0
                and self.step % self.cfg.eval_every == 0
                and self.step < self.cfg.total_steps
            ):
                if self._eval_task is not None and not self._eval_task.done():
                    await self._eval_task
                self._eval_task = asyncio.create_task(self._evaluate(self.step))
            if (
                self.run_dir is not None
                and self.cfg.checkpoint_every
                and self.step % self.cfg.checkpoint_every == 0
            ):
                self.save_checkpoint()
            self._wake.set()
        if self._eval_task is not None and not self._stopping:
            await self._eval_task

    async def _sync_weights(self) -> None:
        async with self._sync_lock:
            if self._pending_weights is None:
                return
            weights, version = self._pending_weights
            self._pending_weights = None
            if version > self.sampler.version:
                await self.sampler.update_weights(weights, version)
        self._wake.set()

    # -- evaluation -----------------------------------------------------------------

    async def _evaluate(self, step: int) -> dict[str, Any]:
        """Greedy (or low-temperature) episodes on the env's test split with the sampler's current weights."""
        version = self.sampler.version
        sampling = self.sampling.model_copy(
            update={"temperature": self.cfg.eval_temperature, "seed": self.seed}
        )

        async def one(i: int) -> Trajectory:
            env = self.make_env()
            try:
                task = env.make_task("test", i)
                return await rollout(
                    env, task, self.sampler, self.tokenizer, sampling, rid_prefix=f"eval{step}:"
                )
            finally:
                await env.close()

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(self.cfg.eval_size)))
        scored = [t.reward for t in results if t.reward is not None]
        record = {
            "step": step,
            "sampler_version": version,
            "n": len(results),
            "n_scored": len(scored),
            "accuracy": sum(1 for r in scored if r >= 1.0 - 1e-9) / len(results),
            "reward_mean": sum(scored) / len(scored) if scored else None,
            "overlong_frac": sum(t.finish_reason == "length" for t in results) / len(results),
            "eval_s": time.perf_counter() - t0,
            "time_s": time.perf_counter() - self._started,
        }
        self.eval_history.append(record)
        if self.on_eval is not None:
            self.on_eval(record)
        return record

    # -- metrics ----------------------------------------------------------------------

    @staticmethod
    def _new_window() -> dict[str, Any]:
        return {
            "rewards": [],
            "env_s": [],
            "generation_s": [],
            "tokens": 0,
            "episodes": 0,
            "overlong": Counter(),
        }

    def _record_episodes(self, trajectories: list[Trajectory]) -> None:
        w = self._window
        for t in trajectories:
            w["episodes"] += 1
            w["tokens"] += sum(1 for v in t.versions_T if v != NO_VERSION)
            if t.reward is not None:
                w["rewards"].append(t.reward)
            w["env_s"].append(t.timings.get("env_s", 0.0))
            w["generation_s"].append(t.timings.get("generation_s", 0.0))

    def _sampler_busy(self) -> float:
        return float(getattr(self.sampler, "stats", {}).get("busy_s", 0.0))

    def _step_record(
        self,
        trajectories: list[Trajectory],
        staleness: list[int],
        over_max: int,
        queue_s: list[float],
        learner_metrics: dict[str, float],
    ) -> dict[str, Any]:
        now = time.perf_counter()
        dt = max(now - self._last_step_at, 1e-9)
        self._last_step_at = now
        w, self._window = self._window, self._new_window()
        wall = max(now - self._started, 1e-9)
        rewards = [float(t.reward) for t in trajectories]  # type: ignore[arg-type]
        counters = self.buffer.counters
        record: dict[str, Any] = {
            "step": self.step,
            "time_s": wall,
            "mode": self.cfg.mode,
            "learner_version": self.learner.version,
            "sampler_version": self.sampler.version,
            "reward/mean": sum(rewards) / len(rewards),
            "reward/accuracy": sum(r >= 1.0 - 1e-9 for r in rewards) / len(rewards),
            "reward/episodes_mean": sum(w["rewards"]) / len(w["rewards"]) if w["rewards"] else None,
            "samples/trained": len(trajectories),
            "samples/trained_total": len(self.trained_groups) * self.cfg.group_size,
            "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness/max": max(staleness) if staleness else 0,
            "staleness/hist": dict(sorted(Counter(staleness).items())),
            "staleness/over_max_episodes": over_max,
            "staleness/limit": self.max_staleness,
            "queue_s/mean": sum(queue_s) / len(queue_s),
            "episodes/finished": w["episodes"],
            "episodes/total": counters["episodes"],
            "episodes/masked_total": counters["episodes_masked"],
            "episodes/masked_frac": counters["episodes_masked"] / max(1, counters["episodes"]),
            "groups/zero_variance_total": counters["groups_zero_variance"],
            "groups/untrainable_total": counters["groups_untrainable"],
            "groups/kept_total": counters["groups_kept"],
            "groups/inflight": len(self._inflight),
            "groups/buffered": len(self.buffer),
            "groups/keep_rate": self.buffer.keep_rate,
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
            "busy/learner": self._learner_busy_s / wall,
            "busy/sampler": (self._sampler_busy() - self._sampler_busy_at_start) / wall,
            "step_s": dt,
        }
        for k, v in learner_metrics.items():
            record.setdefault(k, v)
        for k, v in counters.items():
            if k.startswith("episodes_masked_"):
                record[f"episodes/{k.removeprefix('episodes_')}_total"] = v
        return record

    # -- checkpoint / resume ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        inflight = sorted(set(self.restart_queue) | {(i, s) for i, (s, _) in self._inflight.items()})
        return {
            "step": self.step,
            "next_group_index": self.next_group_index,
            "trained_groups": list(self.trained_groups),
            "inflight": inflight,
            "buffer": self.buffer.state_dict(),
            "eval_history": list(self.eval_history),
            "seed": self.seed,
            "mode": self.cfg.mode,
        }

    def save_checkpoint(self) -> Path:
        """``run_dir/checkpoints/step_N/{learner.pt, pipeline.pt}`` and a ``latest`` pointer (atomic)."""
        assert self.run_dir is not None
        root = self.run_dir / "checkpoints"
        target = root / f"step_{self.step:06d}"
        target.mkdir(parents=True, exist_ok=True)
        self.learner.save_checkpoint(str(target / LEARNER_FILE))
        tmp = target / (STATE_FILE + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, target / STATE_FILE)
        pointer = root / "latest.tmp"
        pointer.write_text(target.name)
        os.replace(pointer, root / "latest")
        for old in sorted(p for p in root.glob("step_*") if p.is_dir() and p != target)[:-1]:
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        return target

    async def resume(self, checkpoint_dir: str | Path) -> None:
        """Load learner + pipeline state; push the learner's weights to the sampler."""
        path = Path(checkpoint_dir)
        self.learner.load_checkpoint(str(path / LEARNER_FILE))
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        self.step = int(state["step"])
        self.next_group_index = int(state["next_group_index"])
        self.trained_groups = list(state["trained_groups"])
        self.restart_queue = [tuple(x) for x in state["inflight"]]
        self.buffer.load_state_dict(state["buffer"])
        self.eval_history = list(state["eval_history"])
        weights = await asyncio.to_thread(self.learner.export_weights)
        # force: the sampler (an SGLang server outliving the run) may already be past this version
        await self.sampler.update_weights(weights, self.learner.version, force=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    target = pointer.parent / pointer.read_text().strip()
    return target if (target / STATE_FILE).exists() else None

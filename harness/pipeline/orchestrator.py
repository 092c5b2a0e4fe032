"""The orchestrator: rollout workers and the learner, running concurrently over one asyncio loop.

::

    producer:  while admitted: start a group (G episodes of one task) as an asyncio task
    group:     rollout_group(...) -> invalid-action reward (``shaping``) -> overlong handling
               -> buffer.add (keep / drop + count)
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
the checkpoint holds learner, optimizer, buffer and that list. A run that
fails (an env, the sampler, a batch that cannot fill) writes a checkpoint before the
error propagates; only a failure inside ``train_step`` does not (the learner's
state may be half-updated), so the previous checkpoint stays the latest.
Checkpoints are also written every ``checkpoint_every`` steps and after the
first step that ends ``checkpoint_every_s`` seconds after the previous one. A resumed run
restarts the in-flight groups first and never trains a group twice (each
group index is trained at most once; ``trained.jsonl`` lists them per step).

Stall guard: more than ``max_oversample_factor x batch_groups`` groups dropped in
a row (since the last kept group or learner step), whether dynamic sampling
dropped them or they had no trainable episode (with it on or off), mean the
batch cannot fill: the run stops with ``PipelineStalledError``, one line from
``stats.stall_message``, after writing its checkpoint.

Cascade budgets (``cascade_budget``): for a cascade env, a group starts only while every stage's
predicted spend stays within its budget; when none can start and none is in flight, the run stops
with ``BudgetExhaustedError`` after writing its checkpoint.

This module is the schedule; the per-step metrics live in ``stats``, the
checkpoint files in ``checkpoint``, evaluation in ``evaluation`` and the
weight hand-over in ``weight_sync``. A stall's summary travels on the error
(``PipelineStalledError.summary``); ``runner`` writes ``summary.json``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from labrl.envs.base import Env
from labrl.envs.types import Task
from labrl.errors import BudgetExhaustedError, LabrlError
from labrl.harness.metrics import JsonlWriter, StepTimer
from labrl.harness.pipeline.admission import (
    AdmissionState,
    may_start,
    pessimistic_keep_rate,
    trained_before_end,
)
from labrl.harness.pipeline.buffer import Group, GroupBuffer, constant_kind
from labrl.harness.pipeline.cascade_budget import CascadeBudget
from labrl.harness.pipeline.checkpoint import SUMMARY_FILE, read_checkpoint, write_checkpoint
from labrl.harness.pipeline.config import PipelineSection
from labrl.harness.pipeline.errors_log import ErrorLog
from labrl.harness.pipeline.evaluation import EvalOnTestSplit
from labrl.harness.pipeline.overlong import process_overlong
from labrl.harness.pipeline.shaping import shape_invalid_action
from labrl.harness.pipeline.stats import (
    DropStreak,
    StepStats,
    episodes_over_staleness,
    stall_message,
    token_staleness,
)
from labrl.harness.pipeline.traces import TRACE, EpisodeTraces, finished_record
from labrl.harness.pipeline.weight_sync import WeightSync
from labrl.harness.rollout.batching import collate
from labrl.harness.rollout.play import rollout_group
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import Learner, Sampler, SamplingParams, Trajectory

#: plays group ``index`` (G episodes of ``task``, member i seeded ``sampling.seed + i``); returns them in order
GroupPlayer = Callable[[int, Task, SamplingParams], Awaitable[list[Trajectory]]]


class PipelineStalledError(LabrlError, RuntimeError):
    """The buffer keeps dropping groups (zero-variance or untrainable): the batch cannot fill.

    Raised after the run was checkpointed (when it has a run directory), so it is resumable;
    ``summary`` is then the run's summary (``stalled``, ``error``, ``checkpoint``, ...).
    """

    def __init__(self, message: str, summary: dict[str, Any] | None = None) -> None:
        super().__init__(message, summary)  # args rebuild the error when unpickled
        self.summary = summary

    def __str__(self) -> str:
        return str(self.args[0])


def task_seed(run_seed: int, index: int) -> int:
    """Seed of the train task of group ``index``: disjoint ranges per run seed."""
    return run_seed * 1_000_003 + index


def sampling_seed(run_seed: int, index: int, group_size: int) -> int:
    """Seed of member 0 of group ``index``; member i uses ``+ i`` (rollout_group)."""
    return (run_seed * 1_000_003 + index) * group_size


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
        play_group: GroupPlayer | None = None,
        step_extras: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        on_checkpoint: Callable[[set[int]], None] | None = None,
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
        # where a group's episodes run: here (rollout_group) or on a remote env worker (backend=ray)
        self.play_group: GroupPlayer = play_group or self._play_here
        self.step_extras = step_extras
        # told, after each checkpoint, which groups it leaves to replay (the Ray lab gateway keeps
        # their transcripts and releases the rest)
        self.on_checkpoint = on_checkpoint
        self.max_staleness = cfg.effective_max_staleness
        self.buffer = GroupBuffer(cfg.batch_groups, dynamic_sampling=cfg.dynamic_sampling)
        self._task_env = make_env()  # only for make_task (pure); never reset
        # a cascade env's budgets: admission by predicted spend, and the step's cascade/ metrics
        self.cascade_budget = CascadeBudget.of(self._task_env)
        # run state (checkpointed)
        self.step = 0
        self.next_group_index = 0
        self.trained_groups: list[int] = []
        self.restart_queue: list[tuple[int, int]] = []
        # task seeds whose group was all wrong, to play again under a new group index
        # (``retry_all_wrong``), and how many retries each has had
        self.retry_queue: list[int] = []
        self.retries: dict[int, int] = {}
        self.retry_indices: set[int] = set()  # group indices of retries not yet finished
        # fresh tasks are numbered apart from group indices, so retries shift no task's seed
        self.next_task = 0
        self.eval_history: list[dict[str, Any]] = []
        # live state
        self._inflight: dict[int, tuple[int, asyncio.Task]] = {}
        self._inflight_episodes = 0
        self._learner_busy = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._learner_failed = False  # train_step raised: its state may be half-updated, never checkpoint it
        self._last_checkpoint_at = time.perf_counter()
        self._wake = asyncio.Event()
        self.weights = WeightSync(sampler, deferred=cfg.mode == "one_step_off", on_synced=self._wake.set)
        self._eval_task: asyncio.Task | None = None
        self._drops = DropStreak()
        self.metrics = StepStats(sampler)
        self._trained_log = JsonlWriter(self.run_dir / "trained.jsonl") if self.run_dir else None
        self.errors = ErrorLog(self.run_dir) if self.run_dir else None
        self.traces = EpisodeTraces(self.run_dir) if self.run_dir and cfg.episode_traces else None
        self.evaluation = EvalOnTestSplit(
            make_env,
            tokenizer,
            sampling.model_copy(update={"temperature": cfg.eval_temperature, "seed": seed}),
            size=cfg.eval_size,
            concurrency=cfg.max_concurrent_episodes,
            errors=self.errors,
        )

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
        """The keep rate admission assumes: 1 outside pipeline mode, else ``admission.pessimistic_keep_rate``
        of the buffer's recent verdicts."""
        if self.cfg.mode != "pipeline":
            return 1.0
        recent = self.buffer.recent_kept
        return pessimistic_keep_rate(sum(recent), len(recent))

    async def run(self) -> dict[str, Any]:
        """Train until ``total_steps`` or a stop request; returns a summary."""
        self.metrics.start()
        self._last_checkpoint_at = time.perf_counter()
        timer = StepTimer(self.step)
        if self.cascade_budget is not None:  # a resumed run starts from what its ledger already paid
            await self.cascade_budget.refresh()
        producer = asyncio.create_task(self._produce(), name="producer")
        try:
            if (
                self.cfg.eval_every > 0
                and self.step == 0
                and not self._stopping
                and not any(e["step"] == 0 for e in self.eval_history)  # resumed from the step-0 checkpoint
            ):
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
        except BaseException as exc:
            if self._failure is None:
                self._failure = exc
            raise
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
            if self.run_dir is not None and not self._learner_failed:
                target = self.save_checkpoint()
                if stalled:
                    self._failure = self._stalled_with_checkpoint(self._failure, target)  # type: ignore[arg-type]
                elif isinstance(self._failure, BudgetExhaustedError):
                    self._failure = BudgetExhaustedError(
                        f"{self._failure} (the run stopped at step {self.step} and wrote {target}; "
                        "rerun the same command to resume)"
                    )
            if self._trained_log is not None:
                self._trained_log.close()
            if self.errors is not None:
                self.errors.close()
            if self.traces is not None:
                self.traces.close()
        if self._failure is not None:
            raise self._failure
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "wall_s": self.metrics.wall_s(),
            "counters": dict(self.buffer.counters),
            "eval": self.eval_history[-1] if self.eval_history else None,
        }

    def _stalled_with_checkpoint(self, exc: PipelineStalledError, target: Path) -> PipelineStalledError:
        """The error, extended with where to resume from and carrying the stalled run's summary."""
        assert self.run_dir is not None
        message = (
            f"{exc} Nothing is lost: the run stopped at step {self.step} and wrote {target} and "
            f"{self.run_dir / SUMMARY_FILE}; rerun the same command with the change to resume from step {self.step} "
            "(a change to a key that identifies the run, such as the model's shape, needs a new run_dir)."
        )
        summary = self.summary() | {
            "interrupted": True,
            "stalled": True,
            "error": message,
            "checkpoint": str(target),
            "eval_history": self.eval_history,
        }
        return PipelineStalledError(message, summary)

    # -- producer -----------------------------------------------------------------

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._wake.clear()
            await self._wake.wait()

    def _can_start(self) -> bool:
        if self._inflight_episodes + self.cfg.group_size > self.cfg.max_concurrent_episodes:
            return False
        if self.cascade_budget is not None and not self.cascade_budget.admits(
            self._inflight_episodes, self.cfg.group_size
        ):
            return False
        state = self.admission_state()
        return may_start(
            state, self.cfg.batch_groups, self.keep_rate, self.max_staleness
        ) and trained_before_end(
            state, self.cfg.batch_groups, self.keep_rate, self.step, self.cfg.total_steps
        )

    def _budget_spent(self) -> bool:
        """The run needs more groups, none is in flight, and the cascade budget admits none: nothing will change."""
        if self.cascade_budget is None or self._inflight:
            return False
        wanted = trained_before_end(
            self.admission_state(), self.cfg.batch_groups, self.keep_rate, self.step, self.cfg.total_steps
        )
        return wanted and not self.cascade_budget.admits(0, self.cfg.group_size)

    async def _produce(self) -> None:
        while True:
            await self._wait_until(
                lambda: (
                    self._stopping or self._failure is not None or self._can_start() or self._budget_spent()
                )
            )
            if self._stopping or self._failure is not None:
                return
            if self._budget_spent():
                assert self.cascade_budget is not None
                self._failure = self.cascade_budget.exhausted_error(self.cfg.group_size)
                self._wake.set()
                return
            if self.restart_queue:
                index, seed = self.restart_queue.pop(0)
            elif self.retry_queue:
                index, seed = self.next_group_index, self.retry_queue.pop(0)
                self.retry_indices.add(index)
                self.next_group_index += 1
            else:
                index, seed = self.next_group_index, task_seed(self.seed, self.next_task)
                self.next_group_index += 1
                self.next_task += 1
            self._start_group(index, seed)

    def _start_group(self, index: int, seed: int) -> None:
        task = asyncio.create_task(self._run_group(index, seed), name=f"group-{index}")
        self._inflight[index] = (seed, task)
        self._inflight_episodes += self.cfg.group_size

    async def _run_group(self, index: int, seed: int) -> None:
        try:
            start_version = self.sampler.version
            started = time.perf_counter()
            start_s = self.metrics.wall_s()  # the clock of metrics.jsonl's time_s, for episodes.jsonl
            task = self._task_env.make_task("train", seed)
            sampling = self.sampling.model_copy(
                update={"seed": sampling_seed(self.seed, index, self.cfg.group_size)}
            )
            trajectories = await self.play_group(index, task, sampling)
            processed = []
            for member, t in enumerate(trajectories):
                t = shape_invalid_action(t, self.cfg.invalid_action_reward)
                t, flags = process_overlong(t, self.cfg.overlong, self.sampling.max_new_tokens)
                self.metrics.record_overlong(flags)
                if self.traces is not None:
                    trace = finished_record(
                        t, group=index, member=member, version_at_start=start_version, start_s=start_s
                    )
                    t = dataclasses.replace(t, info={**t.info, TRACE: trace})
                processed.append(dataclasses.replace(t, group_id=f"g{index}"))
            group = Group(index, seed, processed, start_version, started, time.perf_counter())
            verdict = self.buffer.add(group)
            if self.traces is not None:
                self.traces.group_finished(group, verdict, steps_done=self.step)
            self.metrics.record_episodes(processed)
            if self.cascade_budget is not None:
                self.cascade_budget.observe(processed)
                await self.cascade_budget.refresh()
            if self.errors is not None:
                self.errors.episodes(processed, step=self.step, phase="train")
            if verdict == "kept":
                self._drops = DropStreak()
            elif self._is_retry(group):
                # a retry's drop says nothing new about whether the batch can fill: the task was
                # already counted, and retries are bounded (retry_all_wrong), so they cannot sample forever
                self._maybe_retry(group)
            else:
                self._drops.add(group)
                self._maybe_retry(group)
                # whatever dropped them (dynamic sampling, or no trainable episode with it off), this many
                # drops in a row mean the batch cannot fill: stop rather than sample forever
                if self._drops.count > self.cfg.max_oversample_factor * self.cfg.batch_groups:
                    raise PipelineStalledError(stall_message(self._drops, self.cfg))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._failure is None:  # the first failure is the cause; later ones are echoes
                self._failure = exc
        finally:
            self._inflight.pop(index, None)
            if not self._stopping:  # a retry cancelled by a stop is replayed as one after resume
                self.retry_indices.discard(index)
            self._inflight_episodes -= self.cfg.group_size
            self._wake.set()
            self.weights.group_finished(episodes_in_flight=bool(self._inflight))

    def _is_retry(self, group: Group) -> bool:
        """Whether ``group`` replays an earlier group's all-wrong task (``_maybe_retry``)."""
        return group.index in self.retry_indices

    def _maybe_retry(self, group: Group) -> None:
        """Queue ``group``'s task to be played again if every member failed (``retry_all_wrong``).

        A dropped all-wrong group gives the policy no signal on that task; a phase the policy
        has collapsed away from is such a task every time, and another group of it is the only
        way a success (and with it an advantage) can appear (docs/training.md)."""
        rewards = [float(t.reward) for t in group.trainable]  # type: ignore[arg-type]
        if not rewards or constant_kind(rewards) != "all_wrong":
            return
        used = self.retries.get(group.task_seed, 0)
        if used < self.cfg.retry_all_wrong:
            self.retries[group.task_seed] = used + 1
            self.retry_queue.append(group.task_seed)
            self.buffer.counters["groups_retried"] += 1  # checkpointed with the buffer

    async def _play_here(self, index: int, task: Task, sampling: SamplingParams) -> list[Trajectory]:
        return await rollout_group(
            self.make_env, task, self.sampler, self.tokenizer, sampling, self.cfg.group_size,
            return_routed_experts=self.return_routed_experts,
        )  # fmt: skip

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
            over_max = episodes_over_staleness(trajectories, version, self.max_staleness)
            now = time.perf_counter()
            queue_s = [now - g.finished_at for g in groups]
            self._learner_busy = True
            self._wake.set()
            t0 = time.perf_counter()
            try:
                learner_metrics = await asyncio.to_thread(self.learner.train_step, batch)
            except BaseException:
                self._learner_failed = True
                raise
            finally:
                self._learner_busy = False
                self.metrics.learner_busy_s += time.perf_counter() - t0
            self.step += 1
            self._drops = DropStreak()
            indices = [g.index for g in groups]
            self.trained_groups.extend(indices)
            if self._trained_log is not None:
                self._trained_log.write({"step": self.step, "groups": indices})
            if self.traces is not None:
                self.traces.trained(groups, version_at_train=version, step=self.step)
            weights = await asyncio.to_thread(self.learner.export_weights)
            await self.weights.publish(weights, self.learner.version, episodes_in_flight=bool(self._inflight))
            self.metrics.learner_step_s += time.perf_counter() - t0
            record = self.metrics.step_record(
                step=self.step,
                cfg=self.cfg,
                max_staleness=self.max_staleness,
                learner_version=self.learner.version,
                buffer=self.buffer,
                inflight_groups=len(self._inflight),
                trained_groups=len(self.trained_groups),
                trajectories=trajectories,
                staleness=staleness,
                over_max=over_max,
                queue_s=queue_s,
                learner_metrics=learner_metrics,
            )
            record["eta_s"] = timer.eta_s(self.step, self.cfg.total_steps)
            if self.cascade_budget is not None:
                await self.cascade_budget.refresh()
                record.update(self.cascade_budget.step_metrics())
            if self.eval_history:
                record["eval/accuracy"] = self.eval_history[-1]["accuracy"]
            if self.step_extras is not None:
                record.update(await self.step_extras())
            if self.on_step is not None:
                self.on_step(record)
            await self._periodic_eval_and_checkpoint()
            self._wake.set()
        if self._eval_task is not None and not self._stopping:
            await self._eval_task

    def _checkpoint_due(self) -> bool:
        """Every ``checkpoint_every`` steps, or once ``checkpoint_every_s`` seconds passed since the last save."""
        every, every_s = self.cfg.checkpoint_every, self.cfg.checkpoint_every_s
        if every and self.step % every == 0:
            return True
        return bool(every_s) and time.perf_counter() - self._last_checkpoint_at >= every_s

    async def _periodic_eval_and_checkpoint(self) -> None:
        """Every ``eval_every`` steps start an evaluation (one at a time); save when ``_checkpoint_due``."""
        if (
            self.cfg.eval_every > 0
            and self.step % self.cfg.eval_every == 0
            and self.step < self.cfg.total_steps
        ):
            if self._eval_task is not None and not self._eval_task.done():
                await self._eval_task
            self._eval_task = asyncio.create_task(self._evaluate(self.step))
        if self.run_dir is not None and self.step < self.cfg.total_steps and self._checkpoint_due():
            self.save_checkpoint()  # the last step's checkpoint is written when run() ends

    # -- evaluation -----------------------------------------------------------------

    async def _evaluate(self, step: int) -> dict[str, Any]:
        """Evaluate on the test split (``evaluation``) with the sampler's current weights; record it."""
        record = await self.evaluation.run(self.sampler, step, time_s=self.metrics.wall_s)
        self.eval_history.append(record)
        if self.on_eval is not None:
            self.on_eval(record)
        return record

    # -- checkpoint / resume ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        inflight = sorted(set(self.restart_queue) | {(i, s) for i, (s, _) in self._inflight.items()})
        return {
            "step": self.step,
            "next_group_index": self.next_group_index,
            "trained_groups": list(self.trained_groups),
            "inflight": inflight,
            "retry_queue": list(self.retry_queue),
            "retry_indices": sorted(self.retry_indices & {i for i, _ in inflight}),
            "next_task": self.next_task,
            "retries": [[seed, n] for seed, n in self.retries.items()],
            "buffer": self.buffer.state_dict(),
            "eval_history": list(self.eval_history),
            "seed": self.seed,
            "mode": self.cfg.mode,
            "wall_s": self.metrics.wall_s(),
        }

    def save_checkpoint(self) -> Path:
        """``run_dir/checkpoints/step_N/{learner.pt, pipeline.pt}`` and a ``latest`` pointer (atomic)."""
        assert self.run_dir is not None
        state = self.state_dict()
        target = write_checkpoint(self.run_dir, self.step, self.learner, state)
        self._last_checkpoint_at = time.perf_counter()
        if self.on_checkpoint is not None:
            self.on_checkpoint({index for index, _ in state["inflight"]})
        return target

    async def resume(self, checkpoint_dir: str | Path) -> None:
        """Load learner + pipeline state; push the learner's weights to the sampler."""
        state = read_checkpoint(checkpoint_dir, self.learner)
        self.step = int(state["step"])
        self.next_group_index = int(state["next_group_index"])
        self.trained_groups = list(state["trained_groups"])
        self.restart_queue = [tuple(x) for x in state["inflight"]]
        # checkpoints from before retries existed have neither key
        self.retry_queue = [int(x) for x in state.get("retry_queue", [])]
        self.retries = {int(seed): int(n) for seed, n in state.get("retries", [])}
        self.retry_indices = {int(i) for i in state.get("retry_indices", [])}
        self.next_task = int(state.get("next_task", self.next_group_index))
        self.buffer.load_state_dict(state["buffer"])
        self.eval_history = list(state["eval_history"])
        self.metrics.time_offset_s = float(state.get("wall_s", 0.0))  # checkpoints before it: restart at 0
        weights = await asyncio.to_thread(self.learner.export_weights)
        # force: the sampler (an SGLang server outliving the run) may already be past this version
        await self.sampler.update_weights(weights, self.learner.version, force=True)

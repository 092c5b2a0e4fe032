"""Driver- and worker-side handles on the actors, each implementing the interface the in-process code uses.

- ``RemoteSampler``: the ``Sampler`` protocol over the sampler actors. The
  requests of all episodes that ask within ``ray.generate_coalesce_s`` go in
  one actor call (one hop for many episodes' turns). A request whose actor died is re-issued (same request, to the next actor, or
  the same one once Ray restarted it, which re-syncs before serving); weight
  updates are versioned messages: the ref to the learner's exported state dict
  goes to ``Control`` first (so a restarting actor picks it up) and then to
  every live actor.
- ``LearnerClient``: the ``Learner`` protocol over the learner actor; the
  learner's loss is a ``LearnerLostError`` naming the checkpoint to resume from.
- ``EnvWorkerPool``: the orchestrator's ``play_group`` over the env workers;
  a group whose worker died is played again on another (or the restarted) one
  with ``resume=True`` (episodes with a lab job resume from their transcripts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from labrl.envs.types import Task
from labrl.errors import LearnerLostError, SamplerError, WorkerLostError
from labrl.harness.pipeline.checkpoint import latest_checkpoint
from labrl.harness.pipeline.stats import REPLAYED
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams, TrainBatch, Trajectory
from labrl.resilience import Backoff


def _actor_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)


class _Prober:
    """Marks actors down on a failure and up again once Ray has them back (a call to ``method`` answers)."""

    def __init__(self, actors: Sequence[Any], method: str) -> None:
        self._actors, self._method = actors, method
        self.down: set[int] = set()
        self._tasks: dict[int, asyncio.Task] = {}

    def failed(self, i: int) -> None:
        self.down.add(i)
        if i not in self._tasks:
            self._tasks[i] = asyncio.ensure_future(self._probe(i))

    def answered(self, i: int) -> None:
        self.down.discard(i)

    async def _probe(self, i: int) -> None:
        try:
            while True:
                try:
                    await getattr(self._actors[i], self._method).remote()
                except _actor_errors():
                    await asyncio.sleep(1.0)
                    continue
                self.down.discard(i)
                return
        finally:
            self._tasks.pop(i, None)

    def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()


# 0.2, 0.4, ... capped at 2 s: a restarting actor is usually back within seconds.
_ACTOR_BACKOFF = Backoff(base_s=0.2, cap_s=2.0)


class RemoteSampler:
    """``Sampler`` over sampler actors; see the module docstring."""

    def __init__(
        self,
        actors: Sequence[Any],
        control: Any = None,
        *,
        version: int = 0,
        reissue_timeout_s: float = 300.0,
        coalesce_s: float = 0.002,
    ) -> None:
        self.actors = list(actors)
        self.coalesce_s = coalesce_s
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()
        self.control = control
        self.reissue_timeout_s = reissue_timeout_s
        self.counters: Counter[str] = Counter()
        self.liveness = _Prober(self.actors, "ready")
        self._version = version  # the policy version the sampler actors start from
        self._next = 0

    @property
    def down(self) -> set[int]:
        return self.liveness.down

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Queue ``requests``; the requests of every episode that asks within ``coalesce_s`` go in one call."""
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            future: asyncio.Future[GenerateResult] = loop.create_future()
            self._pending.append((request, future))
            futures.append(future)
        if self._flush is None:
            self._flush = loop.call_later(self.coalesce_s, self._send_pending)
        return list(await asyncio.gather(*futures))

    def _send_pending(self) -> None:
        batch, self._pending, self._flush = self._pending, [], None
        task = asyncio.ensure_future(self._deliver(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _deliver(self, batch: list[tuple[GenerateRequest, asyncio.Future]]) -> None:
        from ray.exceptions import RayTaskError

        try:
            results = await self._call([request for request, _ in batch])
        except RayTaskError as exc:
            if len(batch) > 1:  # one bad request (e.g. a prompt too long) must fail only its own episode
                await asyncio.gather(*(self._deliver([item]) for item in batch))
                return
            self._fail(batch, exc)
            return
        except BaseException as exc:
            self._fail(batch, exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():  # its episode may have been cancelled meanwhile
                future.set_result(result)

    @staticmethod
    def _fail(batch: list[tuple[GenerateRequest, asyncio.Future]], exc: BaseException) -> None:
        for _, future in batch:
            if not future.done():
                future.set_exception(exc)

    async def _call(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """One actor call; re-issued to the next actor (or the restarted one) while actors are down."""
        errors = _actor_errors()
        i = self._next
        self._next = (self._next + 1) % len(self.actors)
        deadline = time.monotonic() + self.reissue_timeout_s
        attempt = 0
        while True:
            try:
                results = await self.actors[i].generate.remote(requests)
            except errors as exc:
                self.counters["sampler_failures"] += 1
                self.counters["requests_reissued"] += len(requests)
                self.liveness.failed(i)
                if time.monotonic() >= deadline:
                    raise SamplerError(
                        f"sampler actor {i} stayed unreachable for ray.reissue_timeout_s="
                        f"{self.reissue_timeout_s:g} s: {type(exc).__name__}"
                    ) from None
                await asyncio.sleep(_ACTOR_BACKOFF.delay(attempt))
                attempt += 1
                i = (i + 1) % len(self.actors)
                continue
            self.liveness.answered(i)
            self.counters["generate_calls"] += 1
            self.counters["requests"] += len(requests)
            return results

    async def update_weights(self, weights: Any, version: int, *, force: bool = False) -> None:
        """Publish ``(version, weights)``: to ``Control`` first, then to every actor (a dead one re-syncs on restart)."""
        import ray

        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(dict(weights))
        if self.control is not None:
            await self.control.set_policy.remote(version, [ref])
        results = await asyncio.gather(
            *(a.update_weights.remote(ref, version, force) for a in self.actors), return_exceptions=True
        )
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                if not isinstance(r, _actor_errors()):
                    raise r
                self.counters["sampler_failures"] += 1
                self.liveness.failed(i)
        self._version = version

    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None


class LearnerClient:
    """``Learner`` over the learner actor (blocking calls: the orchestrator runs them in a worker thread)."""

    def __init__(self, actor: Any, run_dir: str | Path, version: int) -> None:
        self.actor = actor
        self.run_dir = Path(run_dir)
        self._version = version
        self.last_weights_bytes = 0

    @property
    def version(self) -> int:
        return self._version

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args))
        except _actor_errors() as exc:
            ckpt = latest_checkpoint(self.run_dir)
            where = (
                f"rerun the same command to resume from {ckpt}"
                if ckpt is not None
                else "no checkpoint was written yet (set pipeline.checkpoint_every to bound the loss)"
            )
            raise LearnerLostError(
                f"the learner actor died ({type(exc).__name__}) during {method}: the run stops; {where}"
            ) from None

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        metrics, self._version = self._call("train_step", batch)
        return metrics

    def export_weights(self) -> Any:
        """A ref to the exported state dict (the payload of the versioned weight message), not the tensors."""
        (ref,) = self._call("export_weights")
        return ref

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._version = self._call("load_checkpoint", path)


class EnvWorkerPool:
    """The orchestrator's ``play_group`` over env worker actors; see the module docstring."""

    def __init__(self, workers: Sequence[Any], gateway: Any, held: Iterable[int] = ()) -> None:
        """``held``: groups the gateway has transcripts for when the run starts (a resume after the
        whole run stopped): played from them on their first attempt, like a dead worker's groups."""
        self.workers = list(workers)
        self.gateway = gateway
        self.to_resume = set(held)
        self.delivered: set[int] = set()  # trajectories here, transcripts kept until a checkpoint covers them
        self.load = [0] * len(self.workers)
        self.liveness = _Prober(self.workers, "ready")
        self.counters: Counter[str] = Counter()
        self.payload_bytes = 0

    def _pick(self, avoid: int | None) -> int:
        down = self.liveness.down
        order = sorted(range(len(self.workers)), key=lambda i: (i in down, i == avoid, self.load[i], i))
        return order[0]

    async def play(self, index: int, task: Task, sampling: SamplingParams) -> list[Trajectory]:
        import ray

        errors = _actor_errors()
        attempt, failed = 0, None
        while True:
            i = self._pick(failed)
            self.load[i] += 1
            replay = attempt > 0 or index in self.to_resume
            ref = self.workers[i].play_group.remote(index, task, sampling, replay)
            try:
                result = await ref
            except asyncio.CancelledError:
                ray.cancel(ref)  # the run is stopping: the worker drops the group too
                raise
            except errors:
                self.counters["env_worker_failures"] += 1
                self.counters["groups_replayed"] += 1 if attempt == 0 else 0
                self.liveness.failed(i)
                attempt, failed = attempt + 1, i
                if attempt > 10 * len(self.workers) + 10:
                    raise WorkerLostError(
                        f"group {index}: every env worker failed it {attempt} times; the workers are gone "
                        f"(ray.env_worker_max_restarts exhausted, or their nodes lost)"
                    ) from None
                await asyncio.sleep(_ACTOR_BACKOFF.delay(attempt - 1))
                continue
            finally:
                self.load[i] -= 1
            self.liveness.answered(i)
            self.counters.update(result.counters)
            self.counters["groups_played"] += 1
            self.payload_bytes += result.payload_bytes
            self.to_resume.discard(index)
            self.delivered.add(index)
            if replay:  # its transcripts' tokens keep the versions of the first attempt
                return [dataclasses.replace(t, info={**t.info, REPLAYED: True}) for t in result.trajectories]
            return result.trajectories

    def checkpointed(self, inflight: Collection[int]) -> None:
        """A checkpoint was written: the groups it does not leave in flight need no transcripts."""
        done = self.delivered - set(inflight)
        if done:
            # fire and forget: a released group gets no new transcripts, so the order does not matter
            self.gateway.release.remote(sorted(done))
            self.delivered -= done

    def health(self) -> Mapping[str, Any]:
        return {"up": len(self.workers) - len(self.liveness.down), "total": len(self.workers)}

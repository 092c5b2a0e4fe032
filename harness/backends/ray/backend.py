"""``backend=ray``: start the actors of a run and hand ``train`` the same interfaces as in-process.

::

    driver (orchestrator, eval) ──play_group──▶ EnvWorker × ray.env_workers ──generate──▶ SamplerActor × ray.samplers
          │  train_step(batch)                        │ lab calls + transcripts                  ▲ weights ref
          ▼                                           ▼                                          │ (versioned)
      LearnerActor (placement group over its GPUs)  LabGateway (head node: journal)       Control (head node)

Per step: one group result per group (G episodes, one transfer), one batch to
the learner, one weights ref published (``Control`` then every sampler). The
orchestrator, buffer, admission and rollout code are the in-process ones.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from labrl.harness.backends.base import RunParts, RunStart
from labrl.harness.backends.parts import ShouldStop
from labrl.harness.backends.ray.actors import Control, EnvWorker, LearnerActor, SamplerActor
from labrl.harness.backends.ray.clients import EnvWorkerPool, LearnerClient, RemoteSampler
from labrl.harness.backends.ray.config import RaySection
from labrl.harness.backends.ray.lab_gateway import LabGateway, gateway_factory
from labrl.harness.backends.ray.placement import Demand, check_placement, cluster_nodes, wait_placed
from labrl.harness.backends.ray.transcript_store import FILE_NAME as TRANSCRIPTS_FILE
from labrl.harness.backends.ray.transcript_store import discard as discard_transcripts
from labrl.harness.config import RunConfig


def actor_name(run_dir: str, role: str) -> str:
    """The Ray name of a run's actor (``env0``, ``sampler0``, ``learner``, ``gateway``): ``ray.get_actor`` finds it."""
    return f"labrl:{Path(run_dir).resolve()}:{role}"


def demands(cfg: RunConfig) -> list[Demand]:
    """What the run asks of the cluster, per role (``check_placement`` input)."""
    r = cfg.ray

    def res(cpus: float, gpus: float, custom: dict[str, float]) -> dict[str, float]:
        out = {k: v for k, v in custom.items() if v > 0}
        if cpus > 0:
            out["CPU"] = cpus
        if gpus > 0:
            out["GPU"] = gpus
        return out

    return [
        Demand("learner", 1, res(r.learner_cpus, r.learner_gpus, r.learner_resources)),
        Demand("sampler", r.samplers, res(r.cpus_per_sampler, r.gpus_per_sampler, r.sampler_resources)),
        Demand("env worker", r.env_workers, res(r.cpus_per_env_worker, 0, r.env_worker_resources)),
    ]


def connect(r: RaySection) -> bool:
    """Join ``ray.address`` or start a local Ray; True when this call started it (and must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING"}
    if r.address is None:
        kwargs["num_cpus"] = r.num_cpus
    else:
        kwargs["address"] = r.address
    ray.init(**kwargs)
    return True


def _head_affinity() -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def _learner_options(r: RaySection) -> tuple[dict[str, Any], Any]:
    """Actor options of the learner; with GPUs, a placement group holding them (one bundle: one process)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    options: dict[str, Any] = {
        "num_cpus": r.learner_cpus,
        "resources": dict(r.learner_resources),
        "max_restarts": 0,
    }
    if r.learner_gpus == 0:
        return options, None
    bundle = {"CPU": r.learner_cpus, "GPU": float(r.learner_gpus)} | dict(r.learner_resources)
    pg = placement_group([{k: v for k, v in bundle.items() if v > 0}], strategy="STRICT_PACK")
    if not pg.wait(r.placement_timeout_s):
        from labrl.errors import PlacementError

        raise PlacementError(
            f"learner placement group {bundle} not ready within ray.placement_timeout_s={r.placement_timeout_s:g} s"
        )
    options |= {
        "num_gpus": r.learner_gpus,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0
        ),
    }
    return options, pg


#: how often the driver looks for a stop request while the learner actor warm-starts
STOP_POLL_S = 0.1


async def remote_warm_start(
    learner_actor: Any, control: Any, should_stop: ShouldStop
) -> tuple[list[dict[str, Any]], float]:
    """The learner actor's warm start (``parts.warm_start``); (sft records, sft seconds).

    A stop requested here (polled every ``STOP_POLL_S``) reaches the actor through ``Control``,
    which the actor polls between SFT steps.
    """
    stop_sent = should_stop()
    if stop_sent:
        await control.request_stop.remote()
    call = asyncio.ensure_future(learner_actor.warm_start.remote(control))
    while not call.done():
        await asyncio.wait([call], timeout=STOP_POLL_S)
        if not stop_sent and should_stop():
            stop_sent = True
            await control.request_stop.remote()
    return call.result()


class RayBackend:
    """``backend=ray``: connect, check placement, start the actors; the ``RunParts`` of ``train``."""

    async def start(self, run: RunStart) -> RunParts:
        """The env workers build their own env factory and tokenizer (``parts``); the driver's
        ``run.make_env`` and ``run.tokenizer`` serve its evaluation episodes."""
        cfg, resume, on_sft, should_stop = run.cfg, run.resume, run.on_sft, run.should_stop
        import ray

        from labrl.envs.lab.session import use_connection_factory

        r = cfg.ray
        started_ray = await asyncio.to_thread(connect, r)
        check_placement(demands(cfg), await asyncio.to_thread(cluster_nodes))
        data = cfg.model_dump(mode="json")
        created: list[Any] = []
        pgs: list[Any] = []

        def new(cls: type, **options: Any) -> Any:
            return ray.remote(cls).options(**options)

        def name(role: str) -> str:
            return actor_name(cfg.run_dir, role)

        async def place(actors: list[Any], what: str) -> None:
            """``actors`` join ``created`` (killed if the start fails) and must be ready within the placement timeout."""
            created.extend(actors)
            await asyncio.to_thread(
                wait_placed, [a.ready.remote() for a in actors], r.placement_timeout_s, what
            )

        try:
            head = _head_affinity()
            control = new(Control, num_cpus=0, scheduling_strategy=head, name=name("control")).remote()
            # its transcripts on the head's disk, in the run directory (pinned there with the driver)
            transcripts = Path(cfg.run_dir).resolve() / TRANSCRIPTS_FILE
            if not resume:
                discard_transcripts(transcripts)
            gateway = new(
                LabGateway, num_cpus=0, scheduling_strategy=head, max_restarts=-1, max_concurrency=100_000,
                name=name("gateway"),
            ).remote(str(transcripts))  # fmt: skip
            created += [control, gateway]
            learner_options, pg = await asyncio.to_thread(_learner_options, r)
            pgs += [pg] if pg is not None else []
            learner_actor = new(LearnerActor, name=name("learner"), **learner_options).remote(data)
            created.append(learner_actor)
            _, _, version = await asyncio.to_thread(
                wait_placed,
                [control.ping.remote(), gateway.ping.remote(), learner_actor.version.remote()],
                r.placement_timeout_s,
                "the learner actor (or the head-node actors)",
            )
            sft_s = 0.0
            if not resume:
                records, sft_s = await remote_warm_start(learner_actor, control, should_stop)
                for record in records:
                    on_sft(record)
            version = await learner_actor.version.remote()  # after the warm start
            learner = LearnerClient(learner_actor, cfg.run_dir, version)
            await control.set_policy.remote(
                learner.version, [await asyncio.to_thread(learner.export_weights)]
            )
            urls = cfg.sampler.sglang.urls
            samplers = [
                new(
                    SamplerActor, num_cpus=r.cpus_per_sampler, num_gpus=r.gpus_per_sampler,
                    resources=dict(r.sampler_resources), max_restarts=r.sampler_max_restarts,
                    max_concurrency=100_000, name=name(f"sampler{i}"),
                ).remote(data, control, f"sampler{i}", tuple(urls[i :: r.samplers]) if cfg.sampler.kind == "sglang" else None)
                for i in range(r.samplers)
            ]  # fmt: skip
            await place(samplers, f"{r.samplers} sampler actor(s)")
            sampler = RemoteSampler(
                samplers, control, version=learner.version, reissue_timeout_s=r.reissue_timeout_s,
                coalesce_s=r.generate_coalesce_s,
            )  # fmt: skip
            workers = [
                new(
                    EnvWorker, num_cpus=r.cpus_per_env_worker, resources=dict(r.env_worker_resources),
                    max_restarts=r.env_worker_max_restarts, max_concurrency=100_000, name=name(f"env{i}"),
                    **({"scheduling_strategy": "SPREAD"} if r.spread_env_workers else {}),
                ).remote(data, samplers, gateway, control, f"env{i}", r.reissue_timeout_s)
                for i in range(r.env_workers)
            ]  # fmt: skip
            await place(workers, f"{r.env_workers} env worker(s)")
        except BaseException:
            for handle in created:
                ray.kill(handle, no_restart=True)
            if started_ray:
                ray.shutdown()
            raise
        use_connection_factory(
            gateway_factory(gateway)
        )  # the driver's eval episodes call the lab through it too
        pool = EnvWorkerPool(workers, gateway, held=await gateway.held.remote())
        monitor = RayMonitor(pool, sampler, control, gateway, learner)

        async def close() -> dict[str, Any]:
            summary = await monitor.summary()
            pool.liveness.close()
            sampler.liveness.close()
            use_connection_factory(None)
            for handle in created:
                ray.kill(handle, no_restart=True)
            for group in pgs:
                ray.util.remove_placement_group(group)
            if started_ray:
                ray.shutdown()
            return summary

        return RunParts(
            learner=learner, sampler=sampler, sft_s=sft_s, play_group=pool.play, step_extras=monitor.step_record,
            on_checkpoint=pool.checkpointed, close=close,
        )  # fmt: skip


class RayMonitor:
    """The ``ray/*`` numbers of each step record and the per-actor health of the progress line."""

    def __init__(
        self, pool: EnvWorkerPool, sampler: RemoteSampler, control: Any, gateway: Any, learner
    ) -> None:
        self.pool, self.sampler, self.control, self.gateway, self.learner = (
            pool,
            sampler,
            control,
            gateway,
            learner,
        )
        self._last_payload = 0
        self._t = time.perf_counter()

    async def counters(self) -> dict[str, Any]:
        restarts, lab = await asyncio.gather(self.control.restarts.remote(), self.gateway.stats.remote())
        out: dict[str, Any] = {f"ray/{k}": v for k, v in self.pool.counters.items()}
        out["ray/env_worker_restarts"] = sum(v for k, v in restarts.items() if k.startswith("env"))
        out["ray/sampler_restarts"] = sum(v for k, v in restarts.items() if k.startswith("sampler"))
        out["ray/requests_reissued_driver"] = self.sampler.counters["requests_reissued"]
        out["ray/jobs_reattached"] = lab.get("jobs_reattached", 0)
        out["ray/lab_calls"] = lab.get("lab_calls", 0)
        for k, v in lab.items():
            if k.startswith(("mock/", "journal/")):
                out[f"ray/{k}"] = v
        return out

    async def step_record(self) -> dict[str, Any]:
        out = await self.counters()
        out["ray/group_payload_bytes"] = self.pool.payload_bytes - self._last_payload
        self._last_payload = self.pool.payload_bytes
        env = self.pool.health()
        samplers_up = len(self.sampler.actors) - len(self.sampler.down)
        out["ray/env_workers_up"] = env["up"]
        out["ray/samplers_up"] = samplers_up
        out["health"] = (
            f"ray: env {env['up']}/{env['total']} (restarts {out['ray/env_worker_restarts']})  "
            f"samplers {samplers_up}/{len(self.sampler.actors)} (restarts {out['ray/sampler_restarts']})  "
            f"learner up  lab jobs re-attached {out['ray/jobs_reattached']}"
        )
        return out

    async def summary(self) -> dict[str, Any]:
        try:
            return {k.removeprefix("ray/"): v for k, v in (await self.counters()).items()}
        except Exception as exc:  # the cluster may be half gone when a run fails
            return {"error": f"{type(exc).__name__}: {exc}"}

"""The bodies of the actors of a ``backend=ray`` run (plain classes; ``backend`` wraps them with ``ray.remote``).

=============== ======================= ===============================================
actor           placed                  holds
=============== ======================= ===============================================
``Control``     head node (the driver's) current policy (version, weights ref); actor starts
``LabGateway``  head node               lab connection + journal + episode transcripts
``LearnerActor`` its GPUs (placement     ``MegatronLearner``: train_step, export, checkpoints
                group) or CPUs
``SamplerActor`` ``ray.samplers`` x      local sampler, or ``SGLangSampler`` fronting its URLs
``EnvWorker``   ``ray.env_workers`` x    many concurrent groups through ``rollout_group``
=============== ======================= ===============================================

Each builds its component with the builders both backends share (``labrl.harness.backends.parts``)
from the run config, so both backends run one code path.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from labrl.envs.types import Task
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams, TrainBatch, Trajectory


def _actor_setup(cfg_data: dict[str, Any]):
    """What each model-building actor process does first: the CLI's warning filters (a Ray worker is
    a fresh process, so megatron's notices would otherwise fill the driver's log), then its config."""
    from labrl._warnings import quiet_expected_warnings
    from labrl.harness.config import build_run_config

    quiet_expected_warnings()
    return build_run_config(cfg_data)


class Control:
    """The current policy (version and a ref to its weights) and how often each actor has started.

    A sampler actor that (re)starts loads the policy from here before it serves,
    so a restarted sampler is never behind the run; ``starts`` minus one per
    actor is its restart count.
    """

    def __init__(self) -> None:
        self.version = -1
        self.weights: list[Any] = []  # [ObjectRef]: nested, so Ray passes the ref instead of the value
        self.starts: Counter[str] = Counter()
        self.stopping = False

    def set_policy(self, version: int, weights: list[Any]) -> None:
        if version >= self.version:
            self.version, self.weights = version, list(weights)

    def policy(self) -> tuple[int, list[Any]]:
        return self.version, self.weights

    def started(self, name: str) -> int:
        self.starts[name] += 1
        return self.starts[name]

    def restarts(self) -> dict[str, int]:
        return {name: n - 1 for name, n in self.starts.items()}

    def request_stop(self) -> None:
        """The driver was asked to stop (SIGINT / SIGTERM): an actor's long call (the warm start) ends early."""
        self.stopping = True

    def stop_requested(self) -> bool:
        return self.stopping

    def ping(self) -> bool:
        return True


class LearnerActor:
    """``MegatronLearner`` built as in-process; ``train_step`` returns (metrics, version)."""

    def __init__(self, cfg_data: dict[str, Any]) -> None:
        from labrl.harness.backends.parts import build_learner

        self.cfg = _actor_setup(cfg_data)
        torch.set_num_threads(self.cfg.pipeline.torch_threads)
        torch.manual_seed(self.cfg.seed)  # as train() does before building the learner in-process
        self.learner = build_learner(self.cfg)

    def version(self) -> int:
        return self.learner.version

    def warm_start(self, control: Any) -> tuple[list[dict[str, Any]], float]:
        """``parts.warm_start`` here; (sft records, sft seconds). Polls ``control`` for a stop between steps."""
        import ray

        from labrl.harness.backends.parts import build_tokenizer, make_env_factory, warm_start

        def should_stop() -> bool:
            return ray.get(control.stop_requested.remote())

        records: list[dict[str, Any]] = []
        sft_s = asyncio.run(
            warm_start(
                self.learner, self.cfg, build_tokenizer(self.cfg), make_env_factory(self.cfg),
                on_sft=records.append, should_stop=should_stop,
            )
        )  # fmt: skip
        return records, sft_s

    def train_step(self, batch: TrainBatch) -> tuple[dict[str, float], int]:
        metrics = self.learner.train_step(batch)
        return metrics, self.learner.version

    def export_weights(self) -> list[Any]:
        """``[ref]`` to the exported state dict, put by this actor (nested, so the caller gets the ref)."""
        import ray

        return [ray.put(self.learner.export_weights())]

    def save_checkpoint(self, path: str) -> None:
        self.learner.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> int:
        self.learner.load_checkpoint(path)
        return self.learner.version


class SamplerActor:
    """A sampler (local, or SGLang fronting ``urls``) that loads the current policy from ``Control`` first.

    The sampler is built on the first call after each (re)start, from the
    policy ``Control`` holds then: a restarted actor serves nothing before it
    is re-synced to the run's current version.
    """

    def __init__(
        self, cfg_data: dict[str, Any], control: Any, name: str, urls: tuple[str, ...] | None = None
    ) -> None:
        self.cfg = _actor_setup(cfg_data)
        self.control = control
        self.name = name
        self.urls = urls
        self.sampler: Any = None
        self._starting: asyncio.Task | None = None
        torch.set_num_threads(self.cfg.pipeline.torch_threads)

    async def _ready(self) -> Any:
        if self.sampler is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._start())
            await asyncio.shield(self._starting)
        return self.sampler

    async def _start(self) -> None:
        from labrl.harness.backends.parts import build_sampler_from, build_tokenizer, run_components

        await self.control.started.remote(self.name)
        version, refs = await self.control.policy.remote()
        weights = await refs[0]
        tokenizer = build_tokenizer(self.cfg)
        sampler_cfg = run_components(self.cfg, tokenizer).sampler
        if self.urls is not None:  # this actor fronts its share of the SGLang servers only
            sampler_cfg = sampler_cfg.model_copy(update={"urls": self.urls})
        self.sampler = await build_sampler_from(
            self.cfg, weights, version, tokenizer, sampler_cfg=sampler_cfg
        )

    async def ready(self) -> int:
        return (await self._ready()).version

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await (await self._ready()).generate(requests)

    async def update_weights(
        self, weights: dict[str, torch.Tensor], version: int, force: bool = False
    ) -> int:
        sampler = await self._ready()
        if force or version > sampler.version:
            await sampler.update_weights(weights, version, force=force)
        return sampler.version

    async def pid(self) -> int:
        return os.getpid()


@dataclass
class GroupResult:
    """One group's trajectories (one object-store transfer for G episodes) and what its playing took."""

    trajectories: list[Trajectory]
    counters: dict[str, int] = field(default_factory=dict)
    payload_bytes: int = 0


class EnvWorker:
    """Plays groups: ``rollout_group`` with envs made here and generations from the sampler actors."""

    def __init__(
        self, cfg_data: dict[str, Any], samplers: list[Any], gateway: Any, control: Any, name: str,
        reissue_timeout_s: float,
    ) -> None:  # fmt: skip
        from labrl.envs.lab.session import use_connection_factory
        from labrl.harness.backends.parts import build_tokenizer, make_env_factory
        from labrl.harness.backends.ray.clients import RemoteSampler
        from labrl.harness.backends.ray.lab_gateway import gateway_factory
        from labrl.harness.backends.ray.transcripts import TranscriptSampler

        self.cfg = _actor_setup(cfg_data)
        torch.set_num_threads(1)
        use_connection_factory(gateway_factory(gateway))
        self.make_env = make_env_factory(self.cfg)
        self.tokenizer = build_tokenizer(self.cfg)
        self.remote = RemoteSampler(
            samplers, reissue_timeout_s=reissue_timeout_s, coalesce_s=self.cfg.ray.generate_coalesce_s
        )
        self.sampler = TranscriptSampler(self.remote)
        self.gateway = gateway
        self.control = control
        self.name = name
        self._registered = False

    async def play_group(
        self, index: int, task: Task, sampling: SamplingParams, resume: bool = False
    ) -> GroupResult:
        from labrl.harness.backends.ray.transcripts import GroupTranscript, current_group
        from labrl.harness.rollout.play import rollout_group

        await self.ready()
        saved = await self.gateway.saved.remote(index) if resume else {}
        group = GroupTranscript(index, saved)
        size = self.cfg.pipeline.group_size

        async def play() -> list[Trajectory]:
            current_group.set(group)  # this task and the member tasks it starts
            return await rollout_group(
                self.make_env, task, self.sampler, self.tokenizer, sampling, size,
                return_routed_experts=self.cfg.learner.router_replay,
            )  # fmt: skip

        trajectories = await asyncio.ensure_future(play())
        counters = dict(group.counters)
        if resume:
            resumed = sum(group.resumed(m) for m in range(size))
            counters["episodes_resumed"] = resumed
            counters["episodes_rerun"] = size - resumed
        payload = len(pickle.dumps(trajectories, protocol=5))
        return GroupResult(trajectories, counters, payload)

    async def ready(self) -> int:
        """The pid, once this incarnation is counted by ``Control`` (async, so not in ``__init__``)."""
        if not self._registered:
            self._registered = True
            await self.control.started.remote(self.name)
        return os.getpid()

    async def stats(self) -> dict[str, int]:
        return dict(self.remote.counters)

    async def pid(self) -> int:
        return os.getpid()

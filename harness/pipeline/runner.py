"""Build a training run from a ``RunConfig`` and run it: what ``labrl train`` calls.

::

    run_dir/
      config.yaml       the resolved config (file + overrides)
      sft.jsonl         warm-start loss per step (when sft.enabled)
      metrics.jsonl     one record per learner step
      eval.jsonl        one record per evaluation on the test split
      trained.jsonl     the group indices trained at each step
      checkpoints/      step_N/{learner.pt, pipeline.pt} and `latest`
      summary.json      final numbers

Threads: the learner's ``train_step`` runs in a worker thread and the local
sampler's forwards in another, so with ``pipeline.torch_threads = 1`` each
owns one of the two cores of a laptop-class machine instead of both
oversubscribing a shared intra-op pool.

A run directory with a checkpoint is resumed (the warm start is skipped);
``fresh=True`` refuses to reuse a directory that already has one.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labrl.errors import ConfigError
from labrl.harness.config import ComponentConfigs, RunConfig, component_configs, dump_run_config
from labrl.harness.metrics import JsonlWriter, LiveProgress
from labrl.harness.pipeline.orchestrator import Orchestrator, latest_checkpoint
from labrl.harness.pipeline.overlong import BudgetForcingSampler
from labrl.harness.samplers.local import LocalSamplerConfig
from labrl.harness.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from labrl.harness.types import Closeable


def make_env_factory(cfg: RunConfig):
    from labrl.envs import make

    budgets = cfg.env.budgets or None

    def factory():
        return make(cfg.env.id, budgets=budgets, **cfg.env.options)

    factory()  # fail fast on a bad id or option, before anything is built
    return factory


def run_components(cfg: RunConfig, tokenizer: Tokenizer | None = None) -> ComponentConfigs:
    """The component configs of this run (``labrl.harness.config.component_configs``)."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer(cfg)
    return component_configs(cfg, model=cfg.model.resolve(), pad_token_id=tokenizer.pad_token_id)


def build_learner(cfg: RunConfig, tokenizer: Tokenizer | None = None):
    from labrl.harness.learners import MegatronLearner

    return MegatronLearner(run_components(cfg, tokenizer).learner)


def build_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The byte tokenizer of the from-scratch presets, or the tokenizer shipped with ``model.init_from_hf``."""
    if cfg.model.init_from_hf is None:
        return ByteTokenizer()
    return HFTokenizer(cfg.model.init_from_hf)


def initialise_from_hf(learner, path: str, model_cfg) -> None:
    """Load a Hugging Face MoE checkpoint's weights into the learner's megatron-core model."""
    from labrl.harness.hf_import import load_hf_checkpoint, load_into_model

    load_into_model(learner.model, load_hf_checkpoint(path, model_cfg))


async def build_sampler(cfg: RunConfig, learner, tokenizer: Tokenizer):
    """The run's sampler, holding the learner's current weights and version."""
    return await build_sampler_from(cfg, learner.export_weights(), learner.version, tokenizer)


async def build_sampler_from(
    cfg: RunConfig, weights, version: int, tokenizer: Tokenizer, *, sglang_urls: tuple[str, ...] | None = None
):
    """The run's sampler holding ``weights`` as policy ``version`` (a Ray sampler actor builds its own here).

    ``sglang_urls`` narrows ``sampler.sglang.urls`` to the servers one sampler actor fronts.
    """
    components = run_components(cfg, tokenizer)
    model_cfg = components.model
    if isinstance(components.sampler, LocalSamplerConfig):
        from labrl.harness.samplers.local import LocalSampler

        sampler = LocalSampler(model_cfg, components.sampler, weights=weights, version=version)
    else:
        from labrl.harness.samplers.sglang import make_sglang_sampler

        sglang_cfg = components.sampler
        if sglang_urls is not None:  # the servers one Ray sampler actor fronts
            sglang_cfg = sglang_cfg.model_copy(update={"urls": tuple(sglang_urls)})
        # both transports move hf_export.hf_weights of the learner's weights (HF names, training dtype)
        sampler = make_sglang_sampler(sglang_cfg, model_cfg)
        # The servers hold whatever they were launched with (or a previous run's weights):
        # set them to the learner's weights and version, which may not be newer.
        await sampler.start()
        await sampler.update_weights(weights, version, force=True)
    overlong = cfg.pipeline.overlong
    if overlong.mode == "force":
        sampler = BudgetForcingSampler(sampler, tokenizer.encode(overlong.cue), overlong.answer_tokens)
    return sampler


@dataclass
class RunParts:
    """What a backend builds for ``train``: the learner and sampler the orchestrator drives, and hooks."""

    learner: Any
    sampler: Any
    sft_s: float = 0.0
    play_group: Any = None  # Orchestrator's group player; None: rollout_group in this process
    step_extras: Any = None  # async () -> dict merged into each step record
    close: Callable[[], Awaitable[dict[str, Any]]] = field(default=lambda: _nothing())


async def _nothing() -> dict[str, Any]:
    return {}


async def start_inprocess(
    cfg: RunConfig, tokenizer: Tokenizer, make_env, *, resume: bool, on_sft
) -> RunParts:
    """Learner and sampler in this process (the default backend); warm start unless resuming."""
    learner = build_learner(cfg)
    if not resume and cfg.model.init_from_hf is not None:  # a resumed run loads its own checkpoint
        initialise_from_hf(learner, cfg.model.init_from_hf, cfg.model.resolve())
    sft_s = 0.0
    if not resume and cfg.sft.enabled:
        from labrl.harness.sft import run_sft

        t0 = time.perf_counter()
        await run_sft(learner.model, make_env, tokenizer, cfg.sft, seed=cfg.seed, on_step=on_sft)
        sft_s = time.perf_counter() - t0
    sampler = await build_sampler(cfg, learner, tokenizer)
    return RunParts(learner=learner, sampler=sampler, sft_s=sft_s)


async def train(cfg: RunConfig, *, fresh: bool = False, progress: bool | None = None) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and fresh:
        raise ConfigError(
            f"{run_dir} already holds a checkpoint ({ckpt.name}): choose another run_dir or resume"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_run_config(cfg))
    torch.set_num_threads(cfg.pipeline.torch_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer(cfg)
    model_cfg = cfg.model.resolve()
    if model_cfg.vocab_size != tokenizer.vocab_size:
        raise ConfigError(
            f"model vocab_size {model_cfg.vocab_size} differs from the tokenizer's {tokenizer.vocab_size}: "
            "set model.overrides.vocab_size"
        )
    components = run_components(cfg, tokenizer)  # every component config validated before anything is built
    make_env = make_env_factory(cfg)
    show = cfg.pipeline.progress if progress is None else progress
    live = LiveProgress(cfg.pipeline.total_steps, rich_view=show)
    started = time.perf_counter()
    sft_writer = JsonlWriter(run_dir / "sft.jsonl") if ckpt is None and cfg.sft.enabled else None
    every = max(1, cfg.sft.steps // 5)

    def on_sft(r: dict[str, Any]) -> None:
        assert sft_writer is not None
        sft_writer.write(r)
        if r["sft_step"] % every == 0:
            live.message(f"sft step {r['sft_step']}/{cfg.sft.steps}  loss {r['loss']:.3f}")

    if cfg.backend == "ray":
        from labrl.harness.distributed.backend import start_ray

        parts = await start_ray(cfg, tokenizer=tokenizer, resume=ckpt is not None, on_sft=on_sft)
    else:
        parts = await start_inprocess(cfg, tokenizer, make_env, resume=ckpt is not None, on_sft=on_sft)
    if sft_writer is not None:
        sft_writer.close()
    learner, sampler = parts.learner, parts.sampler
    metrics = JsonlWriter(run_dir / "metrics.jsonl")
    evals = JsonlWriter(run_dir / "eval.jsonl")

    def on_step(record: dict[str, Any]) -> None:
        metrics.write(record)
        live.update(record)

    def on_eval(record: dict[str, Any]) -> None:
        evals.write(record)
        live.message(
            f"eval @ step {record['step']}: accuracy {record['accuracy']:.3f} "
            f"(n={record['n']}, {record['time_s'] / 60:.1f} min)"
        )

    loop = asyncio.get_running_loop()
    installed = []
    try:
        orch = Orchestrator(
            cfg.pipeline,
            make_env=make_env,
            sampler=sampler,
            learner=learner,
            tokenizer=tokenizer,
            sampling=components.sampling,
            seed=cfg.seed,
            run_dir=run_dir,
            return_routed_experts=cfg.learner.router_replay,
            on_step=on_step,
            on_eval=on_eval,
            play_group=parts.play_group,
            step_extras=parts.step_extras,
        )
        if ckpt is not None:
            await orch.resume(ckpt)
            live.message(f"resumed from {ckpt} at step {orch.step}")
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, orch.request_stop)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread
                pass
        result = await orch.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if isinstance(sampler, Closeable):  # SGLangSampler's HTTP client; BudgetForcingSampler passes it on
            await sampler.close()
        backend_summary = await parts.close()
        live.close()
        metrics.close()
        evals.close()
    summary = {
        **result,
        "total_wall_s": time.perf_counter() - started,
        "sft_s": parts.sft_s,
        "interrupted": orch.step < cfg.pipeline.total_steps,
        "eval_history": orch.eval_history,
        "backend": cfg.backend,
        **({"ray": backend_summary} if backend_summary else {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary

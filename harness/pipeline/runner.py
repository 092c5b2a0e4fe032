"""Build a training run from a ``RunConfig`` and run it: what ``labrl train`` calls.

::

    run_dir/
      config.yaml       the resolved config (file + overrides)
      effective.json    what its auto and mode-derived keys resolved to (labrl.harness.effective)
      sft.jsonl         warm-start loss per step (when sft.enabled)
      metrics.jsonl     one record per learner step
      eval.jsonl        one record per evaluation on the test split
      trained.jsonl     the group indices trained at each step
      errors.jsonl      failed episodes and internal errors, with tracebacks (errors_log)
      resumes.jsonl     the tunable keys changed at each resume (resume)
      checkpoints/      step_N/{learner.pt, pipeline.pt} and `latest`
      summary.json      final numbers

Threads: the learner's ``train_step`` runs in a worker thread and the local
sampler's forwards in another, so with ``pipeline.torch_threads = 1`` each
owns one of the two cores of a laptop-class machine instead of both
oversubscribing a shared intra-op pool.

A run directory with a checkpoint is resumed (the warm start is skipped) if
its identity keys match (``resume``), and its step-indexed logs are cut back
to the checkpoint's step; ``fresh=True`` refuses to reuse a directory that
already has one. After the warm start a step-0 checkpoint is written, so a
kill never repeats a finished warm start.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from labrl.errors import ConfigError, LabrlError, RunFailedError
from labrl.harness.config import (
    ComponentConfigs,
    RunConfig,
    component_configs,
    dump_run_config,
    learnability_warnings,
)
from labrl.harness.effective import effective_values, read_effective, write_effective
from labrl.harness.metrics import JsonlWriter, LiveProgress, read_jsonl
from labrl.harness.pipeline.checkpoint import checkpoint_step, write_summary
from labrl.harness.pipeline.errors_log import ErrorLog
from labrl.harness.pipeline.orchestrator import Orchestrator, latest_checkpoint
from labrl.harness.pipeline.overlong import BudgetForcingSampler
from labrl.harness.pipeline.resume import check_resume, log_resume, previous_config, truncate_run_logs
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
    from labrl.harness.models.hf_import import load_hf_checkpoint, load_into_model

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
        from labrl.harness.samplers.sglang.sampler import make_sglang_sampler

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
    on_checkpoint: Any = None  # (indices of the groups a checkpoint leaves in flight) -> None
    close: Callable[[], Awaitable[dict[str, Any]]] = field(default=lambda: _nothing())


async def _nothing() -> dict[str, Any]:
    return {}


async def start_inprocess(
    cfg: RunConfig, tokenizer: Tokenizer, make_env, *, resume: bool, on_sft, should_stop=None
) -> RunParts:
    """Learner and sampler in this process (the default backend); warm start unless resuming.

    ``should_stop`` (polled between warm-start steps) ends the warm start early.
    """
    learner = build_learner(cfg)
    if not resume and cfg.model.init_from_hf is not None:  # a resumed run loads its own checkpoint
        initialise_from_hf(learner, cfg.model.init_from_hf, cfg.model.resolve())
    sft_s = 0.0
    if not resume and cfg.sft.enabled:
        from labrl.harness.rollout.sft import run_sft

        t0 = time.perf_counter()
        await run_sft(
            learner.model,
            make_env,
            tokenizer,
            cfg.sft,
            seed=cfg.seed,
            on_step=on_sft,
            should_stop=should_stop,
        )
        sft_s = time.perf_counter() - t0
    sampler = await build_sampler(cfg, learner, tokenizer)
    return RunParts(learner=learner, sampler=sampler, sft_s=sft_s)


class StopRequest:
    """SIGINT / SIGTERM: remember the first signal and ask the orchestrator (once it exists) to stop."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.orchestrator: Orchestrator | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __call__(self, sig: signal.Signals) -> None:
        if self.signal_name is None:
            self.signal_name = sig.name
        if self.orchestrator is not None:
            self.orchestrator.request_stop()

    def attach(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        if self.requested:
            orchestrator.request_stop()


def _install(loop: asyncio.AbstractEventLoop, stop: StopRequest) -> list[signal.Signals]:
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    return installed


async def train(cfg: RunConfig, *, fresh: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Validate everything, then train (or resume) into ``cfg.run_dir``; returns the summary.

    Nothing is written before the config, the model, the tokenizer, the env and
    (on resume) the identity keys are checked. SIGINT / SIGTERM in any phase
    stop the run: during the warm start nothing is saved (a rerun starts it
    again); after it, the running step finishes and a checkpoint is written.
    The summary's ``stopped_by`` names the signal. An unexpected error is
    logged with its traceback to ``errors.jsonl`` and raised as
    ``RunFailedError`` (one line).
    """
    run_dir = Path(cfg.run_dir)
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and fresh:
        raise ConfigError(
            f"{run_dir} already holds a checkpoint ({ckpt.name}): choose another run_dir or resume"
        )
    # -- every check that can reject the run, before anything is written --
    tokenizer = build_tokenizer(cfg)
    model_cfg = cfg.model.resolve()
    if model_cfg.vocab_size != tokenizer.vocab_size:
        raise ConfigError(
            f"model vocab_size {model_cfg.vocab_size} differs from the tokenizer's {tokenizer.vocab_size}: "
            "set model.overrides.vocab_size"
        )
    components = run_components(cfg, tokenizer)  # every component config validated before anything is built
    make_env = make_env_factory(cfg)
    effective = effective_values(cfg)  # every auto resolved once, before anything is written
    changes: dict[str, tuple[Any, Any]] = {}
    if ckpt is not None:
        previous = previous_config(run_dir)
        if previous is not None:
            changes = check_resume(previous, cfg, recorded=read_effective(run_dir), effective=effective)
    # -- the run directory --
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_run_config(cfg))
    write_effective(run_dir, effective)
    resume_step = checkpoint_step(ckpt) if ckpt is not None else -1
    truncate_run_logs(run_dir, resume_step)
    errors = ErrorLog(run_dir)
    show = cfg.pipeline.progress if progress is None else progress
    live = LiveProgress(cfg.pipeline.total_steps, rich_view=show)
    for text in learnability_warnings(cfg) if ckpt is None else []:
        live.message(f"warning: {text}")
    if changes:
        log_resume(run_dir, resume_step, changes)
        live.message(
            "resuming with changed settings: "
            + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changes.items())
        )
    loop = asyncio.get_running_loop()
    stop = StopRequest()
    installed = _install(loop, stop)
    try:
        return await _train(cfg, ckpt, run_dir, tokenizer, model_cfg, components, make_env, live, stop)
    except LabrlError as exc:
        errors.internal(exc, step=stop.orchestrator.step if stop.orchestrator else None)
        raise
    except Exception as exc:
        step = stop.orchestrator.step if stop.orchestrator else None
        errors.internal(exc, step=step)
        where = f"at step {step}" if step is not None else "before training"
        saved = latest_checkpoint(run_dir)
        resume = f"a rerun resumes from {saved}" if saved is not None else "no checkpoint yet"
        raise RunFailedError(
            f"internal error {where}: {type(exc).__name__}: {exc} (full traceback in {errors.path}; {resume})"
        ) from exc
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        errors.close()
        live.close()


async def _train(
    cfg: RunConfig,
    ckpt: Path | None,
    run_dir: Path,
    tokenizer: Tokenizer,
    model_cfg,
    components: ComponentConfigs,
    make_env,
    live: LiveProgress,
    stop: StopRequest,
) -> dict[str, Any]:
    torch.set_num_threads(cfg.pipeline.torch_threads)
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    warm_start = ckpt is None and cfg.sft.enabled
    if warm_start:
        (run_dir / "sft.jsonl").unlink(missing_ok=True)  # a warm start killed before its checkpoint restarts
    sft_writer = JsonlWriter(run_dir / "sft.jsonl") if warm_start else None
    every = max(1, cfg.sft.steps // 5)
    sft_done = 0

    def on_sft(r: dict[str, Any]) -> None:
        nonlocal sft_done
        assert sft_writer is not None
        sft_writer.write(r)
        sft_done = r["sft_step"]
        if r["sft_step"] % every == 0:
            live.message(f"sft step {r['sft_step']}/{cfg.sft.steps}  loss {r['loss']:.3f}")

    try:
        if cfg.backend == "ray":
            from labrl.harness.backends.ray.backend import start_ray

            parts = await start_ray(cfg, tokenizer=tokenizer, resume=ckpt is not None, on_sft=on_sft)
        else:
            parts = await start_inprocess(
                cfg, tokenizer, make_env, resume=ckpt is not None, on_sft=on_sft,
                should_stop=lambda: stop.requested,
            )  # fmt: skip
    finally:
        if sft_writer is not None:
            sft_writer.close()
    warm_started = warm_start and sft_done == cfg.sft.steps
    learner, sampler = parts.learner, parts.sampler
    if stop.requested and warm_start and not warm_started:
        if isinstance(sampler, Closeable):
            await sampler.close()
        await parts.close()
        summary = {
            "step": 0,
            "interrupted": True,
            "stopped_by": stop.signal_name,
            "checkpoint": None,
            "total_wall_s": time.perf_counter() - started,
            "sft_s": parts.sft_s,
            "eval": None,
            "note": "stopped during the warm start: nothing to save; a rerun starts the warm start again",
        }
        write_summary(run_dir, summary)
        return summary
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
            on_checkpoint=parts.on_checkpoint,
        )
        if ckpt is not None:
            await orch.resume(ckpt)
            _merge_logged_evals(orch, run_dir)
            live.message(f"resumed from {ckpt} at step {orch.step}")
        elif warm_started:
            orch.save_checkpoint()  # step 0: a kill from here on does not repeat the warm start
        stop.attach(orch)
        result = await orch.run()
    finally:
        if isinstance(sampler, Closeable):  # SGLangSampler's HTTP client; BudgetForcingSampler passes it on
            await sampler.close()
        backend_summary = await parts.close()
        metrics.close()
        evals.close()
    summary = {
        **result,
        "total_wall_s": time.perf_counter() - started,
        "sft_s": parts.sft_s,
        "interrupted": orch.step < cfg.pipeline.total_steps,
        "stopped_by": stop.signal_name,
        "checkpoint": str(latest_checkpoint(run_dir)),
        "eval_history": orch.eval_history,
        "backend": cfg.backend,
        **({"ray": backend_summary} if backend_summary else {}),
    }
    write_summary(run_dir, summary)
    return summary


def _merge_logged_evals(orch: Orchestrator, run_dir: Path) -> None:
    """Evaluations that finished after the checkpoint was written (kept in eval.jsonl) rejoin the history."""
    known = {e["step"] for e in orch.eval_history}
    logged = [
        e for e in read_jsonl(run_dir / "eval.jsonl") if e["step"] <= orch.step and e["step"] not in known
    ]
    orch.eval_history = sorted(orch.eval_history + logged, key=lambda e: e["step"])

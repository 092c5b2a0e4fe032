"""Run a training run from a ``RunConfig``: what ``labrl train`` calls.

``train`` checks everything, prepares the run directory, installs the signal
handlers, asks the backend ``cfg.backend`` names for the run's parts
(``labrl.harness.backends``: where they live; ``backends.parts``: what they
are), drives them with the ``Orchestrator`` and writes ``summary.json``
(``run_summary``, written once, at the end, whichever way the run ends).

::

    run_dir/
      config.yaml       the resolved config (file + overrides)
      effective.json    what its auto and mode-derived keys resolved to (labrl.harness.effective)
      sft.jsonl         warm-start loss per step (when sft.enabled)
      metrics.jsonl     one record per learner step
      eval.jsonl        one record per evaluation on the test split
      trained.jsonl     the group indices trained at each step
      errors.jsonl      failed episodes and internal errors, with tracebacks (errors_log)
      episodes.jsonl    one line per episode: timings, versions, fate (traces; pipeline.episode_traces)
      resumes.jsonl     the tunable keys changed at each resume (resume)
      checkpoints/      step_N/{learner.pt, pipeline.pt} and `latest`
      summary.json      final numbers (also when a run stops early or stalls)

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
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from labrl.errors import ConfigError, LabrlError, RunFailedError
from labrl.harness.backends.base import Backend, RunParts, RunStart
from labrl.harness.backends.inprocess import InProcessBackend
from labrl.harness.backends.parts import EnvFactory, build_tokenizer, make_env_factory, run_components
from labrl.harness.config import (
    ComponentConfigs,
    RunConfig,
    dump_run_config,
    learnability_warnings,
)
from labrl.harness.effective import effective_values, read_effective, write_effective
from labrl.harness.metrics import JsonlWriter, LiveProgress, read_jsonl
from labrl.harness.models import device as dev
from labrl.harness.pipeline.checkpoint import checkpoint_step, latest_checkpoint, write_summary
from labrl.harness.pipeline.errors_log import ErrorLog
from labrl.harness.pipeline.orchestrator import Orchestrator, PipelineStalledError
from labrl.harness.pipeline.prompt_fit import check_opening_prompts_fit
from labrl.harness.pipeline.resume import check_resume, log_resume, previous_config, truncate_run_logs
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import Closeable


def select_backend(name: str) -> Backend:
    """The backend ``cfg.backend`` names; Ray's is imported only when asked for."""
    if name == "ray":
        from labrl.harness.backends.ray.backend import RayBackend

        return RayBackend()
    return InProcessBackend()


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


def refuse_a_multi_process_launch(environ: Mapping[str, str]) -> None:
    """``train`` is one driver process with its learner in it: a launch of several (torchrun sets
    ``WORLD_SIZE``) is refused, before anything is built.

    Every rank would run a driver of its own (its own sampler requests, envs and run directory), so
    tensor-parallel ranks would train on different batches, and nothing reduces the dense parameters'
    gradients over data-parallel ranks: the ranks would train apart without an error. The learner
    itself runs over TP/EP ranks (``MegatronLearner``); the driver that feeds them is not built.
    """
    world = dev.launcher_value(environ, "WORLD_SIZE", "a process count")
    if world is not None and world > 1:
        raise ConfigError(
            f"WORLD_SIZE={world}: labrl train runs one process, and a learner over several is not built "
            "yet (each rank would run its own driver, and the ranks would train apart): launch it without "
            "torchrun, on one GPU (docs/gpu.md, 'Training against SGLang on a GPU node')"
        )


async def train(cfg: RunConfig, *, fresh: bool = False, progress: bool | None = None) -> dict[str, Any]:
    """Validate everything, then train (or resume) into ``cfg.run_dir``; returns the summary.

    Nothing is written before the launch (one process: ``refuse_a_multi_process_launch``),
    the config, the model, the tokenizer, the env, that the model's context holds the
    env's opening prompt (``prompt_fit``: envs whose reset is cheap) and (on resume)
    the identity keys are checked. SIGINT /
    SIGTERM in any phase stop the run: during the warm start nothing is saved (a
    rerun starts it again); after it, the running step finishes and a checkpoint
    is written.
    The summary's ``stopped_by`` names the signal. An unexpected error is
    logged with its traceback to ``errors.jsonl`` and raised as
    ``RunFailedError`` (one line).
    """
    refuse_a_multi_process_launch(os.environ)
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
    await check_opening_prompts_fit(
        make_env, tokenizer, context=model_cfg.max_sequence_length, run_seed=cfg.seed,
        max_new_tokens=components.sampling.max_new_tokens,
    )  # fmt: skip
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
    make_env: EnvFactory,
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
        run = RunStart(
            cfg,
            tokenizer,
            make_env,
            resume=ckpt is not None,
            on_sft=on_sft,
            should_stop=lambda: stop.requested,
        )
        parts = await select_backend(cfg.backend).start(run)
    finally:
        if sft_writer is not None:
            sft_writer.close()
    warm_started = warm_start and sft_done == cfg.sft.steps
    result: dict[str, Any] | None = None  # the orchestrator's (or the stall's); None: the run failed
    eval_history: list[dict[str, Any]] = []
    try:
        if stop.requested and warm_start and not warm_started:
            result = {
                "step": 0,
                "eval": None,
                "note": "stopped during the warm start: nothing to save; a rerun starts the warm start again",
            }
        else:
            result, eval_history = await _orchestrate(
                cfg, ckpt, run_dir, tokenizer, components, make_env, live, stop, parts, warm_started=warm_started
            )  # fmt: skip
    except PipelineStalledError as exc:
        result = exc.summary  # checkpointed and resumable: the summary says where from
        eval_history = result["eval_history"] if result is not None else []
        raise
    finally:
        # SGLangSampler's HTTP client (BudgetForcingSampler passes the close on)
        if isinstance(parts.sampler, Closeable):
            await parts.sampler.close()
        backend_summary = await parts.close()
        if result is not None:
            result = run_summary(
                cfg, run_dir, result, started=started, sft_s=parts.sft_s, stopped_by=stop.signal_name,
                eval_history=eval_history, backend_summary=backend_summary,
            )  # fmt: skip
            write_summary(run_dir, result)
    return result


async def _orchestrate(
    cfg: RunConfig,
    ckpt: Path | None,
    run_dir: Path,
    tokenizer: Tokenizer,
    components: ComponentConfigs,
    make_env: EnvFactory,
    live: LiveProgress,
    stop: StopRequest,
    parts: RunParts,
    *,
    warm_started: bool,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Resume (or checkpoint the warm start), then train; the orchestrator's result and eval history."""
    logs = StepLogs(run_dir, live)
    try:
        orch = Orchestrator(
            cfg.pipeline,
            make_env=make_env,
            sampler=parts.sampler,
            learner=parts.learner,
            tokenizer=tokenizer,
            sampling=components.sampling,
            seed=cfg.seed,
            run_dir=run_dir,
            return_routed_experts=cfg.learner.router_replay,
            on_step=logs.on_step,
            on_eval=logs.on_eval,
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
        return result, orch.eval_history
    finally:
        logs.close()


def run_summary(
    cfg: RunConfig,
    run_dir: Path,
    result: dict[str, Any],
    *,
    started: float,
    sft_s: float,
    stopped_by: str | None,
    eval_history: list[dict[str, Any]],
    backend_summary: dict[str, Any],
) -> dict[str, Any]:
    """``summary.json``: the orchestrator's ``result`` (or the stall's), and what the run around it measured."""
    checkpoint = latest_checkpoint(run_dir)
    return {
        **result,
        "total_wall_s": time.perf_counter() - started,
        "sft_s": sft_s,
        "interrupted": result["step"] < cfg.pipeline.total_steps,
        "stopped_by": stopped_by,
        "checkpoint": str(checkpoint) if checkpoint is not None else None,
        "eval_history": eval_history,
        "backend": cfg.backend,
        **({"ray": backend_summary} if backend_summary else {}),
    }


class StepLogs:
    """``metrics.jsonl`` and ``eval.jsonl``, each record echoed on the progress display."""

    def __init__(self, run_dir: Path, live: LiveProgress) -> None:
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl")
        self.evals = JsonlWriter(run_dir / "eval.jsonl")
        self.live = live

    def on_step(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self.live.update(record)

    def on_eval(self, record: dict[str, Any]) -> None:
        self.evals.write(record)
        self.live.message(
            f"eval @ step {record['step']}: accuracy {record['accuracy']:.3f} "
            f"(n={record['n']}, {record['time_s'] / 60:.1f} min)"
        )

    def close(self) -> None:
        self.metrics.close()
        self.evals.close()


def _merge_logged_evals(orch: Orchestrator, run_dir: Path) -> None:
    """Evaluations that finished after the checkpoint was written (kept in eval.jsonl) rejoin the history."""
    known = {e["step"] for e in orch.eval_history}
    logged = [
        e for e in read_jsonl(run_dir / "eval.jsonl") if e["step"] <= orch.step and e["step"] not in known
    ]
    orch.eval_history = sorted(orch.eval_history + logged, key=lambda e: e["step"])

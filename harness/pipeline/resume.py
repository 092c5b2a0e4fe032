"""What a resumed run must share with the run that wrote its checkpoint, and the logs it truncates.

Identity keys (``run_identity``): a checkpoint is only meaningful for the same
problem, the same network and the same token ids, so these must match the
run directory's ``config.yaml`` or the resume is a ``ConfigError`` naming each
differing key:

=========================  ================================================================
key                        why
=========================  ================================================================
``env.id``                 the task distribution the policy was trained on
``env.options``            the env's constructor options (tier, pool, answer format, ...)
``model.shape``            the resolved ``MoEModelConfig`` (preset + overrides or the HF
                           checkpoint's config): the learner checkpoint's tensors
``model.init_from_hf``     where the weights and the tokenizer came from
``tokenizer``              ``bytes`` or the HF tokenizer's directory: the token ids
``objective.loss``         the objective family (reinforce / ppo / cispo / gspo)
``learner.reference``      whether the checkpoint holds a frozen reference policy
``learner.precision``      the dtype of the weights and the optimizer state
``parallel``               TP / PP / EP sizes: how the checkpoint is sharded
``seed``                   task and sampling seeds of every group index (trained groups)
``pipeline.group_size``    G, which the sampling seeds of each group index depend on
=========================  ================================================================

Every other key is tunable on resume (learning rate and schedule, staleness
bound, dynamic sampling and oversampling, advantages, corrections, KL
coefficient, eval cadence and size, checkpoint cadence, total steps, sampler
settings, ...): ``tunable_changes`` lists the ones that differ, which the runner
prints and appends to ``run_dir/resumes.jsonl``.

Logs (``truncate_run_logs``): the step-indexed JSONL files of a run directory
keep each step once. On resume from the checkpoint of step S, records of steps
after S (written by the process that was killed after its last checkpoint)
are dropped, and a step listed twice keeps its first record; a fresh start
(no checkpoint) empties them (``truncate_run_logs(run_dir, -1)``) and the warm
start rewrites ``sft.jsonl``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from labrl.errors import ConfigError
from labrl.harness.config import RunConfig, build_run_config

# run-dir file -> the record field that holds its learner step
STEP_LOGS = {
    "metrics.jsonl": "step",
    "trained.jsonl": "step",
    "eval.jsonl": "step",
    "errors.jsonl": "step",
}
RESUMES_LOG = "resumes.jsonl"

IDENTITY_KEYS = (
    "env.id",
    "env.options",
    "model.shape",
    "model.init_from_hf",
    "tokenizer",
    "objective.loss",
    "learner.reference",
    "learner.precision",
    "parallel",
    "seed",
    "pipeline.group_size",
)


def run_identity(cfg: RunConfig) -> dict[str, Any]:
    """The values of ``IDENTITY_KEYS`` for ``cfg`` (JSON-comparable)."""
    identity = {
        "env.id": cfg.env.id,
        "env.options": dict(cfg.env.options),
        "model.shape": cfg.model.resolve().model_dump(mode="json"),
        "model.init_from_hf": cfg.model.init_from_hf,
        "tokenizer": "bytes" if cfg.model.init_from_hf is None else cfg.model.init_from_hf,
        "objective.loss": cfg.objective.loss,
        "learner.reference": cfg.learner.reference,
        "learner.precision": cfg.learner.precision,
        "parallel": cfg.parallel.model_dump(mode="json"),
        "seed": cfg.seed,
        "pipeline.group_size": cfg.pipeline.group_size,
    }
    assert tuple(identity) == IDENTITY_KEYS
    return identity


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out |= _flat(v, f"{prefix}{k}.")
        return out
    return {prefix.rstrip("."): data}


def _describe(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def previous_config(run_dir: str | Path) -> RunConfig | None:
    """The run directory's ``config.yaml`` (the config of the run that wrote its checkpoints), if any."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        return build_run_config(yaml.safe_load(path.read_text()) or {})
    except (ConfigError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"{path} (the config of the run being resumed) no longer loads: {exc}; "
            "resume with the labrl version that wrote it, or start a new run_dir"
        ) from None


def check_resume(previous: RunConfig, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """``ConfigError`` naming every identity key that differs; else the tunable keys that differ.

    Returns ``{dotted key: (old value, new value)}`` over the flattened configs,
    identity keys excluded.
    """
    old, new = run_identity(previous), run_identity(cfg)
    differing = [k for k in IDENTITY_KEYS if old[k] != new[k]]
    if differing:
        details = "; ".join(f"{k}: {_describe(old[k])} -> {_describe(new[k])}" for k in differing)
        raise ConfigError(
            f"cannot resume {cfg.run_dir}: its checkpoint was trained with different "
            f"{', '.join(differing)} ({details}). These keys identify a run (docs/runs.md); "
            "change them back, or train into a new run_dir"
        )
    before, after = _flat(previous.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    return {
        k: (before.get(k), after.get(k))
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k) and not _is_identity(k)
    }


def _is_identity(key: str) -> bool:
    # model.* is the shape (compared resolved above); a changed preset with the same shape is no change
    return key.startswith(("env.options", "model.", "parallel.")) or key in IDENTITY_KEYS


def _rewrite(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def truncate_run_logs(run_dir: str | Path, step: int) -> dict[str, int]:
    """Keep each step-indexed log's records of steps <= ``step``, each step once; returns lines dropped per file.

    ``step`` is the checkpoint's step (-1 with no checkpoint: every stepped
    record goes). ``errors.jsonl`` may hold several records per step, so only
    its steps after ``step`` go; a record without a step (an internal error
    before training) is kept.
    """
    run_dir = Path(run_dir)
    dropped: dict[str, int] = {}
    for name, field in STEP_LOGS.items():
        path = run_dir / name
        if not path.is_file():
            continue
        kept, seen, lines = [], set(), path.read_text().splitlines()
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the line a kill cut short
                continue
            s = record.get(field)
            if s is not None and s > step:
                continue
            if name != "errors.jsonl" and s is not None:
                if s in seen:
                    continue
                seen.add(s)
            kept.append(line)
        if len(kept) != len(lines):
            _rewrite(path, kept)
            dropped[name] = len(lines) - len(kept)
    return dropped


def log_resume(run_dir: str | Path, step: int, changes: dict[str, tuple[Any, Any]]) -> None:
    """Append the tunable keys changed at this resume to ``run_dir/resumes.jsonl``."""
    with (Path(run_dir) / RESUMES_LOG).open("a") as fh:
        fh.write(
            json.dumps({"step": step, "changed": {k: list(v) for k, v in changes.items()}}, default=str)
            + "\n"
        )

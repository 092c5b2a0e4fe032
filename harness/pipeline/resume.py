"""What a resumed run must share with the run that wrote its checkpoint, and the logs it truncates.

Identity keys (``IDENTITY_KEYS``): a checkpoint is only meaningful for the same
problem, the same network and the same token ids, so these must match the run
that wrote it or the resume is a ``ConfigError`` naming each differing key.
They are the config fields marked ``IDENTITY`` where they are declared
(``labrl.harness.identity``: ``env.id``, ``pipeline.group_size``, ...) and the
keys ``derived_identity`` resolves: the model shape, the tokenizer and the dtype
``learner.precision`` resolved to. The previous run's dtype is the one it
recorded in ``effective.json`` (``labrl.harness.effective``), so an ``auto``
that would now resolve differently is refused rather than followed. The table
with the reason for each key is in docs/runs.md.

Every other key is tunable on resume (learning rate and schedule, staleness
bound, dynamic sampling and oversampling, advantages, corrections, KL
coefficient, eval cadence and size, checkpoint cadence, total steps, sampler
settings, ...): ``check_resume`` returns the ones that differ, which the runner
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
from pydantic import BaseModel

from labrl.errors import ConfigError
from labrl.harness.config import RunConfig, build_run_config
from labrl.harness.effective import EffectiveValues, effective_values
from labrl.harness.identity import identity_fields

# run-dir file -> the record field that holds its learner step
STEP_LOGS = {
    "metrics.jsonl": "step",
    "trained.jsonl": "step",
    "eval.jsonl": "step",
    "errors.jsonl": "step",
    "episodes.jsonl": "step",
}
# step-indexed logs that hold several records per step (the others keep one record per step)
MANY_PER_STEP = frozenset({"errors.jsonl", "episodes.jsonl"})
RESUMES_LOG = "resumes.jsonl"

MARKED_IDENTITY = identity_fields(RunConfig)
# The identity keys a run resolves rather than writes (``derived_identity``), each with the written key
# it stands for: the written key is neither compared as written nor listed as a tunable change (a
# changed preset with the same shape, or ``auto`` that resolves to the same dtype, is no change).
DERIVED_IDENTITY = {
    "model.shape": "model",
    "tokenizer": "model.init_from_hf",
    "learner.precision": "learner.precision",
}
IDENTITY_KEYS = tuple(sorted({*MARKED_IDENTITY, *DERIVED_IDENTITY}))


def derived_identity(cfg: RunConfig, effective: EffectiveValues) -> dict[str, Any]:
    """The keys of ``DERIVED_IDENTITY``: the resolved ``MoEModelConfig`` (preset + overrides, or the HF
    checkpoint's config), the tokenizer (``bytes`` or the HF directory) and the resolved dtype."""
    return {
        "model.shape": cfg.model.resolve().model_dump(mode="json"),
        "tokenizer": "bytes" if cfg.model.init_from_hf is None else cfg.model.init_from_hf,
        "learner.precision": effective.learner_precision,
    }


def _json_value(cfg: RunConfig, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def run_identity(cfg: RunConfig, effective: EffectiveValues) -> dict[str, Any]:
    """The values of ``IDENTITY_KEYS`` for ``cfg`` resolved as ``effective`` (JSON-comparable)."""
    values = {key: _json_value(cfg, key) for key in MARKED_IDENTITY} | derived_identity(cfg, effective)
    return {key: values[key] for key in IDENTITY_KEYS}


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


def check_resume(
    previous: RunConfig,
    cfg: RunConfig,
    *,
    recorded: EffectiveValues | None = None,
    effective: EffectiveValues | None = None,
) -> dict[str, tuple[Any, Any]]:
    """``ConfigError`` naming every identity key that differs; else the tunable keys that differ.

    ``recorded``: what the previous run resolved (its ``effective.json``; None for a
    run directory without one: ``previous`` is resolved on this machine).
    ``effective``: what this run resolves (``effective_values(cfg)`` when None).
    Returns ``{dotted key: (old value, new value)}`` over the flattened configs,
    identity keys excluded.
    """
    old = run_identity(previous, recorded if recorded is not None else effective_values(previous))
    new = run_identity(cfg, effective if effective is not None else effective_values(cfg))
    differing = [k for k in IDENTITY_KEYS if old[k] != new[k]]
    if differing:
        details = "; ".join(f"{k}: {_describe(old[k])} -> {_describe(new[k])}" for k in differing)
        dtype = (
            " (learner.precision compares the dtype it resolved to: set it to the checkpoint's explicitly)"
            if "learner.precision" in differing
            else ""
        )
        raise ConfigError(
            f"cannot resume {cfg.run_dir}: its checkpoint was trained with different "
            f"{', '.join(differing)} ({details}). These keys identify a run (docs/runs.md); "
            f"change them back{dtype}, or train into a new run_dir"
        )
    before, after = _flat(previous.model_dump(mode="json")), _flat(cfg.model_dump(mode="json"))
    return {
        k: (before.get(k), after.get(k))
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k) and not _is_identity(k)
    }


def _is_identity(key: str) -> bool:
    """Whether a written config key is compared as identity (itself, or through a derived key)."""
    return any(key == k or key.startswith(k + ".") for k in (*MARKED_IDENTITY, *DERIVED_IDENTITY.values()))


def _rewrite(path: Path, lines: list[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def truncate_run_logs(run_dir: str | Path, step: int) -> dict[str, int]:
    """Keep each step-indexed log's records of steps <= ``step``, each step once; returns lines dropped per file.

    ``step`` is the checkpoint's step (-1 with no checkpoint: every stepped
    record goes). ``errors.jsonl`` and ``episodes.jsonl`` hold several records per step,
    so only their steps after ``step`` go; a record without a step (an internal error
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
            if name not in MANY_PER_STEP and s is not None:
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

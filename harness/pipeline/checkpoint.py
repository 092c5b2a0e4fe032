"""Checkpoint files of a pipeline run, written atomically.

::

    run_dir/checkpoints/
      step_000012/learner.pt    the learner's own checkpoint (weights, optimizer, schedule, RNG)
      step_000012/pipeline.pt   the orchestrator's state_dict (step, group indices, buffer, evals)
      latest                    the name of the newest complete step_* directory

Each file is written to ``*.tmp`` and renamed, and ``latest`` moves only
after both files exist, so a crash leaves the previous checkpoint usable.
Only the newest two step directories are kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from labrl.harness.types import Learner

STATE_FILE = "pipeline.pt"
LEARNER_FILE = "learner.pt"
SUMMARY_FILE = "summary.json"


def write_checkpoint(run_dir: Path, step: int, learner: Learner, state: dict[str, Any]) -> Path:
    """``run_dir/checkpoints/step_N/{learner.pt, pipeline.pt}`` and the ``latest`` pointer; old steps pruned."""
    root = run_dir / "checkpoints"
    target = root / f"step_{step:06d}"
    target.mkdir(parents=True, exist_ok=True)
    learner.save_checkpoint(str(target / LEARNER_FILE))
    tmp = target / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, target / STATE_FILE)
    pointer = root / "latest.tmp"
    pointer.write_text(target.name)
    os.replace(pointer, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir() and p != target)[:-1]:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    return target


def read_checkpoint(checkpoint_dir: str | Path, learner: Learner) -> dict[str, Any]:
    """Load the learner's checkpoint into ``learner``; return the orchestrator's state_dict."""
    path = Path(checkpoint_dir)
    learner.load_checkpoint(str(path / LEARNER_FILE))
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.exists():
        return None
    target = pointer.parent / pointer.read_text().strip()
    return target if (target / STATE_FILE).exists() else None


def checkpoint_step(checkpoint_dir: str | Path) -> int:
    """The learner step of a ``step_N`` checkpoint directory."""
    return int(Path(checkpoint_dir).name.removeprefix("step_"))


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """``run_dir/summary.json``, atomically."""
    tmp = run_dir / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    os.replace(tmp, run_dir / SUMMARY_FILE)
    return run_dir / SUMMARY_FILE

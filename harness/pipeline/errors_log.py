"""``run_dir/errors.jsonl``: every failed episode and every internal error of a run, one JSON line each.

::

    {"kind": "episode", "phase": "train", "step": 12, "env_id": "lab/synthesis-v0", "task_id": "...",
     "outcome": "env_error", "message": "lab returned 503 ...", "traceback": "Traceback ..." | null,
     "time": 1732431234.5}
    {"kind": "internal", "step": 40, "error": "ValueError", "message": "...", "traceback": "Traceback ..."}

Episodes are logged when their outcome is one of ``FAILED_OUTCOMES`` (not
trainable because something other than the policy failed); ``step`` is the
learner step the episode ran during (its group is trained later, or dropped).
The traceback is the episode's own (``Trajectory.info["traceback"]``) where the
env runner recorded one. The console shows one line per internal error; the
traceback is only here.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any

from labrl.harness.metrics import JsonlWriter
from labrl.harness.types import Trajectory

ERRORS_FILE = "errors.jsonl"
# Outcomes that say "the env, its backend or the verifier failed", as opposed to the policy.
FAILED_OUTCOMES = ("env_error", "verifier_failed", "timeout")


class ErrorLog:
    """Appends failed episodes and internal errors to ``run_dir/errors.jsonl`` (flushed per line)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / ERRORS_FILE
        self._writer: JsonlWriter | None = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._writer is None:  # opened on the first error: a clean run has no errors.jsonl
            self._writer = JsonlWriter(self.path)
        self._writer.write(record | {"time": time.time()})

    def episodes(self, trajectories: list[Trajectory], *, step: int, phase: str) -> int:
        """Log each failed episode of ``trajectories``; returns how many were logged."""
        failed = [t for t in trajectories if t.outcome in FAILED_OUTCOMES]
        for t in failed:
            self._write(
                {
                    "kind": "episode",
                    "phase": phase,
                    "step": step,
                    "env_id": t.env_id,
                    "task_id": t.task_id,
                    "outcome": t.outcome,
                    "message": t.info.get("error"),
                    "traceback": t.info.get("traceback"),
                }
            )
        return len(failed)

    def internal(self, exc: BaseException, *, step: int | None) -> None:
        """An exception that stopped the run, with its full traceback."""
        self._write(
            {
                "kind": "internal",
                "step": step,
                "error": type(exc).__name__,
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(exc)),
            }
        )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

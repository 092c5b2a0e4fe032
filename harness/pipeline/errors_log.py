"""``run_dir/errors.jsonl``: every distinct error of a run once, in full, and how often each repeated.

::

    {"kind": "episode", "phase": "train", "step": 12, "env_id": "lab/synthesis-v0", "task_id": "...",
     "outcome": "env_error", "message": "lab returned 503 ...", "traceback": "Traceback ..." | null,
     "error_id": "3f9a0c2e71d4", "time": 1732431234.5}
    {"kind": "internal", "step": 40, "error": "ValueError", "message": "...", "traceback": "Traceback ...",
     "error_id": "...", "time": ...}
    {"kind": "repeats", "step": 12, "counts": {"3f9a0c2e71d4": 5120}, "time": ...}

Episodes are logged when their outcome is one of ``FAILED_OUTCOMES`` (not
trainable because something other than the policy failed); ``step`` is the
learner step the episode ran during (its group is trained later, or dropped).
The traceback is the episode's own (``Trajectory.info["traceback"]``) where the
env runner recorded one. The console shows one line per internal error; the
traceback is only here.

Distinct errors (``error_id``): two errors are the same when they have the same
kind, phase, env id, outcome (or exception type), message with its numbers and
ids replaced by ``#`` (``normalise_message``: task ids, prompt lengths, job
ids differ between repeats of one fault) and origin (the innermost frame of the
traceback, ``File "...", line N, in f``). The first occurrence is written in
full; later ones are counted and written as ``repeats`` rows, one per learner
step with repeats, at most every ``REPEATS_EVERY_S`` seconds and when the log
closes. So the file grows with the number of distinct errors and the run's
length, never with the number of failed episodes. A distinct error occurred
``1 + sum of its repeats counts`` times (``distinct_errors``).

Resume: the log reads back the ``error_id`` of every first occurrence already
in the file (after ``resume.truncate_run_logs`` cut it back to the checkpoint's
step), so a resumed run counts an error seen before as a repeat. Counts of the
last ``REPEATS_EVERY_S`` seconds before a SIGKILL are lost; a stop or failure
writes them.
"""

from __future__ import annotations

import hashlib
import re
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from labrl.harness.metrics import JsonlWriter, read_jsonl
from labrl.harness.types import Trajectory

ERRORS_FILE = "errors.jsonl"
# Outcomes that say "the env, its backend or the verifier failed", as opposed to the policy.
FAILED_OUTCOMES = ("env_error", "verifier_failed", "timeout")
REPEATS_EVERY_S = 30.0

# hex literals, long hex runs (hashes, uuid parts) and decimal numbers: what differs between repeats
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\b[0-9a-fA-F]{8,}\b|\d+(?:\.\d+)?")
_FRAME = re.compile(r'^\s*File ".*", line \d+, in .*$', re.MULTILINE)


def normalise_message(message: str | None) -> str:
    """``message`` with every number, hex literal and long hex id replaced by ``#``."""
    return _VARYING.sub("#", message or "")


def error_origin(traceback_text: str | None) -> str:
    """The innermost frame of a formatted traceback (``File "x.py", line 3, in f``), or ``""``."""
    frames = _FRAME.findall(traceback_text or "")
    return frames[-1].strip() if frames else ""


def error_id(record: dict[str, Any]) -> str:
    """12 hex digits of sha1 over kind, phase, env id, outcome / error type, normalised message, origin."""
    parts = (
        record["kind"],
        record.get("phase") or "",
        record.get("env_id") or "",
        record.get("outcome") or record.get("error") or "",
        normalise_message(record.get("message")),
        error_origin(record.get("traceback")),
    )
    return hashlib.sha1("\x1f".join(parts).encode()).hexdigest()[:12]


def distinct_errors(run_dir: str | Path) -> list[dict[str, Any]]:
    """Each distinct error's first record, with ``count`` = 1 + its repeats, in order of first occurrence.

    Records written before errors were de-duplicated (no ``error_id``) are grouped by ``error_id`` too.
    """
    first: dict[str, dict[str, Any]] = {}
    repeats: Counter[str] = Counter()
    for record in read_jsonl(Path(run_dir) / ERRORS_FILE):
        if record["kind"] == "repeats":
            repeats.update(record["counts"])
        else:
            first.setdefault(record.get("error_id") or error_id(record), record)
    return [record | {"count": 1 + repeats[key]} for key, record in first.items()]


class ErrorLog:
    """Appends failed episodes and internal errors to ``run_dir/errors.jsonl`` (module docstring)."""

    def __init__(self, run_dir: str | Path, *, repeats_every_s: float = REPEATS_EVERY_S) -> None:
        self.path = Path(run_dir) / ERRORS_FILE
        self.repeats_every_s = repeats_every_s
        self._writer: JsonlWriter | None = None
        self._seen = {
            e.get("error_id") or error_id(e) for e in read_jsonl(self.path) if e["kind"] != "repeats"
        }
        self._repeats: dict[int | None, Counter[str]] = {}  # step -> error id -> repeats not yet written
        self._repeats_since: float | None = None  # when the oldest unwritten repeat was counted

    def _write(self, record: dict[str, Any]) -> None:
        if self._writer is None:  # opened on the first error: a clean run has no errors.jsonl
            self._writer = JsonlWriter(self.path)
        self._writer.write(record | {"time": time.time()})

    def _log(self, record: dict[str, Any]) -> None:
        """Write ``record`` if its error is new; else count it as a repeat."""
        key = error_id(record)
        if key not in self._seen:
            self._seen.add(key)
            self._write(record | {"error_id": key})
            return
        self._repeats.setdefault(record["step"], Counter())[key] += 1
        now = time.monotonic()
        if self._repeats_since is None:
            self._repeats_since = now
        elif now - self._repeats_since >= self.repeats_every_s:
            self.flush()

    def flush(self) -> None:
        """Write the repeats counted so far: one ``repeats`` row per step."""
        for step in sorted(self._repeats, key=lambda s: -1 if s is None else s):
            self._write({"kind": "repeats", "step": step, "counts": dict(self._repeats[step])})
        self._repeats.clear()
        self._repeats_since = None

    def episodes(self, trajectories: list[Trajectory], *, step: int, phase: str) -> int:
        """Log each failed episode of ``trajectories``; returns how many failed."""
        failed = [t for t in trajectories if t.outcome in FAILED_OUTCOMES]
        for t in failed:
            self._log(
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
        self._log(
            {
                "kind": "internal",
                "step": step,
                "error": type(exc).__name__,
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(exc)),
            }
        )

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

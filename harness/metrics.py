"""Run metrics: one JSON line per learner step, eval results, and a live console view.

Files in the run directory:

- ``metrics.jsonl``: one object per learner step (``step``, ``time_s`` since
  start, reward, staleness, throughput, env latency percentiles, the
  learner's and the objective's metrics);
- ``eval.jsonl``: one object per evaluation (``step``, ``accuracy``,
  ``reward_mean``, ``n``).

The live view (``rich``) shows step, reward, staleness, tokens/s, env
latency and ETA; when stdout is not a terminal or ``rich_view`` is false,
one plain line per step is printed instead (every ``print_every`` steps).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100]; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value


def read_jsonl(path: str | Path, *, skip_torn: bool = False) -> list[dict[str, Any]]:
    """The file's records, [] when it is absent; ``skip_torn``: leave out lines that do not decode
    (the line a kill cut short) instead of raising."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if not skip_torn:
                raise
    return rows


class JsonlWriter:
    """Appends one JSON object per line and flushes (a crash loses at most the line being written)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO = self.path.open("a")

    def write(self, record: Mapping[str, Any]) -> None:
        self._fh.write(json.dumps(_jsonable(record), sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def summary_line(record: Mapping[str, Any], total_steps: int) -> str:
    eta = record.get("eta_s")
    return (
        f"step {record['step']}/{total_steps}  reward {_fmt(record.get('reward/mean'))}  "
        f"staleness {_fmt(record.get('staleness/mean'), '.2f')} (max {_fmt(record.get('staleness/max'), '.0f')})  "
        f"tok/s {_fmt(record.get('throughput/tokens_per_s'), '.0f')}  "
        f"env p50/p99 {_fmt(record.get('env_latency/p50'), '.2f')}/{_fmt(record.get('env_latency/p99'), '.2f')} s  "
        f"env_error/verifier_failed {_fmt(record.get('errors/env_error_frac'), '.2f')}/"
        f"{_fmt(record.get('errors/verifier_failed_frac'), '.2f')}  "
        f"eval {_fmt(record.get('eval/accuracy'))}  ETA {_fmt(eta / 60 if eta is not None else None, '.1f')} min"
        + budgets_left(record)
        + (f"  {record['health']}" if record.get("health") else "")
    )


def budgets_left(record: Mapping[str, Any]) -> str:
    """``  budget left truth 9.2/10`` for each cascade stage with a budget (``cascade/<stage>/left``)."""
    parts = [
        f"{key.split('/')[1]} {_fmt(record[key], '.3g')}/{_fmt(record.get(key.removesuffix('left') + 'limit'), '.3g')}"
        for key in sorted(record)
        if key.startswith("cascade/") and key.endswith("/left")
    ]
    return f"  budget left {' '.join(parts)}" if parts else ""


class LiveProgress:
    """A rich progress bar with the step's key numbers, or plain lines when not interactive."""

    def __init__(
        self, total_steps: int, *, rich_view: bool = True, stream: TextIO | None = None, print_every: int = 1
    ):
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.print_every = max(1, print_every)
        self._progress = None
        self._task = None
        if rich_view and self.stream.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    def update(self, record: Mapping[str, Any]) -> None:
        line = summary_line(record, self.total_steps)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=record["step"], info=line.split("  ", 1)[1])
        elif record["step"] % self.print_every == 0 or record["step"] == self.total_steps:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class StepTimer:
    """Wall-clock bookkeeping for ETA: mean seconds per step over the steps of this process."""

    def __init__(self, start_step: int) -> None:
        self.start = time.perf_counter()
        self.start_step = start_step

    def eta_s(self, step: int, total: int) -> float | None:
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.start) / done * (total - step)

"""A learned control variate: the next stage's value predicted from what is known before it runs.

The plain estimator corrects the cheap value ``c`` by the audited gap, ``r = c + (A / q)(e - c)``, so
an unaudited episode's error is the proxy's whole gap ``e - c``, and ``Var(r | s) = (1 - q) / q (e - c)^2``.
Any baseline ``b`` fixed before the draw ``A`` may stand in for ``c``::

    r = b + (A / q)(e - b),   E[r | s, b] = b + (e - b) = e,   Var(r | s, b) = (1 - q) / q (e - b)^2

(with more stages ``b`` replaces ``s_0`` in the first gap only: ``labrl.envs.cascade.estimator``).
The closer ``b`` is to ``e``, the smaller the audit noise; unbiasedness needs only that ``b`` does
not depend on this episode's own draw. ``NearestTruths`` learns ``b`` from the truths the run has
already paid for (delta learning, as a correction of an ML potential toward DFT is learnt): its
input is ``CascadeEnv.baseline_inputs`` (by default ``s_0`` alone; an env that knows more of the
candidate, e.g. its offset from a hint or a bond length relative to experiment, adds or uses that),
its prediction the mean next-stage value
of the ``k`` nearest stored inputs, each dimension scaled by its standard deviation over the points
used::

    b(x) = mean { y_j : j among the k nearest x_j to x, task_j != task }      k = min(neighbours, n)

**Leave the task out.** Members of one group play one task and may answer the same candidate, whose
ledger key, and therefore audit draw, they share. A prediction for a task ignores every point of
that task, so ``b`` never holds a truth that this episode's own draw decided to pay for. Points of
other tasks had independent draws, which is all unbiasedness asks. Until ``min_truths`` points of
other tasks are stored the model declines and the estimator keeps ``c`` (the plain control variate).
The last ``window`` points are kept (the policy moves: old candidates describe an old policy).

Per process and per event loop, like ``residuals.GapStats``: under Ray each env worker learns its
own, and a resumed run starts again from ``c``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

import numpy as np

from labrl.envs.cascade.config import ControlVariate


class NearestTruths:
    """k-nearest-neighbour regression of the next stage's value, leaving the asking task out (module docstring)."""

    def __init__(self, section: ControlVariate) -> None:
        self.neighbours, self.min_truths, self.window = section.neighbours, section.min_truths, section.window
        self._inputs: np.ndarray | None = None  # (window, dim), allocated at the first point
        self._truths = np.zeros(self.window)
        self._tasks = np.zeros(self.window, dtype=np.int64)  # hash of each point's task
        self._count = 0  # points ever added; slot i % window holds point i

    @property
    def stored(self) -> int:
        return min(self._count, self.window)

    def add(self, task: str, inputs: Sequence[float], truth: float) -> None:
        """Store the paid value ``truth`` of a candidate of ``task`` whose inputs were ``inputs``."""
        row = self._checked(inputs)
        if self._inputs is None:
            self._inputs = np.zeros((self.window, row.size))
        slot = self._count % self.window
        self._inputs[slot], self._truths[slot], self._tasks[slot] = row, truth, hash(task)
        self._count += 1

    def predict(self, task: str, inputs: Sequence[float]) -> float | None:
        """``b`` for a candidate of ``task`` (None while fewer than ``min_truths`` points of other tasks are stored)."""
        row = self._checked(inputs)
        if self._inputs is None:
            return None
        n = self.stored
        others = self._tasks[:n] != hash(task)
        if int(others.sum()) < self.min_truths:
            return None
        points, truths = self._inputs[:n][others], self._truths[:n][others]
        scale = points.std(axis=0)
        scale[scale == 0] = 1.0  # a constant dimension tells points apart by nothing
        distance = (((points - row) / scale) ** 2).sum(axis=1)
        k = min(self.neighbours, distance.size)
        nearest = np.argpartition(distance, k - 1)[:k]
        return float(truths[nearest].mean())

    def _checked(self, inputs: Sequence[float]) -> np.ndarray:
        row = np.asarray(inputs, dtype=float)
        if row.ndim != 1 or row.size == 0 or not np.all(np.isfinite(row)):
            raise ValueError(
                f"baseline inputs must be a non-empty row of finite numbers, got {list(inputs)!r}"
            )
        if self._inputs is not None and row.size != self._inputs.shape[1]:
            raise ValueError(
                f"baseline inputs have {row.size} values, the stored points {self._inputs.shape[1]}"
            )
        return row


_MODELS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, NearestTruths]] = (
    weakref.WeakKeyDictionary()
)


def shared_baseline(env_id: str, stage: str, section: ControlVariate) -> NearestTruths:
    """The process-wide model predicting the stage after ``stage`` of ``env_id`` on the running loop."""
    models = _MODELS.setdefault(asyncio.get_running_loop(), {})
    key = f"{env_id}/{stage}/{section.model_dump_json()}"
    if key not in models:
        models[key] = NearestTruths(section)
    return models[key]

"""The measured gap between consecutive stages, per process: what an ``Informative`` rule learns its sigma from.

Each time both stage ``k`` and stage ``k + 1`` ran on a candidate, the gap ``d = s_{k+1} - s_k`` is
added to a running mean and variance (Welford's update: ``mean += (d - mean) / n``,
``m2 += (d - mean_old) (d - mean_new)``, variance ``m2 / (n - 1)``). The estimate depends only on
episodes that already finished their stage ``k + 1``; a group's members snapshot it before they
report (``CascadeEnv``), so no member's decision depends on its own group's later stages.
"""

from __future__ import annotations

import asyncio
import math
import weakref


class GapStats:
    """Running mean and sample standard deviation of the gaps added so far."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self._m2 = 0.0

    def add(self, gap: float) -> None:
        self.count += 1
        delta = gap - self.mean
        self.mean += delta / self.count
        self._m2 += delta * (gap - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / (self.count - 1)) if self.count > 1 else 0.0


_GAPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, GapStats]] = weakref.WeakKeyDictionary()


def shared_gaps(env_id: str, stage: str) -> GapStats:
    """The process-wide gap statistics after ``stage`` of ``env_id`` on the running loop."""
    gaps = _GAPS.setdefault(asyncio.get_running_loop(), {})
    return gaps.setdefault(f"{env_id}/{stage}", GapStats())

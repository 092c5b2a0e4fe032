"""Seconds per call of a step, as the median of several timed windows (the GPU learner rows).

One window of three calls, as ``gpu_learner.py`` timed before, let a single slow call move a row by
a third: on an H200 (2026-11-27) bare megatron-core under the fp32-master precision policy came out
1.38x faster than the same step without it, which does less work. Here:

- two warm-up calls (the first selects kernels and fills the allocator's cache; the second times
  one call for the window size);
- ``windows`` windows of ``n = max(1, ceil(window_s / t_warm))`` calls each, ``sync`` (wait for the
  device) before and after each window, so a window holds whole steps however asynchronous they are;
- the median window's seconds per call, and ``spread = (max - min) / median`` over the windows:
  a ratio of two rows whose spreads are about s apart is uncertain by about s.

Imported by the scripts beside it; it lives outside the installed package.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    seconds: float  # median window's seconds per call
    spread: float  # (slowest - fastest window) / median, per call
    calls_per_window: int
    windows: int

    def as_row(self) -> dict:
        return {"spread": self.spread, "calls_per_window": self.calls_per_window, "windows": self.windows}


def windowed(
    step: Callable[[], object],
    sync: Callable[[], None],
    *,
    windows: int = 5,
    window_s: float = 0.25,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Time ``step`` as the module docstring says."""
    if windows < 1:
        raise ValueError(f"windows must be at least 1 (got {windows})")
    if not window_s > 0:
        raise ValueError(f"window_s must be positive (got {window_s})")
    step()
    sync()
    started = clock()
    step()
    sync()
    warm = clock() - started
    n = max(1, math.ceil(window_s / warm)) if warm > 0 else 1
    per_call = []
    for _ in range(windows):
        sync()
        started = clock()
        for _ in range(n):
            step()
        sync()
        per_call.append((clock() - started) / n)
    median = statistics.median(per_call)
    spread = (max(per_call) - min(per_call)) / median if median > 0 else 0.0
    return Timing(median, spread, n, windows)

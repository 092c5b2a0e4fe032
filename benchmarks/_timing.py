"""Seconds per call of a step, as the median of several timed windows (the GPU learner rows), and
steps timed in alternation (``alternating``: ratios of paths that share one machine's load).

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

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


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


def device_sync(device: torch.device) -> Callable[[], None]:
    """A wait for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA, nothing on the CPU
    (its ops have finished when they return)."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def alternating(
    steps: dict[str, Callable[[], object]],
    sync: Callable[[], None],
    *,
    rounds: int,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of each call of every step in ``steps``, ``rounds`` rounds that call each once in turn,
    the order reversed every round (what one call leaves in the caches favours no step).

    ``warmup`` untimed calls of each first (a compile, the allocator's first blocks); ``sync`` waits
    for the device before and after each timed call, so a call holds its whole step. A drift in the
    machine's load (another job, a clock change) then reaches every step of a round alike: a ratio
    of two steps is best taken per round (``paired_ratio``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1 (got {rounds})")
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync()
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(rounds):
        for name in order:
            sync()
            started = clock()
            steps[name]()
            sync()
            times[name].append(clock() - started)
        order.reverse()
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of ``numerator[i] / denominator[i]`` (two steps' times in the same rounds)."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError(
            f"need the same, non-zero number of rounds (got {len(numerator)} and {len(denominator)})"
        )
    return statistics.median(n / d for n, d in zip(numerator, denominator, strict=True))

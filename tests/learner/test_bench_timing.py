"""``benchmarks/_timing.py``: the GPU learner rows' windowed median and the alternating rounds, on a fake clock."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def timing() -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module("_timing")


class FakeStep:
    """A step whose calls take the given seconds on a fake clock (the last value repeats)."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = durations
        self.now = 0.0
        self.calls = 0
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def step(self) -> None:
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1

    def sync(self) -> None:
        self.syncs += 1


def test_windows_hold_enough_calls_for_the_window_and_the_median_ignores_one_slow_window():
    # warm-up 1.0 s (not counted), 0.05 s (sizes the window: 0.25 / 0.05 = 5 calls), then 5 windows of
    # 5 calls: one slow call (0.30 s) lands in the second window
    calls = [1.0, 0.05] + [0.05] * 5 + [0.05] * 4 + [0.30] + [0.05] * 15
    fake = FakeStep(calls)
    t = timing().windowed(fake.step, fake.sync, windows=5, window_s=0.25, clock=fake.clock)
    assert t.calls_per_window == 5
    assert t.windows == 5
    assert fake.calls == 2 + 25
    assert t.seconds == pytest.approx(0.05)
    # the slow window: (4 * 0.05 + 0.30) / 5 = 0.10 per call; spread (0.10 - 0.05) / 0.05
    assert t.spread == pytest.approx(1.0)
    assert t.as_row() == {"spread": t.spread, "calls_per_window": 5, "windows": 5}


def test_a_step_longer_than_the_window_is_timed_one_call_per_window():
    fake = FakeStep([2.0, 0.4, 0.4, 0.5, 0.4])
    t = timing().windowed(fake.step, fake.sync, windows=3, window_s=0.25, clock=fake.clock)
    assert t.calls_per_window == 1
    assert fake.calls == 5
    assert t.seconds == pytest.approx(0.4)
    assert t.spread == pytest.approx(0.1 / 0.4)


def test_the_device_is_waited_for_around_every_window():
    fake = FakeStep([0.1])
    timing().windowed(fake.step, fake.sync, windows=4, window_s=0.25, clock=fake.clock)
    assert fake.syncs == 2 + 2 * 4  # after each warm-up call, before and after each window


@pytest.mark.parametrize("kwargs", [{"windows": 0}, {"window_s": 0.0}, {"window_s": -1.0}])
def test_bad_arguments_are_refused(kwargs):
    fake = FakeStep([0.1])
    with pytest.raises(ValueError):
        timing().windowed(fake.step, fake.sync, clock=fake.clock, **kwargs)
    assert fake.calls == 0


class Machine:
    """One fake clock for several steps, each taking its own list of seconds per call (the last repeats),
    and a log of the calls in order."""

    def __init__(self, durations: dict[str, list[float]]) -> None:
        self.now = 0.0
        self.durations = durations
        self.log: list[str] = []
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def step(self, name: str):
        def call() -> None:
            calls = self.log.count(name)
            self.now += self.durations[name][min(calls, len(self.durations[name]) - 1)]
            self.log.append(name)

        return call

    def sync(self) -> None:
        self.syncs += 1


def test_alternating_rounds_call_each_step_in_turn_after_its_warm_up():
    m = Machine({"a": [5.0, 0.2, 0.3], "b": [0.1]})
    times = timing().alternating(
        {"a": m.step("a"), "b": m.step("b")}, m.sync, rounds=3, warmup=1, clock=m.clock
    )
    warm_up = ["a", "b"]  # untimed: a's 5 s is not among the times
    assert m.log == [*warm_up, "a", "b", "b", "a", "a", "b"]  # then the rounds, reversed every other one
    assert times["a"] == pytest.approx([0.2, 0.3, 0.3])
    assert times["b"] == pytest.approx([0.1, 0.1, 0.1])
    assert m.syncs == 1 + 2 * 6  # after the warm-ups, around each timed call


def test_a_paired_ratio_is_the_median_of_the_per_round_ratios():
    t = timing()
    # a load that doubles both steps of round 2 leaves that round's ratio at 2
    assert t.paired_ratio([2.0, 4.0, 2.0], [1.0, 2.0, 1.0]) == pytest.approx(2.0)
    assert t.paired_ratio([2.0, 9.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(2.0)  # one slow call: the median
    assert t.paired_ratio([1.0, 3.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(
        2.0
    )  # even: the middle two
    with pytest.raises(ValueError):
        t.paired_ratio([1.0], [1.0, 2.0])
    with pytest.raises(ValueError):
        t.paired_ratio([], [])


def test_alternating_refuses_no_rounds():
    m = Machine({"a": [0.1]})
    with pytest.raises(ValueError):
        timing().alternating({"a": m.step("a")}, m.sync, rounds=0, clock=m.clock)
    assert m.log == []


def test_device_sync_waits_on_cuda_only(monkeypatch):
    import torch

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    timing().device_sync(torch.device("cpu"))()
    assert waited == []
    timing().device_sync(torch.device("cuda", 1))()
    assert waited == [torch.device("cuda", 1)]

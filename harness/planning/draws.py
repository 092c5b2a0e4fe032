"""The distributions the simulator draws from: constants, exponentials, lognormals, and samples of a trace.

Each has ``sample(rng)`` (one value from a ``random.Random``, so a seeded simulation is
reproducible) and ``mean`` (what the closed-form ``model`` uses).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from labrl.errors import ConfigError


class Draw(Protocol):
    @property
    def mean(self) -> float: ...

    def sample(self, rng: random.Random) -> float: ...


@dataclass(frozen=True)
class Constant:
    value: float

    @property
    def mean(self) -> float:
        return self.value

    def sample(self, rng: random.Random) -> float:
        return self.value


@dataclass(frozen=True)
class Exponential:
    mean: float

    def sample(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean)


@dataclass(frozen=True)
class LogNormal:
    """``median x exp(sigma Z)``; mean ``median x exp(sigma^2 / 2)``; p99 / p50 ``= exp(2.326 sigma)``."""

    median: float
    sigma: float

    @property
    def mean(self) -> float:
        return self.median * math.exp(self.sigma**2 / 2)

    def sample(self, rng: random.Random) -> float:
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))


@dataclass(frozen=True)
class Empirical:
    """Draws uniformly from observed values (a trace's env latencies, turns, tokens per turn)."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float], what: str) -> Empirical:
        if not values:
            raise ConfigError(f"no {what} to calibrate from")
        return cls(tuple(float(v) for v in values))

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    def sample(self, rng: random.Random) -> float:
        return self.values[rng.randrange(len(self.values))]

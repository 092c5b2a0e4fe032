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
    """``min(cap, median x exp(sigma Z))``; p99 / p50 ``= exp(2.326 sigma)`` below the cap.

    Mean, with ``mu = ln median`` and ``Phi`` the standard normal CDF: uncapped
    ``median x exp(sigma^2 / 2)``; capped (a step timeout ends the call at ``cap``)
    ``median x exp(sigma^2 / 2) x Phi((ln cap - mu - sigma^2) / sigma) + cap x (1 - Phi((ln cap - mu) / sigma))``.
    """

    median: float
    sigma: float
    cap: float = math.inf

    @property
    def mean(self) -> float:
        uncapped = self.median * math.exp(self.sigma**2 / 2)
        if math.isinf(self.cap):
            return uncapped
        if self.sigma == 0:
            return min(self.median, self.cap)
        z = (math.log(self.cap) - math.log(self.median)) / self.sigma
        return uncapped * _normal_cdf(z - self.sigma) + self.cap * (1 - _normal_cdf(z))

    def sample(self, rng: random.Random) -> float:
        return min(self.cap, self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))


def _normal_cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


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

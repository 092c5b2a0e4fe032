"""Client-side pacing and failure handling: backoff, a token bucket, a circuit breaker.

- ``backoff_delay(attempt)``: full-jitter exponential backoff,
  ``delay = U(0.5, 1) * min(cap, base * 2**attempt)``; the jitter spreads a
  thousand clients that failed together so they do not retry together.
- ``TokenBucket(rate, burst)``: at most ``burst`` calls at once, refilled at
  ``rate`` per second; ``acquire()`` sleeps for the deficit.
- ``CircuitBreaker(threshold, reset_s)``: after ``threshold`` consecutive
  failures the circuit opens and calls fail fast for ``reset_s``; then one
  probe call is let through (half-open): success closes the circuit, failure
  opens it again. A dead lab is not hammered by every pending job.
"""

from __future__ import annotations

import asyncio
import random
import time


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds to wait before retry ``attempt`` (0-based): ``U(0.5, 1) * min(cap, base * 2**attempt)``."""
    return rng.uniform(0.5, 1.0) * min(cap_s, base_s * (2.0 ** min(attempt, 30)))


class TokenBucket:
    """``rate`` calls per second on average, bursts up to ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:  # one waiter at a time keeps the order fair
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            if self._tokens < 1.0:
                await asyncio.sleep((1.0 - self._tokens) / self.rate)
                self._stamp = time.monotonic()
                self._tokens = 0.0
            else:
                self._tokens -= 1.0


class CircuitBreaker:
    """Closed -> (``threshold`` consecutive failures) -> open for ``reset_s`` -> half-open probe."""

    def __init__(self, threshold: int, reset_s: float) -> None:
        self.threshold = threshold
        self.reset_s = reset_s
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half-open" if time.monotonic() - self._opened_at >= self.reset_s else "open"

    def retry_in(self) -> float:
        """Seconds until the next probe may go out (0 when a call may go now)."""
        if self._opened_at is None:
            return 0.0
        return max(0.0, self.reset_s - (time.monotonic() - self._opened_at))

    def allow(self) -> bool:
        """May a call go out now? In half-open state only one probe at a time."""
        state = self.state
        if state == "closed":
            return True
        if state == "half-open" and not self._probing:
            self._probing = True
            return True
        return False

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probing = False

    def record_failure(self) -> None:
        self._failures += 1
        if self._probing or (self._opened_at is None and self._failures >= self.threshold):
            if self._opened_at is None or self._probing:
                self.times_opened += 1
            self._opened_at = time.monotonic()
        self._probing = False

    def abandon(self) -> None:
        """A call ended without a verdict (cancelled): let another probe go."""
        self._probing = False

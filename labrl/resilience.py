"""Client-side pacing and failure handling, shared by every network client in labrl.

Used by the lab's REST client (``labrl.lab_adapters.rest``, with its journal in
``labrl.lab_adapters.journaled_lab``), the judge client (``labrl.verifiers.rubric.judge``)
and the SGLang sampler (``labrl.harness.samplers.sglang.sampler``). What each client
retries, and what it does between tries (health checks, idempotency keys,
failover), stays in the client; how long it waits, how fast it may call and
when it stops calling a dead server are here.

- ``Backoff(base_s, cap_s, jitter)``: the wait before retry ``attempt``
  (0-based), ``delay = J · min(cap_s, base_s · 2**attempt)`` with
  ``J ~ U(1 - jitter, 1)`` (``J = 1`` when ``jitter = 0``). ``jitter = 0.5`` is
  the lab's full-jitter backoff: it spreads a thousand clients that failed
  together so they do not retry together. A server's ``Retry-After`` ``w``
  wins when larger, up to ``retry_after_cap_s``:
  ``delay' = max(delay, min(w, retry_after_cap_s))``.
- ``retry_after_s(header)``: seconds from a ``Retry-After`` header
  (delta-seconds or an HTTP date), None when absent or unreadable.
- ``TokenBucket(rate, burst)``: at most ``burst`` calls at once, refilled at
  ``rate`` per second; ``acquire()`` sleeps for the deficit.
- ``CircuitBreaker(threshold, reset_s)``: after ``threshold`` consecutive
  failures the circuit opens and calls fail fast for ``reset_s``; then one
  probe call is let through (half-open): success closes the circuit, failure
  opens it again. A dead server is not hammered by every pending call.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import random
import time
from dataclasses import dataclass

_MAX_DOUBLINGS = 30  # 2**30 already exceeds any cap; keeps 2**attempt finite for huge attempts


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with optional jitter and a ``Retry-After`` rule (module docstring)."""

    base_s: float
    cap_s: float = math.inf
    jitter: float = 0.0
    retry_after_cap_s: float = math.inf

    def __post_init__(self) -> None:
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(
        self, attempt: int, rng: random.Random | None = None, retry_after: float | None = None
    ) -> float:
        """Seconds to wait before retry ``attempt`` (0-based); ``rng`` is needed when ``jitter > 0``."""
        delay = min(self.cap_s, self.base_s * (2.0 ** min(attempt, _MAX_DOUBLINGS)))
        if self.jitter:
            if rng is None:
                raise ValueError("a jittered backoff needs an rng")
            delay *= rng.uniform(1.0 - self.jitter, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_cap_s))
        return delay


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Full-jitter backoff: ``U(0.5, 1) · min(cap, base · 2**attempt)`` (``Backoff`` with jitter 0.5)."""
    return Backoff(base_s, cap_s, jitter=0.5).delay(attempt, rng)


def retry_after_s(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), None if absent or bad."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(value) if value else None
        except (TypeError, ValueError):
            return None
        if parsed is None:
            return None
        return max(0.0, parsed.timestamp() - time.time())


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

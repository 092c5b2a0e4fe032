"""``labrl.resilience``: the backoff, Retry-After, token bucket and breaker every client shares."""

from __future__ import annotations

import email.utils
import random
import time

import pytest

from labrl.resilience import Backoff, CircuitBreaker, backoff_delay, retry_after_s


def test_backoff_without_jitter_doubles_up_to_the_cap():
    backoff = Backoff(base_s=0.5, cap_s=3.0)
    assert [backoff.delay(k) for k in range(6)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert Backoff(base_s=0.25).delay(40) == 0.25 * 2.0**30  # uncapped, but finite for any attempt


def test_full_jitter_backoff_is_the_documented_formula():
    """``U(0.5, 1) · min(cap, base · 2**k)``, the same draws as the lab client always made."""
    ours, reference = random.Random(7), random.Random(7)
    for k in range(8):
        expected = reference.uniform(0.5, 1.0) * min(5.0, 0.1 * 2.0**k)
        assert Backoff(0.1, 5.0, jitter=0.5).delay(k, ours) == expected
    rng = random.Random(1)
    delays = [backoff_delay(3, 0.1, 5.0, rng) for _ in range(200)]
    assert 0.4 <= min(delays) < 0.5 < max(delays) <= 0.8


def test_retry_after_wins_when_larger_up_to_its_cap():
    backoff = Backoff(base_s=1.0, cap_s=4.0, retry_after_cap_s=10.0)
    assert backoff.delay(0, retry_after=7.0) == 7.0
    assert backoff.delay(0, retry_after=20.0) == 10.0
    assert backoff.delay(1, retry_after=0.1) == 2.0


def test_bad_backoffs_are_refused():
    with pytest.raises(ValueError, match="needs an rng"):
        Backoff(1.0, jitter=0.5).delay(0)
    with pytest.raises(ValueError, match=r"jitter must be in \[0, 1\]"):
        Backoff(1.0, jitter=1.5)


def test_retry_after_header_in_seconds_or_as_a_date():
    assert retry_after_s("7") == 7.0
    assert retry_after_s("-3") == 0.0
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert retry_after_s("") is None
    in_30_s = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 27.0 <= retry_after_s(in_30_s) <= 30.0  # type: ignore[operator]
    assert retry_after_s(email.utils.formatdate(time.time() - 60, usegmt=True)) == 0.0


def test_circuit_breaker_opens_probes_once_and_closes():
    breaker = CircuitBreaker(threshold=2, reset_s=0.05)
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow() and breaker.retry_in() > 0
    time.sleep(0.06)
    assert breaker.state == "half-open"
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.record_failure()  # the probe failed: open again
    assert breaker.state == "open" and breaker.times_opened == 2
    time.sleep(0.06)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.retry_in() == 0.0

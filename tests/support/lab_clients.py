"""The REST client of the lab reliability tests, shared with their SIGKILL driver (``tests/lab/lab_driver.py``).

Both run many jobs against the mock lab under injected faults: retries must come fast and no rate limit
may slow the run down.
"""

from __future__ import annotations

from typing import Any

from labrl.lab_adapters.journaled_lab import JournaledLabConfig
from labrl.lab_adapters.rest import RestLabAdapter, RestLabConfig

#: how the journaled client waits for completions in those runs: the event feed, polling as a fallback
JOURNAL_CONFIG = JournaledLabConfig(feed_wait_s=0.5, fallback_poll_s=2.0)


def fast_retry_client(url: str, **overrides: Any) -> RestLabAdapter:
    """A REST adapter for the lab at ``url``: backoff 20 ms doubling up to 0.3 s, no rate limit;
    ``overrides`` are further ``RestLabConfig`` fields."""
    settings: dict[str, Any] = {
        "backoff_base_s": 0.02,
        "backoff_max_s": 0.3,
        "rate_limit_per_s": None,
        **overrides,
    }
    return RestLabAdapter(RestLabConfig(base_url=url, **settings))

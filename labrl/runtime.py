"""Process-level settings for running thousands of concurrent episodes.

CPython's cyclic garbage collector runs a full collection whenever enough
long-lived objects have accumulated, and each one walks every tracked object
in the process. With 10,000 episodes in flight (their envs, transcripts and
pending futures) that is hundreds of thousands of objects, and at the default
thresholds ``(700, 10, 10)`` the collector took about half the event loop's
CPU in ``benchmarks/env_throughput.py`` (46 % of ideal throughput at 10,000
episodes; 95 % with the collector off).

``tune_gc_for_many_episodes`` freezes everything alive at start-up (imports,
registries: never garbage) and raises the thresholds so young collections are
rarer and full ones much rarer. Cycles are still collected, and the measured
peak RSS did not change. It is a process-wide setting, so the process owner
calls it: the ``labrl`` CLI does; a program that embeds labrl may.
"""

from __future__ import annotations

import gc

MANY_EPISODES_GC_THRESHOLDS = (100_000, 50, 1000)


def tune_gc_for_many_episodes() -> tuple[int, int, int]:
    """Freeze start-up objects and raise GC thresholds; returns the previous thresholds."""
    previous = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*MANY_EPISODES_GC_THRESHOLDS)
    return previous

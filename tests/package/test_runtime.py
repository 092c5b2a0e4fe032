from __future__ import annotations

import gc

from labrl.runtime import MANY_EPISODES_GC_THRESHOLDS, tune_gc_for_many_episodes


def test_tune_gc_freezes_start_up_objects_and_raises_thresholds():
    before = gc.get_threshold()
    try:
        gc.unfreeze()
        previous = tune_gc_for_many_episodes()
        assert previous == before
        assert gc.get_threshold() == MANY_EPISODES_GC_THRESHOLDS == (100_000, 50, 1000)
        assert gc.get_freeze_count() > 1000  # everything alive at start-up left the collected generations
        assert gc.isenabled()  # cycles are still collected
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)

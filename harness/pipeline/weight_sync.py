"""The learner's newest weights on their way to the sampler.

After each step the orchestrator ``publish``-es the exported weights. They go
to the sampler at once, except in ``one_step_off`` mode (``deferred``) while
episodes are in flight: then the last group to finish sends them
(``group_finished``), so every episode of a group is sampled from one policy.
Only the newest pending weights are kept, and the sampler is never moved
back to an older version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from labrl.harness.types import Sampler


class WeightSync:
    def __init__(self, sampler: Sampler, *, deferred: bool, on_synced: Callable[[], None]) -> None:
        """``on_synced`` runs after each attempt (the orchestrator wakes its waiting producer)."""
        self.sampler = sampler
        self.deferred = deferred
        self.on_synced = on_synced
        self._pending: tuple[Mapping[str, Any], int] | None = None
        self._lock = asyncio.Lock()
        self._background: set[asyncio.Task] = set()

    @property
    def pending(self) -> bool:
        return self._pending is not None

    async def publish(self, weights: Mapping[str, Any], version: int, *, episodes_in_flight: bool) -> None:
        """New weights from the learner: sent now, or (deferred mode, episodes in flight) when the last group ends."""
        self._pending = (weights, version)
        if not self.deferred or not episodes_in_flight:
            await self.sync()

    def group_finished(self, *, episodes_in_flight: bool) -> None:
        """A group ended: in deferred mode the last one to end sends the pending weights (in the background)."""
        if self.deferred and not episodes_in_flight and self._pending is not None:
            task = asyncio.get_running_loop().create_task(self.sync())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def sync(self) -> None:
        """Send the pending weights if they are newer than the sampler's."""
        async with self._lock:
            if self._pending is None:
                return
            weights, version = self._pending
            self._pending = None
            if version > self.sampler.version:
                await self.sampler.update_weights(weights, version)
        self.on_synced()

"""The group context a ``TopK`` rule needs: which members of a GRPO group pass a stage.

A ``TopK(k)`` rule passes the ``k`` best candidates of the episode's group at a stage, so an
episode cannot decide alone: it reports its value and waits for the rest of its group. The
harness's ``rollout_group`` gives the ``G`` env instances of one group the same ``GroupGate``
(``CascadeEnv.join_group``). A member whose episode ends before reporting (a failed stage, a
timeout, an unusable answer) withdraws, and ``rollout_group`` makes every member ``leave`` once its
episode is over, so the others never wait for it.

The ranking uses only the values reported at that stage and the member order (ties go to the
lower member index), never a later stage's value: what ``labrl.envs.cascade.estimator`` needs for
the rewards to stay unbiased.
"""

from __future__ import annotations

import asyncio

from labrl.errors import ConfigError


class GroupGate:
    """Ranks the values the ``size`` members of one group report at each stage."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ConfigError(f"a group gate needs at least one member, got {size}")
        self.size = size
        self._values: dict[str, dict[int, float | None]] = {}
        self._complete: dict[str, asyncio.Event] = {}
        self._left: set[int] = set()

    def _stage(self, stage: str) -> tuple[dict[int, float | None], asyncio.Event]:
        if stage not in self._values:
            self._values[stage] = dict.fromkeys(self._left)  # who left never reports at a later stage
            self._complete[stage] = asyncio.Event()
            if len(self._values[stage]) == self.size:
                self._complete[stage].set()
        return self._values[stage], self._complete[stage]

    def _record(self, member: int, stage: str, value: float | None) -> asyncio.Event:
        if not 0 <= member < self.size:
            raise ValueError(f"member {member} is outside a group of {self.size}")
        values, complete = self._stage(stage)
        if member in values:
            raise ValueError(f"member {member} already reported at stage {stage!r}")
        values[member] = value
        if len(values) == self.size:
            complete.set()
        return complete

    def withdraw(self, member: int, stage: str) -> None:
        """``member`` will never report at ``stage`` (its episode ended): the others stop waiting for it."""
        values, _ = self._stage(stage)
        if member not in values:
            self._record(member, stage, None)

    def leave(self, member: int) -> None:
        """``member``'s episode is over: withdraw it from every stage, now and later."""
        self._left.add(member)
        for stage in list(self._values):
            self.withdraw(member, stage)

    async def reported(self, member: int, stage: str, value: float) -> dict[int, float]:
        """Report ``value`` at ``stage``; once every member has reported or withdrawn, the values
        reported there by member index (withdrawn members absent)."""
        complete = self._record(member, stage, value)
        await complete.wait()
        return {other: v for other, v in self._values[stage].items() if v is not None}

    async def rank(self, member: int, stage: str, value: float) -> int:
        """Report ``value`` at ``stage``; once every member has reported or withdrawn, the number of
        members ranked above ``member`` (0: the best)."""
        values = await self.reported(member, stage, value)
        return sum(
            1
            for other, v in values.items()
            if other != member and (v > value or (v == value and other < member))
        )

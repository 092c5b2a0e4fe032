"""What a backend is: it starts the parts of a run somewhere and hands ``train`` the same interfaces.

A backend decides *where* the learner, the sampler and the episodes live
(``inprocess``: this process; ``ray``: actors). ``labrl.harness.backends.parts``
decides *what* they are. The orchestrator drives the returned ``RunParts``
without knowing which backend built them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from labrl.harness.backends.parts import EnvFactory, OnSFTStep, ShouldStop
from labrl.harness.config import RunConfig
from labrl.harness.pipeline.orchestrator import GroupPlayer
from labrl.harness.tokenizer import Tokenizer
from labrl.harness.types import Learner, Sampler

#: async () -> numbers merged into each step record (``ray/*`` counters)
StepExtras = Callable[[], Awaitable[dict[str, Any]]]
#: told, after each checkpoint, the indices of the groups it leaves in flight (to be replayed on resume)
OnCheckpoint = Callable[[set[int]], None]
#: releases what the backend started; returns its numbers for ``summary.json`` (empty: none)
CloseBackend = Callable[[], Awaitable[dict[str, Any]]]


async def _nothing_to_close() -> dict[str, Any]:
    return {}


@dataclass
class RunParts:
    """What a backend builds for ``train``: the learner and sampler the orchestrator drives, and its hooks.

    A hook left ``None`` means "in this process": ``play_group`` None plays
    groups with ``rollout_group`` in the driver.
    """

    learner: Learner
    sampler: Sampler
    sft_s: float = 0.0
    play_group: GroupPlayer | None = None
    step_extras: StepExtras | None = None
    on_checkpoint: OnCheckpoint | None = None
    close: CloseBackend = field(default=_nothing_to_close)


@dataclass(frozen=True)
class RunStart:
    """What ``train`` hands a backend: the run, the driver's tokenizer and env factory, and the warm start's hooks.

    ``resume``: a checkpoint will be loaded, so no warm start. ``on_sft``
    receives each warm-start record; ``should_stop`` (polled between warm-start
    steps) ends the warm start early.
    """

    cfg: RunConfig
    tokenizer: Tokenizer
    make_env: EnvFactory
    resume: bool = False
    on_sft: OnSFTStep = field(default=lambda record: None)
    should_stop: ShouldStop = field(default=lambda: False)


@runtime_checkable
class Backend(Protocol):
    """Starts a run's parts (``RunStart``); on a fresh run it runs the warm start first."""

    async def start(self, run: RunStart) -> RunParts: ...

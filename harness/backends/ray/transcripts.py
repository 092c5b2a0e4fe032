"""Resume an episode from what it generated before its env worker died.

An env worker records every generation of every episode it plays
(``GroupTranscript``). When an episode asks the lab for an experiment, its
record so far travels with the request to the lab gateway (one call that
exists anyway), which keeps it until the driver has the group's trajectories.
If the worker dies, the group is played again on another worker with those
records: ``TranscriptSampler`` answers the recorded turns from the record
instead of the sampler, so the episode's actions, and therefore its lab
request and idempotency key, are the same, and the lab call re-attaches to the
job already paid for. Members without a record are simply re-run.

A replayed turn must see the prompt it was generated from (same env, same
task, same tokenizer): the record keeps a digest of the prompt's tokens, and a
mismatch (a nondeterministic env) ends the replay for that member, which then
generates afresh from that turn on (counted as ``replay_diverged``).
"""

from __future__ import annotations

import contextvars
import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from labrl.harness.rollout.play import current_member
from labrl.harness.types import GenerateRequest, GenerateResult, SamplerWrapper


def prompt_digest(input_ids: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(input_ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class SavedTurn:
    prompt_digest: str
    result: GenerateResult


@dataclass
class GroupTranscript:
    """One group's generations so far (``turns``) and the record it resumes from (``saved``), per member."""

    index: int
    saved: Mapping[int, Sequence[SavedTurn]] = field(default_factory=dict)
    turns: dict[int, list[SavedTurn]] = field(default_factory=dict)
    diverged: set[int] = field(default_factory=set)
    counters: Counter[str] = field(default_factory=Counter)

    def resumed(self, member: int) -> bool:
        return bool(self.saved.get(member))


#: the group played by the running asyncio task (set by the env worker around ``rollout_group``)
current_group: contextvars.ContextVar[GroupTranscript | None] = contextvars.ContextVar(
    "current_group", default=None
)


class TranscriptSampler(SamplerWrapper):
    """A ``Sampler`` that records each member's turns and replays a saved record; see the module docstring."""

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        group, member = current_group.get(), current_member.get()
        if group is None or member is None:
            return await self.inner.generate(requests)
        out = []
        for request in requests:
            turns = group.turns.setdefault(member, [])
            saved = group.saved.get(member, ())
            digest = prompt_digest(request.input_ids)
            k = len(turns)
            if k < len(saved) and member not in group.diverged and saved[k].prompt_digest == digest:
                result = saved[k].result
                group.counters["turns_replayed"] += 1
            else:
                if k < len(saved) and member not in group.diverged:
                    group.diverged.add(member)
                    group.counters["replay_diverged"] += 1
                (result,) = await self.inner.generate([request])
            turns.append(SavedTurn(digest, result))
            out.append(result)
        return out

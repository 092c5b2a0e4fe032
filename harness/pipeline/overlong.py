"""Overlong generations: score, filter (DAPO) or budget-force (ScaleRL interruptions), plus a length penalty.

Budget forcing is a sampler wrapper, so the rollout stays unaware of it: a
generation that stops on ``length`` is continued from ``input + output + cue``
for ``answer_tokens`` more tokens, and the parts are joined into one result.
The cue tokens were not sampled by the policy, so they are tagged with
version ``NO_VERSION``; ``mask_unsampled_tokens`` later takes them off the
loss mask (their log-prob is not the policy's).

The soft length penalty (DAPO) for ``L`` generated tokens, budget ``L_max``
and cache ``c``::

    r' = r + clip(((L_max - c) - L) / c, -penalty, 0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from labrl.harness.types import (
    NO_VERSION,
    GenerateRequest,
    GenerateResult,
    Sampler,
    SamplerWrapper,
    Trajectory,
)

OverlongMode = Literal["score", "filter", "force"]


class OverlongSection(BaseModel):
    """What to do with a generation that hit ``max_new_tokens`` (finish_reason ``length``).

    - ``score``: score it as it is;
    - ``filter``: keep its reward in the group statistics but mask its tokens
      from the loss (DAPO overlong filtering);
    - ``force``: append ``cue`` (an end-of-thinking marker) and let the model
      answer in ``answer_tokens`` more tokens (ScaleRL interruptions); the cue
      tokens are not trained on.

    ``penalty_tokens`` > 0 adds DAPO's soft length penalty to trainable
    rewards: ``r += clip(((L_max - c) - L) / c, -penalty, 0)`` with ``c =
    penalty_tokens`` and ``L`` the number of generated tokens.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: OverlongMode = "score"
    cue: str = "\nANSWER:"
    answer_tokens: int = Field(default=16, ge=1)
    penalty_tokens: int = Field(default=0, ge=0)
    penalty: float = Field(default=1.0, ge=0.0)


class BudgetForcingSampler(SamplerWrapper):
    """Wraps a ``Sampler``: length-stopped generations get the cue and a short answer budget."""

    def __init__(self, inner: Sampler, cue_ids: Sequence[int], answer_tokens: int) -> None:
        if not cue_ids:
            raise ValueError("budget forcing needs a non-empty cue")
        super().__init__(inner)
        self.cue_ids = list(cue_ids)
        self.answer_tokens = answer_tokens
        self.forced = 0

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        first = await self.inner.generate(requests)
        redo = [i for i, r in enumerate(first) if r.finish_reason == "length"]
        if not redo:
            return first
        follow = [
            GenerateRequest(
                rid=f"{requests[i].rid}+forced",
                input_ids=(*requests[i].input_ids, *first[i].output_ids, *self.cue_ids),
                sampling=requests[i].sampling.model_copy(update={"max_new_tokens": self.answer_tokens}),
                return_routed_experts=requests[i].return_routed_experts,
            )
            for i in redo
        ]
        second = await self.inner.generate(follow)
        out = list(first)
        for i, r2 in zip(redo, second, strict=True):
            self.forced += 1
            r1, n_cue = first[i], len(self.cue_ids)
            routed = None
            if r1.routed_experts_T_L_K is not None and r2.routed_experts_T_L_K is not None:
                # keep the first pass's rows up to its last fed token; the rest come from the second pass
                keep = len(requests[i].input_ids) + len(r1.output_ids) - 1
                routed = np.concatenate(
                    [r1.routed_experts_T_L_K[:keep], r2.routed_experts_T_L_K[keep:]], axis=0
                )
            out[i] = GenerateResult(
                rid=r1.rid,
                output_ids=[*r1.output_ids, *self.cue_ids, *r2.output_ids],
                logprobs_T=[*r1.logprobs_T, *[0.0] * n_cue, *r2.logprobs_T],
                versions_T=[*r1.versions_T, *[NO_VERSION] * n_cue, *r2.versions_T],
                finish_reason=r2.finish_reason,
                routed_experts_T_L_K=routed,
                info={**r1.info, "forced": True},
            )
        return out


def mask_unsampled_tokens(traj: Trajectory) -> tuple[Trajectory, int]:
    """Take tokens the policy did not sample (version NO_VERSION) off the loss mask; returns how many."""
    bad = [
        i
        for i, (m, v) in enumerate(zip(traj.loss_mask_T, traj.versions_T, strict=True))
        if m and v == NO_VERSION
    ]
    if not bad:
        return traj, 0
    mask, logp = list(traj.loss_mask_T), list(traj.logprobs_T)
    for i in bad:
        mask[i], logp[i] = 0, 0.0
    return dataclasses.replace(traj, loss_mask_T=mask, logprobs_T=logp), len(bad)


def length_penalty(num_generated: int, max_tokens: int, cache: int, cap: float) -> float:
    """DAPO soft overlong punishment (see module docstring); 0 when ``cache`` is 0."""
    if cache <= 0:
        return 0.0
    return float(min(0.0, max(-cap, ((max_tokens - cache) - num_generated) / cache)))


def process_overlong(
    traj: Trajectory, cfg: OverlongSection, max_new_tokens: int
) -> tuple[Trajectory, dict[str, int]]:
    """Apply the configured overlong handling to one finished trajectory; returns it with per-episode counts."""
    traj, n_cue = mask_unsampled_tokens(traj)
    flags = {
        "forced": int(n_cue > 0),
        "overlong": int(traj.finish_reason == "length"),
        "filtered": 0,
        "penalised": 0,
    }
    generated = sum(1 for v in traj.versions_T if v != NO_VERSION)
    if traj.reward is not None and cfg.penalty_tokens > 0:
        pen = length_penalty(generated, max_new_tokens, cfg.penalty_tokens, cfg.penalty)
        if pen < 0:
            flags["penalised"] = 1
            traj = dataclasses.replace(traj, reward=traj.reward + pen)
    if flags["overlong"] and cfg.mode == "filter":
        flags["filtered"] = 1
        traj = dataclasses.replace(traj, loss_mask_T=[0] * len(traj.tokens_T))
    return traj, flags

"""A cascade env under the harness's ``rollout_group``: the group's shared gate and the episode's record."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from labrl.envs import make
from labrl.envs.cascade import CascadeRecord, GroupGate
from labrl.harness.rollout.play import rollout_group
from labrl.harness.tokenizer import ByteTokenizer
from labrl.harness.types import GenerateRequest, GenerateResult, SamplingParams

FAST = {"proxy_latency_s": 1e-4, "truth_latency_s": 1e-4, "proxy_noise": 0.0}
TOKENIZER = ByteTokenizer()


class MemberSampler:
    """Replies ``replies[i]`` to group member ``i`` (its request ids start ``g{i}:``); None aborts the turn."""

    version = 0

    def __init__(self, replies: Sequence[str | None]) -> None:
        self.replies = replies

    async def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        out = []
        for r in requests:
            reply = self.replies[int(r.rid.split(":", 1)[0][1:])]
            if reply is None:  # the prompt left no room: the episode ends before the env is stepped
                out.append(GenerateResult(r.rid, [], [], [], "abort"))
                continue
            ids = TOKENIZER.encode(reply)
            out.append(GenerateResult(r.rid, ids, [0.0] * len(ids), [0] * len(ids), "stop"))
        return out


async def _group(replies: Sequence[str | None], **options):
    def make_env():
        return make("synthetic/cascade-v0", **FAST, top_k=1, cascade={"audit_probability": 1e-4}, **options)

    task = make_env().make_task("train", 0)
    play = rollout_group(
        make_env, task, MemberSampler(replies), TOKENIZER, SamplingParams(max_new_tokens=32), len(replies)
    )
    return task, await asyncio.wait_for(play, timeout=20)  # a member left waiting would hang: fail instead


async def test_rollout_group_shares_a_gate_and_the_top_k_reaches_the_truth():
    answers = ["0.1", "0.9", "0.45", "0.6"]
    task, group = await _group([f"<answer>{a}</answer>" for a in answers])
    best = min(range(len(answers)), key=lambda i: abs(float(answers[i]) - float(task.answer)))
    records = [CascadeRecord.model_validate(t.info["cascade"]) for t in group]
    assert [t.outcome for t in group] == ["ok"] * 4
    assert [len(r.stages) for r in records] == [2 if i == best else 1 for i in range(4)]
    assert [r.reward for r in records] == [t.reward for t in group]  # the record travels with the reward
    assert records[best].stages[1].cost == 0.001 and records[best].stages[1].cost_unit == "gpu_h"


@pytest.mark.parametrize(
    "broken",
    [
        "no answer at all",  # invalid_action: never reaches the cascade, so never reports at a stage
        None,  # the sampler aborts: the env is never stepped
    ],
)
async def test_a_member_that_never_reports_does_not_hold_up_its_group(broken):
    _, group = await _group(["<answer>0.2</answer>", broken, "<answer>0.7</answer>"])
    assert group[1].outcome in ("invalid_action", "env_error") and "cascade" not in group[1].info
    reached = [len(group[i].info["cascade"]["stages"]) for i in (0, 2)]
    assert sorted(reached) == [1, 2]  # the other two are ranked between themselves


async def test_a_gate_left_before_a_stage_opens_never_waits_for_that_member():
    gate = GroupGate(3)
    gate.leave(2)  # member 2's episode ended before anyone reported at "proxy"
    first, second = await asyncio.wait_for(
        asyncio.gather(gate.reported(0, "proxy", 0.5), gate.rank(1, "proxy", 0.2)), timeout=1
    )
    assert first == {0: 0.5, 1: 0.2} and second == 1

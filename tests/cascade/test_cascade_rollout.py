"""A cascade env under the harness's ``rollout_group``: the group's shared gate and the episode's record."""

from __future__ import annotations

import asyncio

import pytest
from cascade_fakes import play_group

from labrl.envs.cascade import CascadeRecord, GroupGate


async def test_rollout_group_shares_a_gate_and_the_top_k_reaches_the_truth():
    answers = ["0.1", "0.9", "0.45", "0.6"]
    task, group = await play_group([f"<answer>{a}</answer>" for a in answers])
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
    _, group = await play_group(["<answer>0.2</answer>", broken, "<answer>0.7</answer>"])
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

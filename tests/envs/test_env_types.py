from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from labrl.envs import Action, Budgets, EnvSpec, Message, Observation, Outcome, StepResult, Task, ToolCall


def test_records_round_trip_json():
    records = [
        Task(env_id="a/b-v0", split="train", seed=3, task_id="t", prompt={"x": [1, 2]}, answer={"k": 1.5}),
        Observation(messages=(Message(role="user", content="hi"),), info={"n": 1}),
        Action(text="x", tool_calls=(ToolCall(id="call_0", name="f", arguments={"a": 1}),)),
        StepResult(reward=0.5, done=True, outcome=Outcome.OK),
        EnvSpec(id="xrd/phase-id-v0", budgets=Budgets(pools={"lab": 4})),
    ]
    for record in records:
        assert type(record).model_validate_json(record.model_dump_json()) == record


def test_env_id_must_be_versioned():
    with pytest.raises(ValidationError, match=re.escape("must look like 'namespace/name-vN'")):
        EnvSpec(id="xrd/phase-id")
    assert EnvSpec(id="xrd/phase-id-v12").version == 12


def test_failed_outcomes_carry_no_reward():
    with pytest.raises(ValidationError, match="outcome 'verifier_failed' carries no reward"):
        StepResult(reward=0.0, outcome=Outcome.VERIFIER_FAILED)
    with pytest.raises(ValidationError, match="reward must be a finite number"):
        StepResult(reward=float("nan"))
    assert [o.value for o in Outcome if o.trainable] == ["ok", "invalid_action"]


def test_budgets_validate_and_records_are_frozen():
    with pytest.raises(ValidationError, match="pool 'lab' must allow at least 1"):
        Budgets(pools={"lab": 0})
    with pytest.raises(ValidationError):
        Budgets(step_timeout_s=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        Budgets(step_timeout=3)
    with pytest.raises(ValidationError, match="frozen"):
        Budgets().max_turns = 3

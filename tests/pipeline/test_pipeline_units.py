"""Config, buffer, admission and overlong handling: pure units with hand-computed numbers."""

from __future__ import annotations

import dataclasses
import re

import pytest
from pipeline_fakes import BigramSampler

from labrl.errors import ConfigError
from labrl.harness.config import apply_overrides, build_run_config, load_run_config
from labrl.harness.pipeline import (
    AdmissionState,
    BudgetForcingSampler,
    Group,
    GroupBuffer,
    length_penalty,
    may_start,
    predicted_train_version,
    process_overlong,
)
from labrl.harness.pipeline.admission import (
    KEEP_RATE_FLOOR,
    kept_upper,
    pessimistic_keep_rate,
    trained_before_end,
)
from labrl.harness.pipeline.buffer import KEEP_WINDOW, constant_kind
from labrl.harness.pipeline.overlong import OverlongSection
from labrl.harness.pipeline.shaping import shape_invalid_action
from labrl.harness.pipeline.stats import REPLAYED, episodes_over_staleness
from labrl.harness.types import NO_VERSION, GenerateRequest, SamplingParams, Trajectory


def traj(
    reward: float | None, *, outcome: str = "ok", finish: str = "stop", gen: int = 2, version: int = 0
) -> Trajectory:
    return Trajectory(
        env_id="test/x-v0", task_id="t", group_id="g",
        tokens_T=[1] * (2 + gen), loss_mask_T=[0, 0] + [1] * gen, logprobs_T=[0.0, 0.0] + [-1.0] * gen,
        versions_T=[NO_VERSION, NO_VERSION] + [version] * gen, reward=reward, outcome=outcome,
        finish_reason=finish, num_turns=1,  # type: ignore[arg-type]
    )  # fmt: skip


# -- config -------------------------------------------------------------------------


def test_typo_in_override_names_the_key_and_the_closest_one():
    with pytest.raises(
        ConfigError,
        match=re.escape("pipeline.max_stalness: unknown key; did you mean pipeline.max_staleness?"),
    ):
        build_run_config(apply_overrides({"env": {"id": "test/letter-v0"}}, ["pipeline.max_stalness=3"]))


def test_typo_in_yaml_file_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("env:\n  id: test/letter-v0\nlearner:\n  optimizer:\n    lr: 0.1\n  micro_batch: 4\n")
    with pytest.raises(
        ConfigError,
        match=re.escape("learner.micro_batch: unknown key; did you mean learner.micro_batch_size?"),
    ):
        load_run_config(path)


def test_overrides_are_parsed_as_yaml_scalars_and_lists(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("env:\n  id: test/letter-v0\npipeline:\n  mode: sync\n")
    cfg = load_run_config(
        path,
        ["learner.optimizer.lr=3e-4", "pipeline.mode=pipeline", "objective.corrections=[m2po]", "seed=7"],
    )
    assert cfg.learner.optimizer.lr == 3e-4
    assert cfg.pipeline.mode == "pipeline"
    assert [c.kind for c in cfg.objective.corrections] == ["m2po"]
    assert cfg.seed == 7


def test_bad_values_name_the_field():
    with pytest.raises(
        ConfigError, match=re.escape("pipeline.group_size: Input should be greater than or equal to 2")
    ):
        build_run_config({"env": {"id": "a/b-v0"}, "pipeline": {"group_size": 1}})
    with pytest.raises(ConfigError, match=re.escape("sampler.kind=sglang needs sampler.sglang.urls")):
        build_run_config({"env": {"id": "a/b-v0"}, "sampler": {"kind": "sglang"}})
    with pytest.raises(ConfigError, match=re.escape("override 'seed' must look like key.sub=value")):
        apply_overrides({}, ["seed"])


# -- buffer -------------------------------------------------------------------------


def test_buffer_drops_zero_variance_masks_untrainable_and_counts():
    buf = GroupBuffer(batch_groups=2)
    assert buf.add(Group(0, 0, [traj(1.0), traj(0.0), traj(None, outcome="timeout")], 0)) == "kept"
    assert buf.add(Group(1, 1, [traj(1.0), traj(1.0)], 0)) == "zero_variance"
    assert (
        buf.add(Group(2, 2, [traj(None, outcome="env_error"), traj(None, outcome="timeout")], 0))
        == "untrainable"
    )
    assert buf.add(Group(3, 3, [traj(0.0), traj(None, outcome="verifier_failed")], 0)) == "zero_variance"
    assert not buf.ready
    assert buf.add(Group(4, 4, [traj(0.5), traj(0.0)], 0)) == "kept"
    assert buf.ready
    assert buf.counters["episodes"] == 11
    assert buf.counters["episodes_masked"] == 4
    assert buf.counters["episodes_masked_timeout"] == 2
    assert buf.keep_rate == pytest.approx(2 / 5)
    # of the two zero-variance groups one was solved every time, one failed (its other member masked)
    assert (
        buf.counters["groups_zero_variance_all_correct"]
        == buf.counters["groups_zero_variance_all_wrong"]
        == 1
    )
    batch = buf.pop_batch()
    assert [g.index for g in batch] == [0, 4]
    assert [t.reward for t in batch[0].trajectories] == [1.0, 0.0]  # the timed-out member is gone


def test_buffer_without_dynamic_sampling_keeps_zero_variance_groups():
    buf = GroupBuffer(batch_groups=1, dynamic_sampling=False)
    assert buf.add(Group(0, 0, [traj(1.0), traj(1.0)], 0)) == "kept"


def test_buffer_state_round_trip():
    buf = GroupBuffer(batch_groups=3)
    buf.add(Group(0, 10, [traj(1.0), traj(0.0)], 0))
    buf.add(Group(1, 11, [traj(1.0), traj(1.0)], 0))
    other = GroupBuffer(batch_groups=3)
    other.load_state_dict(buf.state_dict())
    assert [g.task_seed for g in other.peek()] == [10]
    assert other.counters == buf.counters
    assert list(other.recent_kept) == [True, False]
    # a checkpoint from before the window existed: the window starts empty (keep rate 1 assumed)
    old = {k: v for k, v in buf.state_dict().items() if k != "recent_kept"}
    other.load_state_dict(old)
    assert list(other.recent_kept) == []


def test_batches_take_the_groups_that_started_first_not_the_first_to_arrive():
    buf = GroupBuffer(batch_groups=2)
    # arrival order: a young group, an old slow one, a middle one, then a tie on version broken by time
    buf.add(Group(7, 7, [traj(1.0), traj(0.0)], start_version=3, started_at=30.0))
    buf.add(Group(2, 2, [traj(1.0), traj(0.0)], start_version=1, started_at=10.0))
    buf.add(Group(5, 5, [traj(1.0), traj(0.0)], start_version=2, started_at=20.0))
    buf.add(Group(9, 9, [traj(1.0), traj(0.0)], start_version=1, started_at=5.0))
    assert [g.index for g in buf.pop_batch()] == [9, 2]
    assert [g.index for g in buf.peek()] == [7, 5]  # the rest keep their arrival order
    assert [g.index for g in buf.pop_batch()] == [5, 7]


# -- admission ------------------------------------------------------------------------


def test_predicted_train_version_by_hand():
    s = AdmissionState(
        learner_version=5, learner_busy=True, sampler_version=5, buffered_groups=3, inflight_groups=6
    )
    # of 6 in flight at keep rate 0.5, at worst ceil(3 + 1.645 sqrt(1.5)) = ceil(5.01) = 6 are kept:
    # ahead = 3 + 6 = 9 groups; batch 4 -> two full batches ahead; busy -> +1
    assert kept_upper(6, 0.5) == 6
    assert predicted_train_version(s, batch_groups=4, keep_rate=0.5) == 5 + 1 + 2
    assert may_start(s, 4, 0.5, max_staleness=3)
    assert not may_start(s, 4, 0.5, max_staleness=2)
    # the mean (3 kept) would have said one batch ahead: optimistic when 4+ of them are kept
    s16 = dataclasses.replace(s, buffered_groups=0, inflight_groups=16)
    assert kept_upper(16, 0.6) == 13  # 9.6 + 1.645 x 1.96 = 12.8
    assert predicted_train_version(s16, 4, 0.6) == 5 + 1 + 3


def test_kept_upper_is_exact_at_the_ends_and_capped():
    assert [kept_upper(n, 1.0) for n in range(5)] == [0, 1, 2, 3, 4]
    assert [kept_upper(n, 0.0) for n in range(5)] == [0] * 5
    assert kept_upper(1, 0.85) == 1 and kept_upper(8, 0.5) == 7
    assert kept_upper(200, 0.5) == 112  # 100 + 1.645 x 7.07 = 111.6


def test_pessimistic_keep_rate_by_hand():
    assert pessimistic_keep_rate(0, 0) == 1.0  # nothing seen: assume every group is kept
    assert pessimistic_keep_rate(64, 64) == 1.0
    assert pessimistic_keep_rate(0, 64) == KEEP_RATE_FLOOR
    # Wilson upper bound, z = 1.645: p = 38/64 = 0.594 -> 0.689
    assert pessimistic_keep_rate(38, 64) == pytest.approx(0.6889, abs=1e-4)
    # fewer groups seen, same rate: less certain, so higher
    assert pessimistic_keep_rate(6, 10) == pytest.approx(0.8058, abs=1e-4)
    with pytest.raises(ValueError, match="kept must be in"):
        pessimistic_keep_rate(5, 4)


def test_keep_rate_follows_the_recent_window_not_the_whole_run():
    buf = GroupBuffer(batch_groups=100)
    for i in range(200):  # a long run that kept every group ...
        buf.add(Group(i, i, [traj(1.0), traj(0.0)], 0))
    for i in range(200, 200 + KEEP_WINDOW):  # ... then drops every group for one window
        buf.add(Group(i, i, [traj(1.0), traj(1.0)], 0))
    assert buf.keep_rate == pytest.approx(200 / (200 + KEEP_WINDOW))  # cumulative: still 0.76
    assert list(buf.recent_kept) == [False] * KEEP_WINDOW
    assert pessimistic_keep_rate(sum(buf.recent_kept), len(buf.recent_kept)) == KEEP_RATE_FLOOR


def test_episodes_over_the_bound_are_counted_apart_when_replayed_from_a_transcript():
    fresh = [traj(1.0, version=v) for v in (9, 6, 5)]  # staleness 1, 4, 5 at learner version 10
    replayed = [dataclasses.replace(traj(0.0, version=v), info={REPLAYED: True}) for v in (2, 9)]
    assert episodes_over_staleness(fresh + replayed, 10, 4) == (1, 1)
    assert episodes_over_staleness(fresh + replayed, 10, 0) == (3, 2)


def test_sync_admission_admits_exactly_one_batch():
    def state(inflight: int, busy: bool = False, learner: int = 0, sampler: int = 0) -> AdmissionState:
        return AdmissionState(learner, busy, sampler, 0, inflight)

    assert [may_start(state(k), 4, 1.0, 0) for k in range(6)] == [True] * 4 + [False] * 2
    assert not may_start(state(0, busy=True), 4, 1.0, 0)
    assert not may_start(state(0, learner=1, sampler=0), 4, 1.0, 0)  # weights not yet synced


def test_no_group_starts_past_the_runs_last_batch():
    def state(inflight: int, busy: bool = False, buffered: int = 0) -> AdmissionState:
        return AdmissionState(9, busy, 9, buffered, inflight)

    # 10 steps, 9 done: the last batch of 4 groups still has room for 4, then nothing
    assert [trained_before_end(state(k), 4, 1.0, 9, 10) for k in range(6)] == [True] * 4 + [False] * 2
    # the last step is training: whatever starts now would join step 11
    assert not trained_before_end(state(0, busy=True), 4, 1.0, 9, 10)
    # dynamic sampling drops half the groups: twice as many may run for the last batch
    # dynamic sampling drops half the groups, but 4 in flight may all be kept: no more than with none
    assert [trained_before_end(state(k), 4, 0.5, 9, 10) for k in range(10)] == [True] * 4 + [False] * 6
    # at keep rate 0.25, at worst 3 of 5 are kept but 4 of 6 (1.5 + 1.645 x 1.06 = 3.24)
    assert [trained_before_end(state(k), 4, 0.25, 9, 10) for k in range(10)] == [True] * 6 + [False] * 4
    assert trained_before_end(state(0, buffered=3), 4, 1.0, 9, 10)
    assert not trained_before_end(state(0, buffered=4), 4, 1.0, 9, 10)


# -- overlong -------------------------------------------------------------------------


def test_length_penalty_by_hand():
    # L_max 32, cache 8: no penalty up to 24 tokens, then -1/8 per token, capped
    assert length_penalty(24, 32, 8, 1.0) == 0.0
    assert length_penalty(28, 32, 8, 1.0) == pytest.approx(-0.5)
    assert length_penalty(40, 32, 8, 0.75) == pytest.approx(-0.75)
    assert length_penalty(100, 32, 0, 1.0) == 0.0


def test_overlong_filter_masks_the_loss_but_keeps_the_reward():
    cfg = OverlongSection(mode="filter")
    t, flags = process_overlong(traj(1.0, finish="length", gen=4), cfg, max_new_tokens=4)
    assert flags == {"forced": 0, "overlong": 1, "filtered": 1, "penalised": 0}
    assert t.reward == 1.0 and sum(t.loss_mask_T) == 0
    t2, flags2 = process_overlong(traj(1.0, finish="length", gen=4), OverlongSection(mode="score"), 4)
    assert sum(t2.loss_mask_T) == 4 and flags2["filtered"] == 0


def test_overlong_penalty_applies_to_trainable_rewards_only():
    cfg = OverlongSection(penalty_tokens=2, penalty=1.0)
    t, flags = process_overlong(traj(1.0, gen=4), cfg, max_new_tokens=4)
    assert t.reward == pytest.approx(0.0) and flags["penalised"] == 1  # ((4-2)-4)/2 = -1
    t, _ = process_overlong(traj(None, outcome="timeout", gen=4), cfg, max_new_tokens=4)
    assert t.reward is None


async def test_budget_forcing_appends_the_cue_and_an_answer_untrained():
    inner = BigramSampler()
    forcing = BudgetForcingSampler(inner, cue_ids=[10, 65], answer_tokens=3)
    req = GenerateRequest(rid="r", input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=5, seed=1))
    (res,) = await forcing.generate([req])
    assert res.info["forced"] is True and forcing.forced == 1
    assert res.output_ids[5:7] == [10, 65]
    assert res.versions_T[5:7] == [NO_VERSION, NO_VERSION]
    assert len(res.output_ids) == 5 + 2 + 3
    t = Trajectory(
        env_id="e", task_id="t", group_id="g", tokens_T=[1, 2, *res.output_ids], loss_mask_T=[0, 0] + [1] * 10,
        logprobs_T=[0.0, 0.0, *res.logprobs_T], versions_T=[NO_VERSION, NO_VERSION, *res.versions_T],
        reward=1.0, outcome="ok", finish_reason=res.finish_reason, num_turns=1,
    )  # fmt: skip
    t2, flags = process_overlong(t, OverlongSection(mode="force"), 5)
    assert flags["forced"] == 1
    assert t2.loss_mask_T == [0, 0] + [1] * 5 + [0, 0] + [1] * 3


# -- invalid-action reward (shaping) ---------------------------------------------------


def test_invalid_action_reward_replaces_the_envs_only_on_invalid_scored_episodes():
    invalid = traj(0.0, outcome="invalid_action")
    assert shape_invalid_action(invalid, -0.25).reward == -0.25
    assert shape_invalid_action(invalid, None) is invalid  # the env's own reward
    wrong = traj(0.0)
    assert shape_invalid_action(wrong, -0.25) is wrong  # a valid wrong answer keeps its 0
    unscored = traj(None, outcome="timeout")
    assert shape_invalid_action(unscored, -0.25).reward is None  # masked stays masked


@pytest.mark.parametrize("value", ["0.5", "-2"])
def test_invalid_action_reward_outside_minus_one_to_zero_is_a_config_error(value):
    with pytest.raises(ConfigError, match=re.escape("pipeline.invalid_action_reward")):
        build_run_config(
            apply_overrides({"env": {"id": "test/letter-v0"}}, [f"pipeline.invalid_action_reward={value}"])
        )


def test_a_negative_invalid_reward_splits_an_otherwise_all_wrong_group():
    # {invalid, wrong, wrong, invalid} all score 0 from the env: no signal, dropped as all-wrong.
    # Shaped, the valid-but-wrong answers rank above the invalid ones and the group is kept.
    members = [traj(0.0, outcome="invalid_action"), traj(0.0), traj(0.0), traj(0.0, outcome="invalid_action")]
    for shaped, verdict in ((None, "zero_variance"), (-0.1, "kept")):
        buffer = GroupBuffer(1)
        group = Group(0, 0, [shape_invalid_action(t, shaped) for t in members], 0, 0.0, 0.0)
        assert buffer.add(group) == verdict
    all_invalid = [traj(0.0, outcome="invalid_action")] * 4
    assert constant_kind([shape_invalid_action(t, -0.1).reward for t in all_invalid]) == "all_wrong"

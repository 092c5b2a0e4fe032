"""The closed-form steady state: admission's cap as the rule decides it, hand-computed layouts, invariants."""

from __future__ import annotations

import itertools

import pytest

from labrl.errors import ConfigError
from labrl.harness.pipeline.admission import AdmissionState, may_start, pessimistic_keep_rate
from labrl.harness.planning.model import (
    Layout,
    Workload,
    admission_inflight_groups,
    admission_keep_rate,
    steady_state,
)


def layout(**overrides) -> Layout:
    base = dict(
        sampler_tokens_per_s=1000.0, kv_slots=10, env_slots=100, learner_step_s=1.0, batch_groups=2,
        group_size=4, max_staleness=4, max_concurrent_episodes=1024,
    )  # fmt: skip
    return Layout(**(base | overrides))  # type: ignore[arg-type]


def most_admitted_by_the_rule(S: int, B: int, q: float, busy: bool) -> int:
    """Start groups one by one while admission.may_start says yes (sampler on the learner's version)."""
    n = 0
    while may_start(AdmissionState(7, busy, 7, 0, n), B, q, S):
        n += 1
    return n


@pytest.mark.parametrize(
    ("S", "B", "q", "busy"),
    list(itertools.product([0, 1, 4], [1, 2, 8], [1.0, 0.8, 0.5, 0.25], [False, True])),
)
def test_the_admission_cap_is_what_may_start_decides(S, B, q, busy):
    assert admission_inflight_groups(S, B, q, learner_busy=busy) == most_admitted_by_the_rule(S, B, q, busy)


def test_admission_cap_by_hand():
    assert (
        admission_inflight_groups(4, 8, 1.0, learner_busy=True) == 32
    )  # room 4 x 8 - 1 = 31, plus the one starting
    assert admission_inflight_groups(4, 8, 1.0, learner_busy=False) == 40
    assert admission_inflight_groups(0, 8, 1.0, learner_busy=False) == 8  # sync: one batch
    assert admission_inflight_groups(0, 8, 1.0, learner_busy=True) == 0
    # q = 0.5, B = 2, S = 1, busy: room 1; kept_upper(1, 0.5) = min(1, ceil(0.5 + 1.645 x 0.5)) = 1 fits,
    # kept_upper(2, 0.5) = min(2, ceil(1 + 1.645 x 0.707)) = 2 does not: one in flight, plus the one starting
    assert admission_inflight_groups(1, 2, 0.5, learner_busy=True) == 2


def test_admission_assumes_the_wilson_bound_of_a_full_window():
    assert admission_keep_rate(1.0) == 1.0
    assert admission_keep_rate(0.5) == pessimistic_keep_rate(32, 64) > 0.5
    assert admission_keep_rate(0.1) == 0.25  # the floor


def test_a_learner_bound_layout_by_hand():
    # G = 4, B = 2, p = 1, D = 1 s: X_L = 8 episodes/s; 1 turn of 10 tokens at r = 1000 / 10 = 100 tok/s
    # (t_gen = 0.1 s) and 1 s of env: T = 1.1 s; admission: 8 groups (32 episodes) -> X_N = 29.1
    s = steady_state(Workload(turns=1, tokens_per_turn=10, env_s_per_episode=1.0), layout())
    assert s.binding == "learner"
    assert s.episodes_per_s == pytest.approx(8.0) and s.steps_per_s == pytest.approx(1.0)
    assert s.episode_s == pytest.approx(1.1) and s.open_episodes == 32 and s.admission_groups == 8
    assert s.ceilings == pytest.approx(
        {"learner": 8.0, "sampler": 100.0, "env_workers": 100.0, "admission": 32 / 1.1}
    )
    assert (s.learner_busy, s.learner_idle) == pytest.approx((1.0, 0.0))
    assert (s.sampler_busy, s.env_busy) == pytest.approx((0.08, 0.08))
    assert s.staleness_mean == pytest.approx(4.0)  # p N / (B G) = 32 / 8


def test_an_env_bound_layout_with_dynamic_sampling_by_hand():
    # 3 turns x 20 tokens, 6 s of env per episode on 12 slots: X_E = 2 episodes/s; p = 0.5
    s = steady_state(
        Workload(turns=3, tokens_per_turn=20, env_s_per_episode=6.0, keep_rate=0.5),
        layout(env_slots=12, learner_step_s=0.5),
    )
    assert s.binding == "env_workers" and s.episodes_per_s == pytest.approx(2.0)
    assert s.steps_per_s == pytest.approx(0.5 * 2.0 / 8)
    assert s.learner_idle == pytest.approx(1 - 0.125 * 0.5)


def test_max_concurrent_episodes_caps_whole_groups():
    s = steady_state(
        Workload(turns=1, tokens_per_turn=10, env_s_per_episode=1.0), layout(max_concurrent_episodes=10)
    )
    assert s.open_episodes == 8 and s.binding == "max_concurrent_episodes"
    assert s.episodes_per_s == pytest.approx(8 / 1.1)


def test_sync_generates_then_trains():
    # T = 1.1 s, D = 1 s: one step per 2.1 s
    s = steady_state(Workload(turns=1, tokens_per_turn=10, env_s_per_episode=1.0), layout(max_staleness=0))
    assert s.steps_per_s == pytest.approx(1 / 2.1) and s.binding == "admission"


@pytest.mark.parametrize(
    ("keep", "env_s", "slots", "D", "S"),
    list(itertools.product([1.0, 0.6, 0.3], [0.0, 0.5, 20.0], [4, 64], [0.2, 5.0], [0, 1, 3])),
)
def test_invariants(keep, env_s, slots, D, S):
    w = Workload(turns=2, tokens_per_turn=50, env_s_per_episode=env_s, keep_rate=keep)
    lay = layout(kv_slots=slots, env_slots=slots, learner_step_s=D, max_staleness=S, batch_groups=4)
    s = steady_state(w, lay)
    assert s.steps_per_s * lay.batch_groups * lay.group_size / keep == pytest.approx(s.episodes_per_s)
    assert s.episodes_per_s == pytest.approx(min(s.ceilings.values())) or S == 0
    for busy in (s.learner_busy, s.sampler_busy, s.env_busy):
        assert 0 <= busy <= 1 + 1e-9
    assert s.open_s >= s.episode_s - 1e-9  # an episode is open at least as long as it runs


def test_bad_workloads_and_layouts_are_config_errors():
    with pytest.raises(ConfigError, match="keep_rate"):
        Workload(turns=1, tokens_per_turn=1, env_s_per_episode=0, keep_rate=0)
    with pytest.raises(ConfigError, match="turns > 0"):
        Workload(turns=0, tokens_per_turn=1, env_s_per_episode=0)
    with pytest.raises(ConfigError, match="slots"):
        layout(kv_slots=0)

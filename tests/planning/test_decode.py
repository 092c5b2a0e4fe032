"""The sampler as a batched decoder: the fit of t(b) = a + c b from traces, the closed form and the
simulator with it, and its reduction to the fixed-rate model at c = 0."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from labrl.errors import ConfigError
from labrl.harness.planning.decode import GenerationWindow, fit_decode, generation_windows, mean_batches
from labrl.harness.planning.draws import Constant
from labrl.harness.planning.model import Layout, Workload, steady_state, sync_steps_per_s
from labrl.harness.planning.simulate import EpisodeModel, simulate


def layout(**overrides) -> Layout:
    base = dict(
        sampler_tokens_per_s=1000.0, kv_slots=10, env_slots=1000, learner_step_s=1.0, batch_groups=2,
        group_size=4, max_staleness=4, max_concurrent_episodes=1024,
    )  # fmt: skip
    return Layout(**(base | overrides))  # type: ignore[arg-type]


def test_windows_start_after_the_reset_and_the_turns_before_them():
    record = {
        "start_s": 10.0,
        "env_s": [0.5, 2.0, 1.0],
        "generation_s": [1.0, 3.0],
        "generated_tokens": [4, 6],
    }
    assert generation_windows([record]) == [GenerationWindow(10.5, 1.0, 4), GenerationWindow(13.5, 3.0, 6)]


def test_mean_batch_is_the_time_average_of_the_windows_open_capped_at_the_slots():
    # [0, 4], [2, 6], [3, 5]: the first sees 1 for 2 s, 2 for 1 s, 3 for 1 s -> 7 / 4
    windows = [GenerationWindow(0, 4, 1), GenerationWindow(2, 4, 1), GenerationWindow(3, 2, 1)]
    assert mean_batches(windows, slots=8) == pytest.approx([7 / 4, (2 + 3 + 2 + 1) / 4, 5 / 2])
    # at most 2 slots: the first sees 1, 1, 2, 2 -> 6 / 4
    assert mean_batches(windows, slots=2) == pytest.approx([6 / 4, (2 + 2 + 2 + 1) / 4, 2.0])


def synthetic_trace(a: float, c: float, rng: random.Random) -> list[GenerationWindow]:
    """Blocks of ``b`` generations started together and decoding together: each takes ``n t(b)`` s."""
    windows, now = [], 0.0
    for b in [1, 2, 4, 8, 16, 32] * 5:
        n = rng.randint(20, 60)
        windows += [GenerationWindow(now, n * (a + c * b), n) for _ in range(b)]
        now += n * (a + c * b) + 1.0  # a gap: the next block decodes alone
    return windows


def test_a_synthetic_trace_gives_back_its_a_and_c():
    fit = fit_decode(synthetic_trace(0.004, 0.002, random.Random(0)), slots=64)
    assert fit.fitted
    assert (fit.step_s, fit.per_sequence_s) == pytest.approx((0.004, 0.002))
    assert fit.batch_range == pytest.approx((1.0, 32.0))
    assert fit.sequence_tokens_per_s(8) == pytest.approx(1 / 0.020)
    assert fit.sampler_tokens_per_s(8) == pytest.approx(8 / 0.020)


def test_a_compute_bound_trace_fits_on_the_boundary_a_zero():
    fit = fit_decode(synthetic_trace(0.0, 0.003, random.Random(1)), slots=64)
    assert fit.fitted and fit.step_s == 0.0 and fit.per_sequence_s == pytest.approx(0.003)


def test_too_little_spread_in_the_batch_falls_back_to_the_fixed_rate():
    # every generation alone: b = 1 throughout, 10 tokens in 0.5 s
    windows = [GenerationWindow(i * 1.0, 0.5, 10) for i in range(20)]
    fit = fit_decode(windows, slots=8)
    assert not fit.fitted and "vary too little" in fit.reason
    assert (fit.step_s, fit.per_sequence_s) == (0.05, 0.0)  # sum g / sum n


def noisy_blocks(
    batches: list[int], a: float, c: float, noise: float, rng: random.Random
) -> list[GenerationWindow]:
    """As ``synthetic_trace``, each block's seconds off by a uniform factor in ``1 +- noise``."""
    windows, now = [], 0.0
    for b in batches:
        n = rng.randint(20, 60)
        seconds = n * (a + c * b) * (1 + rng.uniform(-noise, noise))
        windows += [GenerationWindow(now, seconds, n) for _ in range(b)]
        now += seconds + 1.0
    return windows


def test_a_narrow_batch_range_fits_when_the_run_resolves_the_slope():
    # 4-6 sequences at once (batch sd ~0.8, as the lab env's s1_c8 run): enough blocks resolve c
    fit = fit_decode(noisy_blocks([4, 5, 6] * 60, 0.002, 0.0008, 0.05, random.Random(2)), slots=8)
    assert fit.fitted, fit.reason
    assert fit.per_sequence_s == pytest.approx(0.0008, rel=0.15)
    assert fit.step_s == pytest.approx(0.002, rel=0.3)


def test_a_slope_the_run_does_not_resolve_falls_back_to_the_fixed_rate():
    # the same range, a few blocks and +-60 % noise: the slope is within its error of zero
    windows = noisy_blocks([4, 5, 6] * 2, 0.002, 0.0008, 0.6, random.Random(3))
    fit = fit_decode(windows, slots=8)
    assert not fit.fitted and "vary too little" in fit.reason and "slope" in fit.reason, fit.reason
    assert fit.per_sequence_s == 0.0
    assert fit.step_s == pytest.approx(sum(w.seconds for w in windows) / sum(w.tokens for w in windows))


def test_a_batch_that_does_not_slow_decoding_falls_back_to_the_fixed_rate():
    windows = [w for b in (1, 4, 16) for w in [GenerationWindow(b * 100.0, 1.0, 20)] * b]
    fit = fit_decode(windows, slots=64)
    assert not fit.fitted and fit.per_sequence_s == 0.0 and fit.step_s == pytest.approx(0.05)


def test_no_generation_is_a_config_error():
    with pytest.raises(ConfigError, match="no generation"):
        fit_decode([], slots=4)


def test_c_zero_is_the_fixed_rate_model():
    # R = 1000 tokens/s over 10 slots: r = 100 tokens/s whatever the batch
    lay = layout()
    assert lay.decode_fixed_s == pytest.approx(0.01) and lay.decode_step_s(1) == lay.decode_step_s(10) == 0.01
    w = Workload(turns=2, tokens_per_turn=50, env_s_per_episode=3.0)
    s = steady_state(w, lay)
    # today's model by hand: t_gen = 100 / 100 = 1 s, T = 4 s; admission 32 episodes -> X_N = 8 = X_L
    assert s.episode_s == pytest.approx(4.0)
    assert s.ceilings["admission"] == pytest.approx(32 / 4.0)
    assert s.sampler_busy == pytest.approx(s.episodes_per_s * 100 / 1000)
    assert s.decoding == pytest.approx(s.episodes_per_s * 1.0)  # Little: X t_gen
    assert sync_steps_per_s(w, replace(lay, max_staleness=0)) == pytest.approx(1 / (4.0 + 1.0))


def test_a_batched_decoder_by_hand():
    # kv 10, c = 0.5 ms, R = 1000 tokens/s: t(10) = 10 ms, a = 10 - 5 = 5 ms
    lay = layout(decode_per_sequence_s=0.0005, learner_step_s=0.01, max_concurrent_episodes=8)
    assert lay.decode_fixed_s == pytest.approx(0.005)
    w = Workload(turns=1, tokens_per_turn=100, env_s_per_episode=1.5)
    s = steady_state(w, lay)
    # N = 8 open bind: k m c b^2 + (k m a + e - N k m c) b - N k m a = 0 -> 0.05 b^2 + 1.6 b - 4 = 0
    b = (-1.6 + (1.6**2 + 4 * 0.05 * 4) ** 0.5) / (2 * 0.05)
    assert s.binding == "max_concurrent_episodes" and s.decoding == pytest.approx(b)
    t = 0.005 + 0.0005 * b
    assert s.step_s == pytest.approx(t) and s.sequence_tokens_per_s == pytest.approx(1 / t)
    assert s.episodes_per_s == pytest.approx(8 / (100 * t + 1.5))
    assert s.decoding == pytest.approx(s.episodes_per_s * 100 * t)  # Little's law over the decoding
    assert s.ceilings["sampler"] == pytest.approx(10.0)  # R / (k m)
    # the fixed rate of a full batch (r = 100) would have been 8 / 2.5 = 3.2 episodes/s: fewer decode faster
    assert s.episodes_per_s > 8 / 2.5


def test_when_another_ceiling_binds_the_batch_follows_from_its_rate():
    lay = layout(decode_per_sequence_s=0.0005, learner_step_s=4.0)  # X_L = 8 / 4 = 2 episodes/s
    s = steady_state(Workload(turns=1, tokens_per_turn=100, env_s_per_episode=1.5), lay)
    assert s.binding == "learner" and s.episodes_per_s == pytest.approx(2.0)
    # b = X k m a / (1 - X k m c) = 2 x 100 x 0.005 / (1 - 2 x 100 x 0.0005) = 1 / 0.9
    assert s.decoding == pytest.approx(1 / 0.9)


def test_a_layout_whose_per_sequence_cost_exceeds_a_full_step_is_refused():
    with pytest.raises(ConfigError, match="decode_per_sequence_s"):
        layout(decode_per_sequence_s=0.002)  # c kv = 20 ms > kv / R = 10 ms


def test_the_simulator_decodes_a_smaller_batch_faster_as_the_closed_form_says():
    # one group of 4 at a time (sync would idle; max 4 in flight): 4 sequences of 100 tokens decode
    # together with no env time: each takes 100 t(4) = 100 x 7 ms = 0.7 s
    lay = layout(decode_per_sequence_s=0.0005, group_size=4, batch_groups=1, learner_step_s=0.001,
                 max_concurrent_episodes=4, max_staleness=8)  # fmt: skip
    episode = EpisodeModel(turns=Constant(1), tokens_per_turn=Constant(100), env_s=Constant(0.0))
    sim = simulate(episode, lay, seconds=300.0)
    closed = steady_state(episode.workload(), lay)
    assert closed.decoding == pytest.approx(4.0) and closed.step_s == pytest.approx(0.007)
    assert sim.steps_per_s == pytest.approx(1 / (0.7 + 0.001), rel=0.01)
    assert sim.steps_per_s == pytest.approx(closed.steps_per_s, rel=0.01)


def test_the_batched_simulator_with_a_tiny_c_matches_the_fixed_rate_one():
    episode = EpisodeModel(turns=Constant(2), tokens_per_turn=Constant(30), env_s=Constant(0.2))
    fixed = layout(kv_slots=4, sampler_tokens_per_s=400.0, learner_step_s=0.5, max_concurrent_episodes=16)
    batched = replace(fixed, decode_per_sequence_s=1e-9)
    a, b = simulate(episode, fixed, seconds=200.0), simulate(episode, batched, seconds=200.0)
    assert b.steps_per_s == pytest.approx(a.steps_per_s, rel=1e-3)
    assert b.utilisation["sampler"] == pytest.approx(a.utilisation["sampler"], rel=1e-3)

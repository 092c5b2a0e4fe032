"""The discrete-event simulator against closed forms: Erlang C, deterministic pipelines, the steady state."""

from __future__ import annotations

import math
import random

import pytest

from labrl.harness.planning.draws import Constant, Empirical, Exponential, LogNormal
from labrl.harness.planning.model import Layout, Workload, steady_state
from labrl.harness.planning.simulate import EpisodeModel, EventLoop, Station, TracedEpisode, simulate


def erlang_c_wait(servers: int, arrival_rate: float, service_rate: float) -> float:
    """Mean wait in queue of M/M/c: ``C(c, a) / (c mu - lambda)``, ``a = lambda / mu``."""
    c, a = servers, arrival_rate / service_rate
    rho = a / c
    tail = a**c / math.factorial(c) / (1 - rho)
    p_wait = tail / (sum(a**k / math.factorial(k) for k in range(c)) + tail)
    return p_wait / (c * service_rate - arrival_rate)


@pytest.mark.parametrize(("servers", "arrival_rate"), [(1, 0.7), (4, 3.0)])
def test_a_station_with_poisson_arrivals_waits_as_erlang_c(servers, arrival_rate):
    loop, rng = EventLoop(), random.Random(3)
    station = Station(loop, servers, record_from=500.0)
    service = Exponential(1.0)

    def arrive() -> None:
        station.submit(service.sample(rng), lambda: None)
        loop.after(rng.expovariate(arrival_rate), arrive)

    loop.after(0.0, arrive)
    loop.run(200_000.0)
    expected = erlang_c_wait(servers, arrival_rate, 1.0)
    assert sum(station.waits) / len(station.waits) == pytest.approx(expected, rel=0.04)
    # Little's law on the queue: mean length = arrival rate x mean wait
    assert station.queue_length.mean() == pytest.approx(arrival_rate * expected, rel=0.04)


def constant_episode(turns=1, tokens=10, env_s=0.2, keep_rate=1.0) -> EpisodeModel:
    return EpisodeModel(Constant(turns), Constant(tokens), Constant(env_s), keep_rate=keep_rate)


def ample(**overrides) -> Layout:
    # r = 1000 / 10 = 100 tokens/s: 10 tokens take 0.1 s; an episode of 1 turn is 0.2 + 0.1 + 0.2 = 0.5 s
    base = dict(
        sampler_tokens_per_s=1000.0, kv_slots=10, env_slots=1000, learner_step_s=1.0, batch_groups=2,
        group_size=2, max_staleness=2, max_concurrent_episodes=1024,
    )  # fmt: skip
    return Layout(**(base | overrides))  # type: ignore[arg-type]


WORKLOAD = Workload(turns=1, tokens_per_turn=10, env_s_per_episode=0.4)


@pytest.mark.parametrize(
    ("name", "lay", "mode", "steps_per_s"),
    [
        ("learner-bound", ample(), "pipeline", 1.0),  # one step per D = 1 s
        (
            "in-flight-bound",
            ample(max_concurrent_episodes=4, learner_step_s=0.1),
            "pipeline",
            2.0,
        ),  # 2 groups / 0.5 s
        ("sync", ample(max_staleness=0, learner_step_s=0.1), "sync", 1 / 0.6),  # generate 0.5 s, train 0.1 s
    ],
)
def test_a_deterministic_pipeline_runs_at_its_closed_form_rate_exactly(name, lay, mode, steps_per_s):
    result = simulate(constant_episode(), lay, seconds=200.0, mode=mode)
    assert result.steps_per_s == pytest.approx(steps_per_s, rel=1e-9)
    assert steady_state(WORKLOAD, lay).steps_per_s == pytest.approx(steps_per_s, rel=1e-9)
    assert result.over_max_staleness == 0 and max(result.staleness_hist) <= lay.max_staleness


def test_learner_idle_and_staleness_of_a_learner_bound_run():
    result = simulate(constant_episode(), ample(), seconds=200.0)
    assert result.learner_idle == pytest.approx(0.0, abs=1e-6)
    assert result.queues["buffer"] > 0  # kept groups wait for the learner
    # admission holds every episode to the bound, and the pipeline runs ahead up to it
    assert max(result.staleness_hist) == 2


def test_a_sampler_bound_run_matches_the_steady_state():
    episode = EpisodeModel(Constant(3), Exponential(100.0), LogNormal(0.5, 1.0), keep_rate=0.7)
    lay = Layout(
        sampler_tokens_per_s=2000.0, kv_slots=32, env_slots=512, learner_step_s=2.0, batch_groups=8,
        group_size=8, max_staleness=4, max_concurrent_episodes=1024,
    )  # fmt: skip
    closed = steady_state(
        Workload(turns=3, tokens_per_turn=100.0, env_s_per_episode=4 * episode.env_s.mean, keep_rate=0.7), lay
    )
    assert closed.binding == "sampler"
    result = simulate(episode, lay, seconds=20_000.0, seed=1)
    assert result.steps_per_s == pytest.approx(closed.steps_per_s, rel=0.03)
    assert result.learner_idle == pytest.approx(closed.learner_idle, rel=0.05)
    assert result.queues["kv_cache"] > 0  # generations wait for a slot
    mean_staleness = sum(s * n for s, n in result.staleness_hist.items()) / sum(
        result.staleness_hist.values()
    )
    assert mean_staleness == pytest.approx(closed.staleness_mean, rel=0.15)
    assert result.staleness_p99 <= lay.max_staleness + 1


def test_a_seeded_run_is_reproducible_and_seeds_differ():
    episode = EpisodeModel(Constant(2), Constant(50), LogNormal(1.0, 1.0), keep_rate=0.6)
    a, b, c = (simulate(episode, ample(), seconds=500.0, seed=s) for s in (5, 5, 6))
    assert a.staleness_hist == b.staleness_hist and a.step_times == b.step_times
    assert a.step_times != c.step_times


def test_heavy_tailed_env_latency_puts_stragglers_over_the_bound():
    # the bound is a prediction for episodes that take about as long as the others (admission's docstring)
    episode = EpisodeModel(Constant(1), Constant(10), LogNormal(0.2, 2.0), keep_rate=1.0)
    result = simulate(episode, ample(learner_step_s=0.2, max_staleness=1), seconds=2000.0, seed=2)
    assert result.over_max_staleness > 0
    assert result.staleness_p50 <= 1


def test_a_traced_group_replays_its_members_as_they_were():
    # one traced group of a fast member (0.1 s generation + 0.2 s step) and a slow one (0.1 + 1.0 s);
    # sync, one group per batch: every step waits for the slow member, 1.1 s, then trains 0.1 s
    fast, slow = TracedEpisode((10,), (0.0, 0.2)), TracedEpisode((10,), (0.0, 1.0))
    episode = EpisodeModel(Constant(5), Constant(99), Constant(9.0), groups=((fast, slow),))
    lay = ample(batch_groups=1, group_size=4, max_staleness=0, learner_step_s=0.1)
    assert simulate(episode, lay, seconds=200.0, mode="sync").steps_per_s == pytest.approx(1 / 1.2, rel=1e-9)


def test_replayed_groups_keep_their_members_correlated():
    # half the traced groups are all fast (env 0.1 + 0.1 s), half all slow (0.5 + 0.5 s); a step is
    # the group's 0.1 s generation, its env calls and 0.1 s of training: replayed, 0.4 or 1.2 s, 0.8 s
    # on average. Drawn independently from the same pooled calls, a member's env time is 0.2, 0.6 or
    # 1.0 s (1/4, 1/2, 1/4) and a group's the larger of two: E = (0.2 + 8 x 0.6 + 7 x 1.0) / 16 = 0.75 s,
    # a 0.95 s step
    fast, slow = TracedEpisode((10,), (0.1, 0.1)), TracedEpisode((10,), (0.5, 0.5))
    pooled = Empirical.of([0.1, 0.1, 0.5, 0.5], "env calls")
    lay = ample(batch_groups=1, group_size=2, max_staleness=0, learner_step_s=0.1)
    replayed = EpisodeModel(Constant(1), Constant(10), pooled, groups=((fast, fast), (slow, slow)))
    independent = EpisodeModel(Constant(1), Constant(10), pooled)
    assert simulate(replayed, lay, seconds=20_000.0, mode="sync").steps_per_s == pytest.approx(
        1 / 0.8, rel=0.02
    )
    assert simulate(independent, lay, seconds=20_000.0, mode="sync").steps_per_s == pytest.approx(
        1 / 0.95, rel=0.02
    )

"""The learnt control variate: ``r = b + (A / q)(e - b)`` with ``b`` from already-paid truths.

The estimator against closed forms (unbiased for any fixed ``b``, variance ``(1 - q)/q (e - b)^2``),
the nearest-truths model on a known function, and the synthetic env trained-reward fidelity with and
without it. Monte Carlo assertions allow ``Z`` standard errors (seeded, so deterministic).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from cascade_fakes import play_one_step

from labrl.envs import make
from labrl.envs.cascade import CascadeRecord, CascadeSection, cascade_reward, conditional_variance
from labrl.envs.cascade.baseline import NearestTruths
from labrl.envs.cascade.config import ControlVariate
from labrl.errors import ConfigError

Z = 4.0
FAST = {"proxy_latency_s": 1e-4, "truth_latency_s": 1e-4}


def test_any_fixed_baseline_keeps_the_reward_unbiased_with_the_closed_form_variance():
    """c = e + 0.3 + noise (a biased proxy), b a poor but fixed guess, q = 0.2: mean r -> e,
    Var(r | e, b) -> (1 - q)/q (e - b)^2."""
    rng = np.random.default_rng(0)
    n, q, e, b = 100_000, 0.2, 0.7, 0.55
    ran = rng.random(n) < q
    rewards = np.array(
        [cascade_reward([e + 0.3, e], [q], b) if a else cascade_reward([e + 0.3], [], b) for a in ran]
    )
    assert abs(rewards.mean() - e) < Z * rewards.std() / math.sqrt(n)
    expected = (1 - q) / q * (e - b) ** 2
    assert expected == pytest.approx(conditional_variance([b, e], [q]))
    assert rewards.var() == pytest.approx(expected, rel=0.03)
    # the proxy in b's place is the plain estimator, with the proxy's larger gap in the variance
    assert conditional_variance([e + 0.3, e], [q]) > 3 * expected


def test_a_baseline_stands_in_for_the_first_stage_only():
    # r = b + (s_1 - b)/P_1 + (s_2 - s_1)/P_2, P = (0.5, 0.25)
    assert cascade_reward([0.9, 0.4, 0.6], [0.5, 0.5], 0.3) == pytest.approx(0.3 + 0.1 / 0.5 + 0.2 / 0.25)
    assert cascade_reward([0.9], [], 0.3) == 0.3  # nothing reached past the first: b itself
    assert cascade_reward([0.9, 0.4], [1.0], 0.3) == pytest.approx(0.4)  # q = 1: the truth whatever b


def _model(**options) -> NearestTruths:
    return NearestTruths(ControlVariate(kind="nearest_truths", **options))


def test_nearest_truths_learns_a_tent_and_declines_until_it_has_enough():
    model = _model(neighbours=8, min_truths=50, window=1000)
    rng = random.Random(0)
    for i in range(49):
        x = rng.uniform(-0.5, 0.5)
        model.add(f"t{i}", [x], 1 - 2 * abs(x))
    assert model.predict("other", [0.0]) is None
    for i in range(49, 800):
        x = rng.uniform(-0.5, 0.5)
        model.add(f"t{i}", [x], 1 - 2 * abs(x))
    for x in (-0.4, -0.1, 0.0, 0.2, 0.45):
        assert model.predict("other", [x]) == pytest.approx(1 - 2 * abs(x), abs=0.03)


def test_nearest_truths_leaves_the_asking_task_out():
    model = _model(neighbours=1, min_truths=1, window=10)
    model.add("same", [0.0], 1.0)
    model.add("other", [5.0], 0.0)
    assert model.predict("same", [0.0]) == 0.0  # its own exact point is not used
    assert model.predict("another", [0.0]) == 1.0
    assert _model(neighbours=1, min_truths=2, window=10).predict("x", [0.0]) is None


def test_nearest_truths_keeps_the_last_window_of_points():
    model = _model(neighbours=4, min_truths=4, window=4)
    for i in range(4):
        model.add(f"old{i}", [float(i)], 0.0)
    for i in range(4):
        model.add(f"new{i}", [float(i)], 1.0)
    assert model.stored == 4 and model.predict("x", [1.5]) == 1.0


def test_nearest_truths_scales_each_input_by_its_spread():
    """The second input spans 1000x the first; unscaled, it alone would pick the neighbours."""
    model = _model(neighbours=1, min_truths=1, window=10)
    model.add("a", [0.0, 0.0], 1.0)
    model.add("b", [1.0, 100.0], 2.0)
    model.add("c", [0.0, 1000.0], 3.0)
    assert model.predict("x", [0.9, 150.0]) == 2.0


def test_nearest_truths_refuses_bad_inputs():
    model = _model(neighbours=1, min_truths=1, window=10)
    model.add("a", [0.0, 1.0], 1.0)
    with pytest.raises(ValueError, match="have 1 values, the stored points 2"):
        model.predict("x", [0.0])
    with pytest.raises(ValueError, match="finite"):
        model.add("b", [math.nan, 0.0], 1.0)


def test_the_section_refuses_a_model_that_cannot_fit_its_window():
    with pytest.raises(ValueError, match="must fit in the window"):
        CascadeSection.model_validate(
            {"control_variate": {"kind": "nearest_truths", "neighbours": 64, "window": 32}}
        )
    with pytest.raises(ConfigError, match="control_variate"):
        make("synthetic/cascade-v0", cascade={"control_variate": {"kind": "nearest_truth"}})


async def _play(control_variate: dict) -> tuple[np.ndarray, np.ndarray, list[CascadeRecord]]:
    """Train rewards of 1,200 random answers (8 per task, 150 tasks; audit 0.1, no rule passes) and
    their truths, on the benchmark's proxy (optimum 0.3 off the truth's, reading 0.1 high)."""
    options = {
        **FAST,
        "proxy_shift": 0.3,
        "proxy_offset": 0.1,
        "pass_threshold": 1e9,
        "cascade": {"audit_probability": 0.1, "seed": 3, "control_variate": control_variate},
    }
    full = {**options, "cascade": {"audit_probability": 1}}
    rng = random.Random(1)
    rewards, truths, records = [], [], []
    for seed in range(150):
        task = make("synthetic/cascade-v0", **options).make_task("train", seed)
        for _ in range(8):
            text = f"<answer>{min(1.0, max(0.0, task.prompt['hint'] + rng.uniform(-0.3, 0.3))):.4f}</answer>"
            result = await play_one_step(make("synthetic/cascade-v0", **options), task, text)
            truth = await play_one_step(make("synthetic/cascade-v0", **full), task, text)
            rewards.append(result.reward)
            truths.append(truth.reward)
            records.append(CascadeRecord.model_validate(result.info["cascade"]))
    return np.array(rewards), np.array(truths), records


def _bias_in_standard_errors(r: np.ndarray, e: np.ndarray) -> float:
    gap = r - e
    return float(gap.mean() / (gap.std() / math.sqrt(gap.size)))


async def test_the_learnt_baseline_makes_the_trained_reward_track_the_truth_without_bias():
    """On the benchmark's shifted proxy the plain estimator's reward barely follows the truth; once the
    learnt baseline has its first truths, the reward does, and both stay unbiased.

    Plain: ``Var(r | s) = 9 (e - c)^2`` with gaps of ~0.5; learnt: ``9 (e - b)^2`` with ``e - b`` of ~0.04."""
    r, e, _ = await _play({"kind": "proxy"})
    assert abs(_bias_in_standard_errors(r, e)) < Z
    assert np.corrcoef(r, e)[0, 1] < 0.4

    r, e, records = await _play({"kind": "nearest_truths", "min_truths": 32})
    learnt = np.array([record.baseline is not None for record in records])
    assert learnt.mean() > 0.75 and not learnt[:40].any()  # the first tasks: too few truths yet
    assert abs(_bias_in_standard_errors(r[learnt], e[learnt])) < Z
    assert np.corrcoef(r[learnt], e[learnt])[0, 1] > 0.8
    for record in (record for record, has_b in zip(records, learnt, strict=True) if has_b):
        expected = cascade_reward(record.values, record.run_probabilities, record.baseline)
        assert record.reward == pytest.approx(expected)
        if len(record.stages) == 1:  # not audited: b itself
            assert record.reward == record.baseline


def test_the_contract_checker_passes_a_cascade_with_a_learnt_baseline():
    from labrl.envs import check_env

    cascade = {
        "audit_probability": 0.5,
        "control_variate": {"kind": "nearest_truths", "neighbours": 1, "min_truths": 1},
    }
    report = check_env("synthetic/cascade-v0", seeds=6, cascade=cascade)
    assert report.passed, [c for c in report.checks if not c.passed]


async def test_baseline_inputs_that_change_length_are_an_env_error():
    options = {
        **FAST,
        "pass_threshold": 1e9,
        "cascade": {
            "audit_probability": 1,
            "control_variate": {"kind": "nearest_truths", "neighbours": 1, "min_truths": 1},
        },
    }
    first = make("synthetic/cascade-v0", **options)
    assert (
        await play_one_step(first, first.make_task("train", 0), "<answer>0.5</answer>")
    ).reward is not None
    second = make("synthetic/cascade-v0", **options)
    second.unwrapped.baseline_inputs = lambda candidate, first_value: (candidate, first_value)
    result = await play_one_step(second, second.make_task("train", 1), "<answer>0.5</answer>")
    assert result.outcome.value == "env_error" and "baseline_inputs" in result.info["error"]

"""``benchmarks/planner.py``'s comparison on the fixture run: what it measures, predicts and the errors."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from labrl.errors import ConfigError
from labrl.harness.config import load_run_config

FIXTURES = Path(__file__).parent / "fixtures"
RUN = FIXTURES / "run"
CONFIG = FIXTURES / "plan.yaml"
BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def planner() -> ModuleType:
    """The script as a module; benchmarks/ goes on ``sys.path`` (last): it imports its helpers beside it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module("planner")


def test_measured_from_the_fixture_by_hand():
    # 7 steps 5 s apart, busy/learner 0.4 throughout; the warm-up tenth of 7 records is none, so the
    # window is steps 1..7: 6 steps in 30 s, learner busy 0.4 x 35 - 0.4 x 5 = 12 s of the 30.
    # Trained after step 1: groups 1-6, 24 episodes, each one version stale.
    m = planner().measure(RUN)
    assert m["window_steps"] == [1, 7]
    assert m["steps_per_s"] == pytest.approx(0.2)
    assert m["learner_idle"] == pytest.approx(0.6)
    assert (m["staleness_p50"], m["staleness_p99"], m["trained_episodes"]) == (1, 1, 24)


def test_errors_are_relative_for_throughput_and_absolute_for_staleness():
    e = planner().errors(
        {"steps_per_s": 0.23, "staleness_p99": 5.0, "learner_idle": 0.1},
        {"steps_per_s": 0.2, "staleness_p99": 3.0, "learner_idle": 0.25},
    )
    assert e["steps_per_s_rel"] == pytest.approx(0.15)
    assert e["staleness_p99_abs"] == 2.0
    assert e["learner_idle_abs"] == pytest.approx(-0.15)
    assert e["throughput_ok"] and not e["staleness_ok"]
    e = planner().errors(
        {"steps_per_s": 0.16, "staleness_p99": 2.0, "learner_idle": 0.0},
        {"steps_per_s": 0.2, "staleness_p99": 3.0, "learner_idle": 0.0},
    )
    assert e["steps_per_s_rel"] == pytest.approx(-0.2)
    assert not e["throughput_ok"] and e["staleness_ok"]


def test_compare_the_fixture_with_itself():
    bench = planner()
    cfg = load_run_config(CONFIG)
    out = bench.compare(cfg, RUN, RUN, sim_steps=200)
    assert set(out) == {"predicted", "measured", "errors"}
    p, m, e = out["predicted"], out["measured"], out["errors"]
    assert p["calibration"]["kv_slots"] == 2  # 80 tokens/s over 40 per sequence (test_calibrate_and_plan)
    assert p["calibration"]["keep_rate"] == pytest.approx(0.7)
    assert p["steps_per_s"] > 0 and 0.0 <= p["learner_idle"] <= 1.0 and p["staleness_p99"] >= 0
    assert e["steps_per_s_rel"] == pytest.approx(p["steps_per_s"] / m["steps_per_s"] - 1)
    assert e["staleness_p99_abs"] == pytest.approx(p["staleness_p99"] - m["staleness_p99"])
    assert e["learner_idle_abs"] == pytest.approx(p["learner_idle"] - m["learner_idle"])
    assert e["throughput_ok"] == (abs(e["steps_per_s_rel"]) <= 0.15)


def test_a_run_of_two_steps_has_no_window(tmp_path):
    lines = (RUN / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    shutil.copy(RUN / "episodes.jsonl", tmp_path / "episodes.jsonl")
    with pytest.raises(ConfigError, match="at least 3"):
        planner().measure(tmp_path)


def test_every_layout_is_calibrated_from_another_layout_s_run():
    bench = planner()
    for name in bench.LAYOUTS:
        assert bench.calibration_source(name) in bench.LAYOUTS
        assert bench.calibration_source(name) != name


def test_the_paper_projection_prints_layouts_train_accepts(tmp_path):
    planner()  # benchmarks/ on sys.path
    projection = importlib.import_module("planner_projection")
    result = projection.project(steps=20, seed=0, out=tmp_path / "projection.json")
    assert result["experiment"]["sigma"] == 0.5 and result["experiment"]["median_s"] == 3600.0
    assert [r["budget_gpus"] for r in result["rows"]] == list(projection.BUDGETS)
    bound = load_run_config(projection.CONFIG, projection.PROJECTION_OVERRIDES).pipeline.max_staleness
    for row in result["rows"]:
        cfg = load_run_config(projection.CONFIG, [*projection.PROJECTION_OVERRIDES, *row["overrides"]])
        # the learner's GPUs and the two servers of TP 2, within the budget
        assert row["gpus_used"] == cfg.ray.learner_gpus + 4 <= row["budget_gpus"]
        assert row["wall_hours"] == pytest.approx(1000.0 / row["gpus_used"])
        assert row["steps_in_budget"] == pytest.approx(row["steps_per_hour"] * row["wall_hours"])
        assert row["staleness_p99"] <= bound and cfg.pipeline.max_staleness <= bound == 4

"""``benchmarks/planner.py``'s comparison on the fixture run: what it measures, predicts and the errors."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

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


def test_every_layout_is_calibrated_from_another_layout_s_run_of_its_workload():
    bench = planner()
    for layouts in bench.WORKLOADS.values():
        assert {layouts[n].calibrated_from for n in layouts} <= set(layouts)
        assert all(layout.calibrated_from != name for name, layout in layouts.items())
        # a Ray layout is predicted from a Ray run, an in-process one from an in-process run
        assert all(
            (layouts[lay.calibrated_from].ray is None) == (lay.ray is None) for lay in layouts.values()
        )


def bench_args(**changes) -> argparse.Namespace:
    """The script's defaults (``main``'s options), with ``changes``."""
    values = dict(steps=30, latency_p50=0.2, max_staleness=4, seed=0, sim_steps=300, threads=1, out=None)
    return argparse.Namespace(**{**values, **changes})


def test_every_layout_of_every_workload_is_a_valid_run_config():
    from labrl.harness.backends.parts import make_env_factory
    from labrl.harness.config import build_run_config

    bench = planner()
    bench.register_latency_env()
    for workload, layouts in bench.WORKLOADS.items():
        for name, layout in layouts.items():
            cfg = build_run_config(bench.layout_config(workload, name, bench_args()))
            assert cfg.pipeline.eval_every == 0 and cfg.pipeline.episode_traces
            assert cfg.pipeline.total_steps == 30
            assert cfg.pipeline.max_concurrent_episodes == layout.pipeline["max_concurrent_episodes"]
            assert cfg.backend == ("inprocess" if layout.ray is None else "ray")
            env = make_env_factory(cfg)()  # a Ray layout's env workers make the env by its id
            expected = {
                "lognormal": "xrd/phase-id-v0",
                "quickstart": "xrd/phase-id-v0",
                "lab": "lab/synthesis-v0",
            }
            assert env.spec.id == (bench.LATENCY_ENV_ID if layout.ray else expected[workload])
            if layout.ray is not None:
                assert cfg.ray.env_workers == layout.ray["env_workers"]
                assert cfg.env.options["latency_p50"] == 0.2


def test_only_the_default_workload_keeps_the_unprefixed_result_files():
    bench = planner()
    assert bench.part_name("lognormal", "reference") == "reference"
    assert bench.part_name("lab", "reference") == "lab_reference"
    assert bench.default_out("lognormal").name == "planner.json"
    assert bench.default_out("quickstart").name == "planner_quickstart.json"


def test_the_benchmark_predicts_ray_layouts_with_the_planners_ray_model(monkeypatch):
    """``predict`` goes through ``plan.ray_model`` (one place for the rule; its numbers: test_calibrate_and_plan)."""
    from labrl.harness.planning import plan as plan_module

    bench = planner()
    assert bench.ray_model is plan_module.ray_model


def layout_part(bench, tmp_path, monkeypatch, workload: str, name: str) -> dict:
    """Layout ``name`` of ``workload`` trained 2 steps through ``run_layout``, its parts under ``tmp_path``.
    The warm starts are cut: none in-process (the untrained model), 2 SFT steps in a Ray learner actor;
    so every group is trained (no dynamic sampling, whitened advantages), as no answer is right yet."""

    async def no_warm_start(*_):
        return {}

    layout_config = bench.layout_config

    def untrained(*a):
        data = layout_config(*a)
        data["pipeline"].update(dynamic_sampling=False, retry_all_wrong=0)
        return {
            **data,
            "sft": {**data["sft"], "steps": 2},
            "objective": {**data["objective"], "advantages": "whiten"},
        }

    monkeypatch.setattr(bench, "PARTS", tmp_path)
    monkeypatch.setattr(bench, "warm_start", no_warm_start)
    monkeypatch.setattr(bench, "warm_start_from", no_warm_start)
    monkeypatch.setattr(bench, "layout_config", untrained)
    asyncio.run(bench.run_layout(workload, name, bench_args(steps=2, latency_p50=0.01)))
    stem = bench.part_name(workload, name)
    part = json.loads((tmp_path / f"{stem}.json").read_text())
    assert (part["workload"], part["layout"], part["steps"]) == (workload, name, 2)
    assert len(part["load_start"]) == 3 and len(part["load_end"]) == 3 and part["wall_s"] > 0
    steps = [r["step"] for r in bench.step_records(tmp_path / stem)]
    assert steps == [1, 2]
    traces = [json.loads(line) for line in (tmp_path / stem / "episodes.jsonl").read_text().splitlines()]
    p = part["config"]["pipeline"]
    assert sum(t["fate"] == "trained" for t in traces) == 2 * p["batch_groups"] * p["group_size"]
    return part


@pytest.mark.parametrize("workload", ["lognormal", "quickstart", "lab"])
def test_a_two_step_run_of_each_workload(tmp_path, monkeypatch, workload):
    bench = planner()
    bench.register_latency_env()
    part = layout_part(bench, tmp_path, monkeypatch, workload, "reference")
    expected = {"lognormal": "xrd/phase-id-v0", "quickstart": "xrd/phase-id-v0", "lab": "lab/synthesis-v0"}
    assert part["config"]["env"]["id"] == expected[workload]
    stem = "lab_warm_start" if workload == "lab" else "warm_start"
    assert (tmp_path / f"{stem}_seed0.pt").exists()  # kept for the workload's next layout


@pytest.mark.slow
def test_a_two_step_run_under_ray(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray of another test is up; the script starts its own")
    bench = planner()
    bench.register_latency_env()
    part = layout_part(bench, tmp_path, monkeypatch, "lognormal", "ray_s1_c32_w4")
    assert part["config"]["backend"] == "ray" and part["config"]["env"]["id"] == bench.LATENCY_ENV_ID


def write_part(bench, workload: str, name: str, config: dict) -> None:
    stem = bench.part_name(workload, name)
    part = {"workload": workload, "layout": name, "config": config, "wall_s": 35.0,
            "load_start": [1.0, 1.0, 1.0], "load_end": [2.0, 2.0, 2.0], "steps": 7}  # fmt: skip
    (bench.PARTS / f"{stem}.json").write_text(json.dumps(part))


def test_merge_compares_the_runs_here_and_keeps_the_rows_of_runs_elsewhere(tmp_path, monkeypatch):
    bench = planner()
    monkeypatch.setattr(bench, "PARTS", tmp_path)
    config = yaml.safe_load(CONFIG.read_text())
    # quickstart: both layouts' runs here (each the fixture run), so each is compared
    for name in bench.WORKLOADS["quickstart"]:
        write_part(bench, "quickstart", name, config)
        shutil.copytree(RUN, tmp_path / bench.part_name("quickstart", name))
    out = tmp_path / "quickstart.json"
    bench.merge("quickstart", bench_args(out=str(out), sim_steps=100))
    merged = json.loads(out.read_text())
    assert [r["layout"] for r in merged["layouts"]] == list(bench.WORKLOADS["quickstart"]) and not merged[
        "missing"
    ]
    row = merged["layouts"][0]
    assert row["measured"] == bench.measure(RUN) and row["load_start"] == [1.0, 1.0, 1.0]
    # lognormal: a part whose run directory is not here keeps the previous merge's row (the committed
    # results/planner.json here); the layouts without a part are missing
    committed = json.loads((BENCHMARKS / "results" / "planner.json").read_text())
    by_name = {r["layout"]: r for r in committed["layouts"]}
    write_part(bench, "lognormal", "reference", config)
    write_part(bench, "lognormal", "s1_c64", config)
    out = tmp_path / "lognormal.json"
    out.write_text(json.dumps(committed))
    bench.merge("lognormal", bench_args(out=str(out)))
    merged = json.loads(out.read_text())
    assert merged["layouts"] == [
        {**by_name[n], "kept_from_previous_merge": True} for n in ("reference", "s1_c64")
    ]
    assert set(merged["missing"]) == set(bench.WORKLOADS["lognormal"]) - {"reference", "s1_c64"}

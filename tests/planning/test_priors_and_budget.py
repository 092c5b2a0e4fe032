"""``labrl plan`` without a run (recorded figures, the env's budgets), the driver's ceiling, ``--budget``
search on hand-solved cases, its overrides through the real config loader, and ``--plot``."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest

from labrl.cli import main
from labrl.envs.types import Budgets
from labrl.errors import ConfigError
from labrl.harness.config import load_run_config
from labrl.harness.models.config import MoEModelConfig
from labrl.harness.planning.budget import Budget, parse_budget, search
from labrl.harness.planning.draws import Constant, LogNormal
from labrl.harness.planning.figures import DEFAULTS, RESULTS_DIR, Figure, load_figures
from labrl.harness.planning.model import Layout, Workload, steady_state
from labrl.harness.planning.plan import rate_bucket
from labrl.harness.planning.priors import Hardware, prior_episode, prior_machines
from labrl.harness.planning.simulate import EpisodeModel, simulate

CONFIG = Path(__file__).parent / "fixtures" / "plan.yaml"
# the newest benchmarks/results/gpu_*/ with learner rows, and with sampler rows (load_figures reads, per
# figure, the newest that measured it; the H200 run measured the learner only)
NEWEST_GPU = "gpu_h200_2026-11-27"
NEWEST_GPU_SAMPLER = "gpu_h100_2026-11-27"


# -- figures ---------------------------------------------------------------------------------


def test_the_recorded_benchmark_figures_are_read_from_their_results():
    figures = load_figures()
    gpu = json.loads((RESULTS_DIR / NEWEST_GPU / "gpu_learner.json").read_text())["gpu"]
    assert not gpu["sampler"]  # so the sampler figure comes from the run before
    big = gpu["shapes"]["moe-64x-top8-h2048"]
    # the TorchGroupedMLP row, the faster of labrl's two (the experts auto picks in bf16 on CUDA)
    grouped = next(r for r in big["rows"] if r["path"] == "labrl MegatronLearner.train_step, TorchGroupedMLP")
    learner = figures["learner_tokens_per_s_gpu"]
    assert (learner.value, learner.active_params, learner.recorded) == (
        grouped["tokens_per_s"],
        big["active_matmul_params"],
        True,
    )
    assert learner.value == pytest.approx(79_506, abs=1)
    assert learner.source.startswith(f"{NEWEST_GPU}/gpu_learner.json: labrl")
    before = json.loads((RESULTS_DIR / NEWEST_GPU_SAMPLER / "gpu_learner.json").read_text())["gpu"]
    megatron_engine = next(
        r for r in before["sampler"] if (r["model"], r["batch"], r["engine"]) == ("tiny-moe", 64, "megatron")
    )
    sampler = figures["local_sampler_tokens_per_s_gpu"]
    assert sampler.value == megatron_engine["tokens_per_s"]
    assert sampler.source.startswith(f"{NEWEST_GPU_SAMPLER}/gpu_learner.json: ")
    scaling = json.loads((RESULTS_DIR / "ray_scaling.json").read_text())["scaling"]
    assert figures["driver_s_per_episode"].value == pytest.approx(
        scaling[-1]["driver_cpu_ms_per_episode"] / 1000
    )
    assert figures["driver_s_per_episode"].value == pytest.approx(0.0021, abs=1e-4)  # the 2.1 ms
    cpu = json.loads((RESULTS_DIR / "learner_throughput.json").read_text())
    assert figures["learner_tokens_per_s_cpu"].value == cpu["learner_tokens_per_s"]
    assert not figures["sglang_tokens_per_s_gpu"].recorded  # nothing measures SGLang here: the table's


def _gpu_result(root, folder: str, learner: float | None, sampler: float | None) -> None:
    tiny = {"active_matmul_params": 100, "rows": []}
    if learner is not None:
        tiny["rows"].append({"path": "labrl MegatronLearner.train_step, X", "tokens_per_s": learner})
    runs = [] if sampler is None else [{"model": "tiny-moe", "batch": 64, "engine": "megatron",
                                          "path": "local sampler", "tokens_per_s": sampler}]  # fmt: skip
    (root / folder).mkdir()
    (root / folder / "gpu_learner.json").write_text(
        json.dumps({"gpu": {"device": "G", "shapes": {"tiny-moe": tiny}, "sampler": runs}})
    )


def test_each_gpu_figure_comes_from_the_newest_run_that_measured_it(tmp_path):
    _gpu_result(tmp_path, "gpu_b_2026-01-02", learner=1.0, sampler=10.0)
    _gpu_result(tmp_path, "gpu_a_2026-01-03", learner=None, sampler=20.0)  # newer by date, not by name
    _gpu_result(tmp_path, "gpu_z_2026-01-01", learner=3.0, sampler=30.0)  # older, though last by name
    _gpu_result(tmp_path, "gpu_c_2026-01-03", learner=2.0, sampler=None)  # same day: name decides
    figures = load_figures(tmp_path)
    assert figures["learner_tokens_per_s_gpu"].value == 2.0
    assert figures["learner_tokens_per_s_gpu"].source.startswith("gpu_c_2026-01-03/")
    assert figures["local_sampler_tokens_per_s_gpu"].value == 20.0
    assert figures["local_sampler_tokens_per_s_gpu"].source.startswith("gpu_a_2026-01-03/")


def test_a_results_dir_without_a_file_falls_back_to_the_defaults_table(tmp_path):
    (tmp_path / "ray_scaling.json").write_text(
        json.dumps(
            {
                "scaling": [
                    {"workers": 1, "driver_cpu_ms_per_episode": 6.0},
                    {"workers": 8, "driver_cpu_ms_per_episode": 4.0},
                ]
            }
        )
    )
    figures = load_figures(tmp_path)
    assert figures["driver_s_per_episode"].value == pytest.approx(0.004)  # the most workers' row
    assert (
        figures["driver_s_per_episode"].recorded
        and "ray_scaling.json" in figures["driver_s_per_episode"].source
    )
    assert figures["learner_tokens_per_s_gpu"] == DEFAULTS["learner_tokens_per_s_gpu"]
    (tmp_path / "learner_throughput.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"learner_throughput\.json"):
        load_figures(tmp_path)


def test_a_figure_moves_to_a_model_as_compute_bound_work():
    assert Figure(1000.0, "tokens/s", "x", active_params=100).for_model(400) == 250.0
    assert Figure(1000.0, "tokens/s", "x").for_model(400) == 1000.0  # not shape-bound


@pytest.mark.parametrize(
    ("median", "sigma", "cap"), [(1.0, 1.288, 5.0), (2.0, 0.5, 2.5), (1.0, 0.8, math.inf)]
)
def test_a_capped_lognormal_has_the_mean_of_its_draws(median, sigma, cap):
    draw, rng = LogNormal(median, sigma, cap=cap), random.Random(1)
    values = [draw.sample(rng) for _ in range(200_000)]
    assert max(values) <= cap
    assert sum(values) / len(values) == pytest.approx(draw.mean, rel=0.01)
    assert LogNormal(3.0, 0.0, cap=2.0).mean == 2.0


# -- the episode and the machines without a run ----------------------------------------------


def test_the_prior_episode_is_the_config_and_the_env_budgets():
    cfg = load_run_config(CONFIG, ["sampler.max_new_tokens=24"])
    budgets = Budgets(max_turns=3, step_timeout_s=50.0)
    ep = prior_episode(cfg, budgets, DEFAULTS)
    assert (ep.turns.mean, ep.tokens_per_turn.mean, ep.keep_rate) == (3, 24, 1.0)
    assert ep.env_s == LogNormal(1.0, 1.288, cap=50.0)
    assert ep.env_s_per_episode == pytest.approx(3 * ep.env_s.mean)  # the reset costs nothing
    given = prior_episode(cfg, budgets, DEFAULTS, env_step_s=3600.0, env_sigma=0.5)
    assert given.env_s == LogNormal(3600.0, 0.5, cap=50.0)
    with pytest.raises(ConfigError, match="median"):
        prior_episode(cfg, budgets, DEFAULTS, env_step_s=0.0)


def hand_figures(*, learner_step_s: float, ctx: int, batch: int) -> dict[str, Figure]:
    """Figures not bound to a shape: one learner GPU takes ``learner_step_s`` for a batch; a GPU sampler
    800 tokens/s, a CPU one 20; no driver cost."""
    return DEFAULTS | {
        "learner_tokens_per_s_gpu": Figure(batch * ctx / learner_step_s, "tokens/s", "hand"),
        "learner_tokens_per_s_cpu": Figure(batch * ctx / (10 * learner_step_s), "tokens/s", "hand"),
        "local_sampler_tokens_per_s_gpu": Figure(800.0, "tokens/s", "hand"),
        "local_sampler_tokens_per_s_cpu": Figure(20.0, "tokens/s", "hand"),
        "driver_s_per_episode": Figure(0.0, "s", "hand"),
    }


def test_prior_machines_by_hand():
    cfg = load_run_config(CONFIG)
    ctx = cfg.model.resolve().max_sequence_length
    figures = hand_figures(learner_step_s=2.0, ctx=ctx, batch=4)
    two = prior_machines(cfg, figures, Hardware(learner_gpus=2, samplers=3, gpus_per_sampler=1))
    assert two.learner_step_s == pytest.approx(1.0)  # 4 episodes x ctx tokens over 2 GPUs
    assert (two.sampler_tokens_per_s, two.kv_slots) == (2400.0, 24)  # 3 samplers of 800 tokens/s, 8 slots
    cpu = prior_machines(cfg, figures, Hardware(learner_gpus=0, samplers=1, gpus_per_sampler=0))
    assert (cpu.learner_step_s, cpu.sampler_tokens_per_s) == (pytest.approx(20.0), 20.0)
    real = prior_machines(cfg, DEFAULTS, Hardware(1, 1, 1))
    params = cfg.model.resolve().active_matmul_parameter_count
    expected = (
        DEFAULTS["learner_tokens_per_s_gpu"].value
        * DEFAULTS["learner_tokens_per_s_gpu"].active_params
        / params
    )
    assert real.learner_step_s == pytest.approx(4 * ctx / expected)


# -- the driver ------------------------------------------------------------------------------


def test_the_driver_binds_at_one_episode_per_its_cpu_seconds():
    lay = Layout(
        sampler_tokens_per_s=1000.0, kv_slots=10, env_slots=1000, learner_step_s=0.01, batch_groups=1,
        group_size=4, max_staleness=8, max_concurrent_episodes=256, driver_s_per_episode=0.05,
    )  # fmt: skip
    closed = steady_state(Workload(turns=1, tokens_per_turn=10, env_s_per_episode=0.2), lay)
    assert (closed.binding, closed.episodes_per_s, closed.steps_per_s) == ("driver", 20.0, 5.0)
    sim = simulate(EpisodeModel(Constant(1), Constant(10), Constant(0.1)), lay, seconds=200.0)
    assert sim.steps_per_s == pytest.approx(5.0, rel=0.01)
    assert sim.utilisation["driver"] == pytest.approx(1.0, abs=0.01)
    assert sim.utilisation["learner"] == pytest.approx(5.0 * 0.01, rel=0.05)  # busy = steps/s x D


# -- --budget --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["gpus=2", "gpus=x,cpus=4", "gpus=2,cpus=4,tpus=1", "gpus=-1,cpus=4",
                                  "gpus=2;cpus=4", "gpus=2,gpus=3,cpus=4", "", "gpus=2,cpus=0"])  # fmt: skip
def test_a_bad_budget_is_a_config_error(text):
    with pytest.raises(ConfigError, match="--budget"):
        parse_budget(text)


def test_a_budget_parses_in_any_order():
    assert parse_budget("cpus=16, gpus=2") == Budget(gpus=2, cpus=16)


def test_rates_within_two_percent_tie():
    assert rate_bucket(1.0) == rate_bucket(1.015) != rate_bucket(1.03)


EPISODE = EpisodeModel(Constant(1), Constant(20), Constant(0.1), reset_s=Constant(0.0))


@pytest.mark.parametrize(
    ("gpus", "learner_step_s", "best", "steps_per_s", "binding"),
    [
        # the sampler binds: one GPU sampler (800 tokens/s of 20-token episodes: 40 episodes/s, 10 steps/s)
        # beats both GPUs on the learner and four CPU samplers (80 tokens/s: 1 step/s); episodes of 0.3 s,
        # 32 at once, would allow 107 episodes/s
        (2, 0.01, (1, 1, 1), 10.0, "sampler"),
        # the learner binds (1 s/step on one GPU): two learner GPUs and one sampler GPU (2 steps/s, the
        # sampler allows 10) beat one learner GPU and two samplers (1 step/s) and three learner GPUs
        # with four CPU samplers (1 step/s)
        (3, 1.0, (2, 1, 1), 2.0, "learner"),
    ],
)
def test_the_budget_search_finds_the_layout_solved_by_hand(gpus, learner_step_s, best, steps_per_s, binding):
    cfg = load_run_config(CONFIG, ["pipeline.max_staleness=8"])
    figures = hand_figures(
        learner_step_s=learner_step_s, ctx=cfg.model.resolve().max_sequence_length, batch=4
    )
    rows = search(cfg, Budget(gpus=gpus, cpus=8), EPISODE, Budgets(), figures, simulate=40, steps=200)
    top = rows[0]
    o = top.overrides
    assert (o["ray.learner_gpus"], o["ray.samplers"], o["ray.gpus_per_sampler"]) == best
    assert top.closed.binding == binding and not top.over_bound
    assert top.simulated.steps_per_s == pytest.approx(steps_per_s, rel=0.03)
    assert all(r.simulated.steps_per_s <= top.simulated.steps_per_s * 1.02 for r in rows if not r.over_bound)
    for r in rows:  # every printed layout is one labrl train accepts, with the values it says
        parsed = load_run_config(CONFIG, r.override_args)
        assert parsed.backend == "ray"
        assert (parsed.ray.learner_gpus, parsed.ray.samplers, parsed.ray.env_workers) == (
            r.overrides["ray.learner_gpus"], r.overrides["ray.samplers"], r.overrides["ray.env_workers"],
        )  # fmt: skip
        assert parsed.pipeline.max_staleness == r.layout.max_staleness <= 8
        assert parsed.pipeline.max_concurrent_episodes == r.layout.max_concurrent_episodes
        assert r.layout.kv_slots == 8 * parsed.ray.samplers
        gpus_used = parsed.ray.learner_gpus + parsed.ray.samplers * int(parsed.ray.gpus_per_sampler)
        assert gpus_used <= gpus
        assert 2 + parsed.ray.samplers + parsed.ray.env_workers <= 8  # driver, learner, samplers, workers


def test_an_env_pool_makes_env_workers_a_knob():
    # one env call per worker process at once (pool 1) of 1 s: 4 workers run 4 episodes/s (1 step/s)
    cfg = load_run_config(CONFIG, ["pipeline.max_staleness=8"])
    figures = hand_figures(learner_step_s=0.01, ctx=cfg.model.resolve().max_sequence_length, batch=4)
    slow = EpisodeModel(Constant(1), Constant(20), Constant(1.0), reset_s=Constant(0.0))
    rows = search(
        cfg, Budget(gpus=2, cpus=7), slow, Budgets(pools={"lab": 1}), figures, simulate=40, steps=100
    )
    top = rows[0]
    assert top.overrides["ray.env_workers"] == 4  # 7 CPUs: driver, learner, one sampler, four workers
    assert top.layout.env_slots == 4 and top.closed.binding == "env_workers"
    # the ceiling, less the slots' idle moments while a group's episodes generate
    assert 0.95 <= top.simulated.steps_per_s <= 1.0 + 1e-9


def test_too_few_cpus_is_a_config_error():
    with pytest.raises(ConfigError, match="at least 4 CPUs"):
        search(load_run_config(CONFIG), Budget(gpus=1, cpus=3), EPISODE, Budgets(), DEFAULTS)


SGLANG = [
    "sampler.kind=sglang",
    "sampler.sglang.urls=[http://a:1, http://b:1]",
    "sampler.sglang.launch_tp_size=2",
]


def test_sglang_servers_are_fixed_and_the_learner_gets_what_they_leave():
    # two servers of 2 GPUs each take 4 of 8 GPUs; the learner's GPUs are a multiple of TP x EP = 2
    cfg = load_run_config(CONFIG, [*SGLANG, "parallel.tensor_parallel=2"])
    rows = search(cfg, Budget(gpus=8, cpus=8), EPISODE, Budgets(), DEFAULTS, simulate=8, steps=20)
    assert {r.overrides["ray.learner_gpus"] for r in rows} <= {2, 4}
    for r in rows:
        assert (r.overrides["ray.samplers"], r.overrides["ray.gpus_per_sampler"]) == (2, 0)
        assert r.layout.kv_slots == 2 * 2 * int(DEFAULTS["sglang_slots_per_gpu"].value)
        assert r.layout.sampler_tokens_per_s == 4 * DEFAULTS["sglang_tokens_per_s_gpu"].value
        load_run_config(CONFIG, [*SGLANG, "parallel.tensor_parallel=2", *r.override_args])
    with pytest.raises(ConfigError, match="SGLang server"):
        search(cfg, Budget(gpus=4, cpus=8), EPISODE, Budgets(), DEFAULTS)


# -- the command -----------------------------------------------------------------------------


def test_labrl_plan_without_a_run_says_what_it_assumes_and_where_it_comes_from(capsys, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS_DIR / "learner_throughput.json", results)
    args = [
        "plan",
        str(CONFIG),
        "pipeline.max_staleness=1",
        "--figures",
        str(results),
        "--steps",
        "20",
        "--top",
        "2",
    ]
    assert main([*args, "--env-step-s", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no run to calibrate from: every figure below is assumed")
    assert "1 turns (env budgets.max_turns)" in out and "median 0.5 s" in out
    assert "recorded, learner_throughput.json: train_step" in out  # this machine's device: CPU
    assert "default, benchmarks/README.md, ray_scaling.py: 2.1 ms" in out  # not in the results given
    assert "keep rate: assumed" in out and "env step: assumed" not in out


def test_labrl_plan_budget_prints_overrides_and_writes_the_plot(capsys, tmp_path):
    png = tmp_path / "plan.png"
    args = [
        "plan",
        str(CONFIG),
        "--budget",
        "gpus=2,cpus=6",
        "--steps",
        "20",
        "--top",
        "3",
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [
        line
        for line in out
        if line.lstrip("* ").split(" ")[0].replace(".", "").isdigit() and "backend=ray" in line
    ]
    assert len(rows) == 3
    for line in rows:
        overrides = [w for w in line.split() if "=" in w and not w.startswith("[")]
        load_run_config(CONFIG, overrides)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the search's figures, GPU ones included, are listed with their sources
    assert any(f"recorded, {NEWEST_GPU}/gpu_learner.json: labrl" in line for line in out)
    assert any("recorded, ray_scaling.json: driver CPU" in line for line in out)
    assert main(["plan", str(CONFIG), "--budget", "gpus=two"]) != 0
    assert "--budget 'gpus=two'" in capsys.readouterr().err


def test_env_latency_options_without_a_run_only(capsys):
    run = Path(__file__).parent / "fixtures" / "run"
    assert main(["plan", str(CONFIG), "--from-run", str(run), "--env-step-s", "2"]) != 0
    assert "--from-run measures it" in capsys.readouterr().err


def test_active_matmul_parameters_match_the_recorded_shapes():
    # the shapes of benchmarks/gpu_learner.py, whose results recorded their counts
    recorded = json.loads((RESULTS_DIR / "gpu_h100_2026-11-26" / "gpu_learner.json").read_text())["gpu"][
        "shapes"
    ]
    quickstart = load_run_config(Path(__file__).parents[2] / "configs" / "quickstart.yaml").model.resolve()
    big = MoEModelConfig(
        name="moe-64x-top8-h2048", num_layers=4, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
        num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=1024, vocab_size=32000, max_sequence_length=4096,
    )  # fmt: skip
    assert quickstart.active_matmul_parameter_count == recorded["tiny-moe"]["active_matmul_params"] == 321_024
    assert big.active_matmul_parameter_count == recorded["moe-64x-top8-h2048"]["active_matmul_params"]


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch, tmp_path):
    import sys

    from labrl.harness.planning.plot import plot_layout

    cfg = load_run_config(CONFIG)
    figures = hand_figures(learner_step_s=0.01, ctx=cfg.model.resolve().max_sequence_length, batch=4)
    row = search(cfg, Budget(gpus=2, cpus=4), EPISODE, Budgets(), figures, simulate=1, steps=20)[0]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(ConfigError, match="pip install matplotlib"):
        plot_layout(row, tmp_path / "p.png", bound=2)

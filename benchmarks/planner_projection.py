"""The paper projection of issue 29: a 1,000-GPU-hour lab workload with hour-long experiments, on paper.

``labrl plan --budget`` (``harness/planning/budget.py``) without a run, on
``configs/gpu/qwen3-30b-a3b-sglang.yaml`` (Qwen3-30B-A3B, two SGLang servers of TP 2, megatron-core
TP 2 x EP 2, 8 groups of 8 per step, ``max_staleness`` 4) moved to the lab env (``PROJECTION_OVERRIDES``):
``lab/synthesis-v0``, one turn, each experiment a lognormal of median 1 h and sigma ``SIGMA`` (p99 /
p50 = exp(2.326 sigma) = 3.2), cut at a 4 h step timeout; the env's own ``pools: {lab: 8}`` (8
experiments at once per env worker process); the context cut to 4,096 tokens (the learner's
figure assumes rows padded to it). For each GPU budget of ``BUDGETS`` (64 CPUs) it prints the
layout the planner ranks first, what binds, the staleness, the idle fractions, and what 1,000
GPU-hours buy: ``wall hours = 1000 / GPUs used``, ``steps = steps/h x wall hours``.

    .venv/bin/python benchmarks/planner.py --project     # ~1 min; results/planner_projection.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from labrl.harness.backends.parts import make_env_factory
from labrl.harness.config import load_run_config
from labrl.harness.planning.budget import Budget, search
from labrl.harness.planning.figures import load_figures
from labrl.harness.planning.priors import prior_episode, sglang_servers

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "gpu" / "qwen3-30b-a3b-sglang.yaml"
MEDIAN_S = 3600.0
SIGMA = 0.5
GPU_HOURS = 1000.0
BUDGETS = (8, 16, 32)
CPUS = 64
PROJECTION_OVERRIDES = [
    "backend=ray",
    "env.id=lab/synthesis-v0",
    "env.options={}",
    "env.budgets={step_timeout_s: 14400}",
    "model.init_from_hf=null",
    "model.overrides={max_sequence_length: 4096}",
    "sampler.sglang.launch_tp_size=2",
]


def project(*, steps: int, seed: int, out: Path) -> dict[str, Any]:
    cfg = load_run_config(CONFIG, PROJECTION_OVERRIDES)
    budgets = make_env_factory(cfg)().spec.budgets
    figures = load_figures()
    episode = prior_episode(cfg, budgets, figures, env_step_s=MEDIAN_S, env_sigma=SIGMA)
    servers, tp = sglang_servers(cfg)
    rows = []
    for gpus in BUDGETS:
        best = search(cfg, Budget(gpus=gpus, cpus=CPUS), episode, budgets, figures, steps=steps, seed=seed)[0]
        sim, lay = best.simulated, best.layout
        used = best.overrides["ray.learner_gpus"] + servers * tp  # the learner's and the SGLang servers'
        hours = GPU_HOURS / used
        rows.append(
            {
                "budget_gpus": gpus,
                "overrides": best.override_args,
                "gpus_used": used,
                "learner_step_s": lay.learner_step_s,
                "env_slots": lay.env_slots,
                "steps_per_hour": sim.steps_per_s * 3600,
                "steps_per_hour_model": best.closed.steps_per_s * 3600,
                "binding": best.closed.binding,
                "staleness_p50": sim.staleness_p50,
                "staleness_p99": sim.staleness_p99,
                "idle": {k: 1.0 - v for k, v in sim.utilisation.items()},
                "wall_hours": hours,
                "steps_in_budget": sim.steps_per_s * 3600 * hours,
            }
        )
    result = {
        "config": str(CONFIG.relative_to(ROOT)),
        "overrides": PROJECTION_OVERRIDES,
        "experiment": {
            "median_s": MEDIAN_S,
            "sigma": SIGMA,
            "cap_s": budgets.step_timeout_s,
            "pools": budgets.pools,
        },
        "gpu_hours": GPU_HOURS,
        "cpus": CPUS,
        "sim_steps": steps,
        "figures": {
            k: {"value": f.value, "source": f.source, "recorded": f.recorded} for k, f in figures.items()
        },
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        "| GPUs (budget / used) | layout | learner s/step | env slots | steps/h (model) | binds | staleness p50 / p99 "
        "| idle: learner, sampler, env | wall h, steps in 1,000 GPU-h |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        layout = " ".join(o for o in r["overrides"] if not o.startswith(("backend", "ray.gpus_per_sampler")))
        idle = r["idle"]
        lines.append(
            f"| {r['budget_gpus']} / {r['gpus_used']} | `{layout}` | {r['learner_step_s']:.0f} | {r['env_slots']} "
            f"| {r['steps_per_hour']:.2f} ({r['steps_per_hour_model']:.2f}) | {r['binding']} "
            f"| {r['staleness_p50']:g} / {r['staleness_p99']:g} "
            f"| {idle['learner']:.2f}, {idle['sampler']:.2f}, {idle['env']:.2f} "
            f"| {r['wall_hours']:.0f}, {r['steps_in_budget']:.0f} |"
        )
    return "\n".join(lines)

"""The planner against real runs: predicted and measured steps/s, learner idle fraction, staleness p99.

Workloads (``--workload``, ``WORKLOADS``), each with evaluation off and episode traces on:

- ``lognormal`` (the default): ``benchmarks/pipeline.py``'s (the quickstart's tiny MoE, its format-only
  warm start, an extra lognormal env latency of median ``--latency-p50`` s and p99/p50 = 20 per training
  episode); six in-process layouts and two ``backend=ray`` ones;
- ``quickstart``: configs/quickstart.yaml's env and model as they are (the XRD env's own latency);
- ``lab``: configs/families/lab.yaml, ``lab/synthesis-v0`` against the mock lab in process (the env's
  offline default: the real REST client and journal over an in-memory transport, its own key).

Each *layout* (the workload's pipeline section with other ``mode``, ``max_staleness``,
``max_concurrent_episodes``; ``ray.*`` keys for a Ray one) trains ``--steps`` steps for real,
in-process from the workload's cached warm start, under Ray through ``labrl train``'s runner on a
local Ray (its learner actor runs the config's warm start itself). The planner (``harness/planning``)
is calibrated from a *different* run of the same workload (``BenchLayout.calibrated_from``: a Ray
layout from the other Ray run) and predicts the layout as ``labrl plan`` does: ``kv_slots``,
``calibrate_sampler`` (the batched decoder fitted on the calibrating run's generations, or the fixed
rate where it falls back), ``layout_of``, the closed form and ``--sim-steps`` simulated steps; a Ray
layout also with the planner's Ray model (``plan.ray_model``: the driver's CPU seconds per episode,
env slots capped at ``ray.env_workers x`` the env's pool), as ``labrl plan --from-run`` has it. ``compare`` sets the prediction beside what the run measured,
between its first and its last tenth of steps (the simulator's warm-up; the run's drain, which a
simulated run without an end does not have: ``DRAIN_FRACTION``); ``--merge`` adds the prediction calibrated
from the run itself, which separates the model's error from the calibration's failure to carry over
between runs:

    steps/s        = (last step - first step) / (time_s there - time_s here)   over the window
    learner idle   = 1 - (busy_s(last) - busy_s(first)) / (time_s(last) - time_s(first)),
                     busy_s = busy/learner_step x time_s (cumulative from the run's start; the
                     learner's whole step, as the simulator's learner is busy; busy/learner, train_step
                     alone, for runs recorded before busy/learner_step existed)
    staleness p99  = p99 of version_at_train - token_versions[0] over the window's trained episodes
    errors         : steps/s relative, predicted / measured - 1 (goal |.| <= 0.15);
                     staleness p99 and learner idle absolute, predicted - measured (goal |p99| <= 1)

It runs in parts, each a few minutes on 2 shared cores, each writing JSON under
benchmarks/results/planner/ (a session's background jobs die at its end):

    .venv/bin/python benchmarks/planner.py --run reference     # then s1_c64, s2_c32, sync, ...
    .venv/bin/python benchmarks/planner.py --merge             # the table; results/planner.json
    .venv/bin/python benchmarks/planner.py --workload lab --run reference   # then s1_c8; --merge
    .venv/bin/python benchmarks/planner.py --project           # the paper projection (planner_projection.py)

``--run NAME`` trains layout NAME into benchmarks/results/planner/STEM/ (its ``metrics.jsonl``
and ``episodes.jsonl`` only; STEM is NAME for ``lognormal``, WORKLOAD_NAME for the others) and
writes STEM.json there: the run config, wall seconds and ``os.getloadavg()`` at its start and end.
The warm start is computed once per seed and kept beside them (``warm_start_seed<N>.pt``, shared by
``lognormal`` and ``quickstart``; ``lab_warm_start_seed<N>.pt``; not committed); so are the layouts'
run directories (~1.5 MB each: the repository keeps STEM.json and the merged results/planner.json,
``planner_WORKLOAD.json``). ``--merge`` compares every layout of the workload run so far (it reads the
run directories), keeps the previous merge's row of a layout whose run directory is not here, and
lists those missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from _torch_threads import parse_with_threads  # beside this script
from pipeline import (  # the pipeline benchmark's workload, beside this script
    LATENCY_ENV_ID,
    config,
    train,
    warm_start,
    warm_start_from,
)

from labrl.errors import ConfigError
from labrl.harness.backends.parts import make_env_factory
from labrl.harness.config import RunConfig, build_run_config
from labrl.harness.metrics import percentile, read_jsonl
from labrl.harness.pipeline.traces import EPISODES_FILE, read_episode_traces
from labrl.harness.planning.budget import env_pool_of
from labrl.harness.planning.calibrate import calibrate_run
from labrl.harness.planning.figures import load_figures
from labrl.harness.planning.model import steady_state, sync_steps_per_s
from labrl.harness.planning.plan import calibrate_sampler, layout_of, ray_model
from labrl.harness.planning.simulate import simulate

RESULTS = Path(__file__).parent / "results"
PARTS = RESULTS / "planner"
METRICS_FILE = "metrics.jsonl"
WARMUP_FRACTION = 0.1  # as simulate's warm-up tenth
# The run's last tenth is its drain, which the simulator (a run without an end) does not have: admission
# starts no group whose batch lies past the run's end, so the last batches wait for the stragglers already
# in flight. On the lognormal env (p99/p50 = 20) the final step alone took 8.1 s against a median 1.3 s
# (s1_c64, 2026-11-27), 17 % of the window.
DRAIN_FRACTION = 0.1
THROUGHPUT_GOAL = 0.15  # |predicted / measured - 1|
STALENESS_GOAL = 1.0  # |predicted - measured| of the p99, in steps

QUICKSTART = Path(__file__).parent.parent / "configs" / "quickstart.yaml"
LAB = Path(__file__).parent.parent / "configs" / "families" / "lab.yaml"
# the local Ray's logical CPUs: the largest Ray layout's actors (Ray counts them, the 2 cores run them)
RAY_CPUS = 8
# the warm start of a Ray layout, which its learner actor runs itself: the quickstart's 500 steps took
# 4.5 min at load 13-21 (longer than a part may take); its loss is at its floor by step 200 (0.40, 0.39 at 400)
RAY_SFT_STEPS = 200


@dataclass(frozen=True)
class BenchLayout:
    """One layout a workload trains: the pipeline keys that differ from the workload's config, the layout
    whose run calibrates its prediction (never its own), and ``ray.*`` keys for a ``backend=ray`` run."""

    pipeline: dict[str, Any]
    calibrated_from: str
    ray: dict[str, Any] | None = None


#: workload -> name -> layout, in the order to run them. lognormal: the quickstart's pipeline section
#: (mode pipeline, max_staleness 4, max_concurrent_episodes 128, 8 groups of 8) on the lognormal env;
#: quickstart: the same on the quickstart's own env; lab: configs/families/lab.yaml (2 groups of 4,
#: max_staleness 4, 16 episodes at once) against the in-process mock lab
WORKLOADS: dict[str, dict[str, BenchLayout]] = {
    "lognormal": {
        "reference": BenchLayout({"mode": "pipeline", "max_staleness": 4, "max_concurrent_episodes": 128}, "s1_c64"),
        "s1_c64": BenchLayout({"mode": "pipeline", "max_staleness": 1, "max_concurrent_episodes": 64}, "reference"),
        "s2_c32": BenchLayout({"mode": "pipeline", "max_staleness": 2, "max_concurrent_episodes": 32}, "reference"),
        "sync": BenchLayout({"mode": "sync", "max_concurrent_episodes": 64}, "reference"),
        "s8_c256": BenchLayout({"mode": "pipeline", "max_staleness": 8, "max_concurrent_episodes": 256}, "reference"),
        "one_step_off": BenchLayout({"mode": "one_step_off", "max_concurrent_episodes": 64}, "reference"),
        # backend=ray, each predicted from the other's Ray run: the learner binds with 128 episodes at
        # once on one env worker; admission (s1) binds 32 episodes spread over 4
        "ray_s4_c128_w1": BenchLayout(
            {"mode": "pipeline", "max_staleness": 4, "max_concurrent_episodes": 128}, "ray_s1_c32_w4",
            ray={"env_workers": 1},
        ),
        "ray_s1_c32_w4": BenchLayout(
            {"mode": "pipeline", "max_staleness": 1, "max_concurrent_episodes": 32}, "ray_s4_c128_w1",
            ray={"env_workers": 4},
        ),
    },
    "quickstart": {
        "reference": BenchLayout({"mode": "pipeline", "max_staleness": 4, "max_concurrent_episodes": 128}, "s1_c32"),
        "s1_c32": BenchLayout({"mode": "pipeline", "max_staleness": 1, "max_concurrent_episodes": 32}, "reference"),
    },
    "lab": {
        "reference": BenchLayout({"mode": "pipeline", "max_staleness": 4, "max_concurrent_episodes": 16}, "s1_c8"),
        "s1_c8": BenchLayout({"mode": "pipeline", "max_staleness": 1, "max_concurrent_episodes": 8}, "reference"),
    },
}  # fmt: skip
DEFAULT_WORKLOAD = "lognormal"


def part_name(workload: str, name: str) -> str:
    """The file stem of a layout's part under ``PARTS``: the layout's name for the default workload (its
    files predate the others), else ``WORKLOAD_NAME``."""
    return name if workload == DEFAULT_WORKLOAD else f"{workload}_{name}"


def default_out(workload: str) -> Path:
    """The merged table's JSON: ``results/planner.json`` for the default workload, ``planner_WORKLOAD.json`` else."""
    return RESULTS / ("planner.json" if workload == DEFAULT_WORKLOAD else f"planner_{workload}.json")


# -- measured -------------------------------------------------------------------------


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s learner-step records, in step order."""
    return sorted(
        (r for r in read_jsonl(run_dir / METRICS_FILE) if "busy/learner" in r), key=lambda r: r["step"]
    )


def measure(run_dir: Path) -> dict[str, Any]:
    """Steps/s, learner idle and staleness over the run after its first tenth of steps (module docstring)."""
    records = step_records(run_dir)
    if len(records) < 3:
        raise ConfigError(f"{run_dir / METRICS_FILE} has {len(records)} steps; the window needs at least 3")
    n = len(records)
    skip = min(int(n * WARMUP_FRACTION), n - 2)
    drain = min(int(n * DRAIN_FRACTION), n - 2 - skip)
    first, last = records[skip], records[n - 1 - drain]
    span = last["time_s"] - first["time_s"]
    busy = "busy/learner_step" if "busy/learner_step" in last else "busy/learner"
    busy_s = last[busy] * last["time_s"] - first[busy] * first["time_s"]
    staleness = sorted(
        r["version_at_train"] - r["token_versions"][0]
        for r in read_episode_traces(run_dir)
        if r["fate"] == "trained" and first["step"] < r["step"] <= last["step"]
    )
    return {
        "window_steps": [first["step"], last["step"]],
        "steps_per_s": (last["step"] - first["step"]) / span,
        "learner_idle": 1.0 - busy_s / span,
        "staleness_p50": percentile(staleness, 50),
        "staleness_p99": percentile(staleness, 99),
        "trained_episodes": len(staleness),
    }


# -- predicted ------------------------------------------------------------------------


def predict(cfg: RunConfig, reference_dir: Path, *, sim_steps: int, seed: int = 0) -> dict[str, Any]:
    """``cfg``'s layout as ``labrl plan`` predicts it, calibrated from ``reference_dir``."""
    episodes, machines = calibrate_run(reference_dir)
    p = cfg.pipeline
    sampler = calibrate_sampler(cfg, machines, episodes)
    pool = env_pool_of(make_env_factory(cfg)().spec.budgets) if cfg.backend == "ray" else None
    lay = ray_model(
        cfg,
        layout_of(
            cfg, machines, sampler, staleness=p.effective_max_staleness, concurrency=p.max_concurrent_episodes
        ),
        pool=pool,
        driver_s_per_episode=load_figures()["driver_s_per_episode"].value,
    )
    workload = episodes.workload()
    closed = steady_state(workload, lay)
    model_rate = sync_steps_per_s(workload, lay) if p.mode == "sync" else closed.steps_per_s
    sim = simulate(episodes.episode, lay, seconds=sim_steps / model_rate, mode=p.mode, seed=seed)
    return {
        "steps_per_s": sim.steps_per_s,
        "steps_per_s_model": model_rate,
        "binding_model": closed.binding,
        "learner_idle": sim.learner_idle,
        "staleness_p50": sim.staleness_p50,
        "staleness_p99": sim.staleness_p99,
        "calibration": {
            "learner_step_s": machines.learner_step_s,
            "sampler_tokens_per_s": lay.sampler_tokens_per_s,
            "sampler_tokens_per_s_measured": machines.sampler_tokens_per_s,
            "decode_tokens_per_s": episodes.decode_tokens_per_s,
            "decode_fit": {
                "a_s": sampler.fit.step_s,
                "c_s": sampler.fit.per_sequence_s,
                "fitted": sampler.fit.fitted,
                "reason": sampler.fit.reason,
            },
            "decoding_model": closed.decoding,
            "sequence_tokens_per_s_model": closed.sequence_tokens_per_s,
            "kv_slots": lay.kv_slots,
            "keep_rate": workload.keep_rate,
            "env_s_per_episode": workload.env_s_per_episode,
            "tokens_per_episode": workload.tokens_per_episode,
            "env_slots": lay.env_slots,
            "driver_s_per_episode": lay.driver_s_per_episode,
        },
    }


def errors(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Relative error of steps/s, absolute errors of staleness p99 and learner idle; the goals met."""
    rel = predicted["steps_per_s"] / measured["steps_per_s"] - 1.0
    p99 = predicted["staleness_p99"] - measured["staleness_p99"]
    return {
        "steps_per_s_rel": rel,
        "staleness_p99_abs": p99,
        "learner_idle_abs": predicted["learner_idle"] - measured["learner_idle"],
        "throughput_ok": abs(rel) <= THROUGHPUT_GOAL,
        "staleness_ok": abs(p99) <= STALENESS_GOAL,
    }


def compare(
    cfg: RunConfig, run_dir: Path, reference_dir: Path, *, sim_steps: int, seed: int = 0
) -> dict[str, Any]:
    """The run in ``run_dir`` (of config ``cfg``) against its prediction calibrated from ``reference_dir``."""
    measured = measure(run_dir)
    predicted = predict(cfg, reference_dir, sim_steps=sim_steps, seed=seed)
    return {"predicted": predicted, "measured": measured, "errors": errors(predicted, measured)}


# -- the parts ------------------------------------------------------------------------


def layout_config(workload: str, name: str, args) -> dict[str, Any]:
    """The workload's run config with layout ``name``'s keys, evaluation off, traces on. lognormal and
    quickstart: the pipeline benchmark's (``pipeline.config``: the quickstart's); lab: configs/families/lab.yaml.
    A Ray layout of the lognormal workload names its env by id (``LATENCY_ENV_ID``): Ray's env workers make it."""
    layout = WORKLOADS[workload][name]
    if workload == "lab":
        data = yaml.safe_load(LAB.read_text())
        data["pipeline"].update(total_steps=args.steps, progress=False, checkpoint_every=0)
        data["seed"] = args.seed
    else:
        data = config(layout.pipeline["mode"], args)
    data["pipeline"].update(layout.pipeline, eval_every=0, episode_traces=True)
    if layout.ray is not None:
        data["backend"], data["ray"] = "ray", dict(layout.ray)
        data["sft"] = {**data["sft"], "steps": RAY_SFT_STEPS}
        if workload == "lognormal":
            inner = data["env"]
            options = {"inner_id": inner["id"], "latency_p50": args.latency_p50, **inner.get("options", {})}
            data["env"] = {"id": LATENCY_ENV_ID, "options": options}
    return data


def register_latency_env() -> None:
    """The lognormal env in the registry of this process; Ray's ``worker_process_setup_hook`` in its workers."""
    from labrl.envs import register, registered_ids

    if LATENCY_ENV_ID not in registered_ids():
        register(LATENCY_ENV_ID, entry_point="pipeline:RegisteredLatencyEnv")


async def cached_warm_start(workload: str, args) -> dict:
    """The workload's warm start, computed once per seed (lognormal and quickstart share the quickstart's)."""
    stem = "lab_warm_start" if workload == "lab" else "warm_start"
    path = PARTS / f"{stem}_seed{args.seed}.pt"
    if path.exists():
        return torch.load(path)
    state = await (
        warm_start_from(layout_config("lab", "reference", args)) if workload == "lab" else warm_start(args)
    )
    torch.save(state, path)
    return state


async def train_inprocess(workload: str, data: dict[str, Any], args, run_dir: Path) -> float:
    """``pipeline.train`` from the cached warm start (the lognormal env for that workload, else the config's
    env); its step records written to ``run_dir/metrics.jsonl`` as ``labrl train`` writes them."""
    init_state = await cached_warm_start(workload, args)
    make_env = None if workload == "lognormal" else make_env_factory(build_run_config(data))
    _, records, wall = await train(data, args.latency_p50, init_state, str(run_dir), make_env)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return wall


async def train_ray(data: dict[str, Any], run_dir: Path) -> float:
    """``labrl train``'s path (``runner.train``) with ``backend=ray`` on a local Ray of ``RAY_CPUS`` logical CPUs,
    its workers able to import this script's modules and make the lognormal env. The learner actor
    runs the config's warm start itself (a Ray run has no way in for the cached weights)."""
    import ray

    from labrl.harness.pipeline.runner import train as run_training

    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH", "")]))
    ray.init(
        num_cpus=RAY_CPUS, include_dashboard=False, logging_level="WARNING",
        runtime_env={"worker_process_setup_hook": "planner.register_latency_env"},
    )  # fmt: skip
    try:
        data = {**data, "run_dir": str(run_dir)}
        t0 = time.perf_counter()
        await run_training(build_run_config(data), fresh=True, progress=False)
        return time.perf_counter() - t0
    finally:
        ray.shutdown()


async def run_layout(workload: str, name: str, args) -> None:
    """Train layout ``name`` of ``workload``; keep its metrics.jsonl and episodes.jsonl and write its part
    JSON (module docstring)."""
    data = layout_config(workload, name, args)
    run_dir = Path(tempfile.mkdtemp(prefix=f"labrl-planner-{workload}-{name}-"))
    load_start = os.getloadavg()
    if WORKLOADS[workload][name].ray is None:
        wall = await train_inprocess(workload, data, args, run_dir)
    else:
        wall = await train_ray(data, run_dir)
    load_end = os.getloadavg()
    stem = part_name(workload, name)
    keep = PARTS / stem
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / METRICS_FILE, keep / METRICS_FILE)
    shutil.copy(run_dir / EPISODES_FILE, keep / EPISODES_FILE)
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = len(step_records(keep))
    part = {"workload": workload, "layout": name, "config": data, "args": vars(args), "wall_s": wall,
            "load_start": load_start, "load_end": load_end, "steps": steps}  # fmt: skip
    (PARTS / f"{stem}.json").write_text(json.dumps(part, indent=2))
    print(
        f"{workload} {name}: {steps} steps in {wall:.1f} s; load {load_start[0]:.2f} -> {load_end[0]:.2f}",
        flush=True,
    )


def merge(workload: str, args) -> None:
    """Compare every layout of ``workload`` run so far; print the table and write ``args.out``. A layout
    whose part JSON is here but not its run directory (they are not committed) keeps its row of the
    previous ``args.out``, marked so."""
    out_path = Path(args.out)
    previous = {}
    if out_path.exists():
        previous = {r["layout"]: r for r in json.loads(out_path.read_text()).get("layouts", [])}
    rows, missing = [], []
    for name, layout in WORKLOADS[workload].items():
        stem, source = part_name(workload, name), part_name(workload, layout.calibrated_from)
        if not (PARTS / f"{stem}.json").exists() or not (PARTS / f"{source}.json").exists():
            missing.append(name)
            continue
        if not (PARTS / stem / METRICS_FILE).exists() or not (PARTS / source / METRICS_FILE).exists():
            if name in previous:
                rows.append({**previous[name], "kept_from_previous_merge": True})
            else:
                missing.append(name)
            continue
        part = json.loads((PARTS / f"{stem}.json").read_text())
        cfg = build_run_config(part["config"])
        result = compare(cfg, PARTS / stem, PARTS / source, sim_steps=args.sim_steps, seed=args.seed)
        # the same prediction calibrated from the run itself: what is left of the error is the model's,
        # the rest is the calibration's failure to transfer from the reference run
        own = predict(cfg, PARTS / stem, sim_steps=args.sim_steps, seed=args.seed)
        rows.append({"layout": name, "calibrated_from": layout.calibrated_from, "pipeline": layout.pipeline,
                     "ray": layout.ray, "wall_s": part["wall_s"],
                     "load_start": part["load_start"], "load_end": part["load_end"], **result,
                     "predicted_own_calibration": own,
                     "errors_own_calibration": errors(own, result["measured"])})  # fmt: skip
    print(format_table(rows))
    if missing:
        print(f"\nnot run yet: {', '.join(missing)} (benchmarks/planner.py --workload {workload} --run NAME)")
    out = {"workload": workload, "args": vars(args), "throughput_goal": THROUGHPUT_GOAL,
           "staleness_goal": STALENESS_GOAL, "layouts": rows, "missing": missing}  # fmt: skip
    out_path.write_text(json.dumps(out, indent=2))


def format_table(rows: list[dict[str, Any]]) -> str:
    """One markdown row per layout: predicted / measured, the errors, the load at start and end."""
    lines = [
        "| layout | steps/s pred / meas (model) | error | learner idle pred / meas | staleness p99 pred / meas "
        "| error | binds (model) | own calibration: steps/s, p99 errors | load 1-min start / end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, m, e = r["predicted"], r["measured"], r["errors"]
        own = r["errors_own_calibration"]
        lines.append(
            f"| {r['layout']} | {p['steps_per_s']:.3f} / {m['steps_per_s']:.3f} ({p['steps_per_s_model']:.3f}) "
            f"| {e['steps_per_s_rel']:+.0%}{'' if e['throughput_ok'] else ' !'} "
            f"| {p['learner_idle']:.2f} / {m['learner_idle']:.2f} "
            f"| {p['staleness_p99']:g} / {m['staleness_p99']:g} "
            f"| {e['staleness_p99_abs']:+g}{'' if e['staleness_ok'] else ' !'} | {p['binding_model']} "
            f"| {own['steps_per_s_rel']:+.0%}, {own['staleness_p99_abs']:+g} "
            f"| {r['load_start'][0]:.2f} / {r['load_end'][0]:.2f} |"
        )
    return "\n".join(lines)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    names = sorted({n for layouts in WORKLOADS.values() for n in layouts})
    what.add_argument("--run", choices=names, metavar="LAYOUT", help="a layout of --workload (WORKLOADS)")
    what.add_argument("--merge", action="store_true", help="compare the layouts of --workload run so far")
    what.add_argument(
        "--project", action="store_true", help="the paper projection (planner_projection.py), on paper only"
    )
    ap.add_argument("--workload", choices=list(WORKLOADS), default=DEFAULT_WORKLOAD)
    ap.add_argument("--steps", type=int, default=30, help="learner steps per real run")
    ap.add_argument("--latency-p50", type=float, default=0.2)
    ap.add_argument("--max-staleness", type=int, default=4)  # pipeline.config's; each layout sets its own
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-steps", type=int, default=300, help="learner steps simulated per prediction")
    ap.add_argument(
        "--out", default=None, help="the merged JSON (default: results/planner.json or planner_WORKLOAD.json)"
    )
    args = parse_with_threads(ap, default=1)
    if args.run and args.run not in WORKLOADS[args.workload]:
        ap.error(
            f"--workload {args.workload} has no layout {args.run!r}: one of {', '.join(WORKLOADS[args.workload])}"
        )
    args.out = args.out or str(default_out(args.workload))
    if args.project:
        from planner_projection import project  # beside this script

        project(steps=args.sim_steps, seed=args.seed, out=RESULTS / "planner_projection.json")
        return
    register_latency_env()
    PARTS.mkdir(parents=True, exist_ok=True)
    if args.run:
        await run_layout(args.workload, args.run, args)
    else:
        merge(args.workload, args)


if __name__ == "__main__":
    asyncio.run(main())

"""The planner against real runs: predicted and measured steps/s, learner idle fraction, staleness p99.

Workload: ``benchmarks/pipeline.py``'s (the quickstart's tiny MoE, its format-only warm start,
an extra lognormal env latency of median ``--latency-p50`` s and p99/p50 = 20 per training
episode), evaluation off. Each *layout* (``LAYOUTS``: the quickstart's pipeline section with
other ``mode``, ``max_staleness``, ``max_concurrent_episodes``) trains ``--steps`` steps for
real. The planner (``harness/planning``) is calibrated from a *different* run, the reference
layout's (the reference itself from ``ALT_REFERENCE``'s), and predicts the layout as
``labrl plan`` does: ``kv_slots``, ``layout_of``, the closed form and ``--sim-steps`` simulated
steps. ``compare`` sets the prediction beside what the run measured, after its first tenth of
steps (the simulator's warm-up); ``--merge`` adds the prediction calibrated from the run itself,
which separates the model's error from the calibration's failure to carry over between runs:

    steps/s        = (last step - first step) / (time_s there - time_s here)   over the window
    learner idle   = 1 - (busy_s(last) - busy_s(first)) / (time_s(last) - time_s(first)),
                     busy_s = busy/learner x time_s (cumulative from the run's start)
    staleness p99  = p99 of version_at_train - token_versions[0] over the window's trained episodes
    errors         : steps/s relative, predicted / measured - 1 (goal |.| <= 0.15);
                     staleness p99 and learner idle absolute, predicted - measured (goal |p99| <= 1)

It runs in parts, each a few minutes on 2 shared cores, each writing JSON under
benchmarks/results/planner/ (a session's background jobs die at its end):

    .venv/bin/python benchmarks/planner.py --run reference     # then s1_c64, s2_c32, sync, ...
    .venv/bin/python benchmarks/planner.py --merge             # the table; results/planner.json
    .venv/bin/python benchmarks/planner.py --project           # the paper projection (planner_projection.py)

``--run NAME`` trains layout NAME into benchmarks/results/planner/NAME/ (its ``metrics.jsonl``
and ``episodes.jsonl`` only) and writes NAME.json there: the run config, wall seconds and
``os.getloadavg()`` at its start and end. The warm start is computed once per seed and kept
beside them (``warm_start_seed<N>.pt``, not committed); so are the layouts' run directories
(~1.5 MB each: the repository keeps NAME.json and the merged results/planner.json). ``--merge``
compares every layout run so far (it reads the run directories) and lists those missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from _torch_threads import parse_with_threads  # beside this script
from pipeline import config, train, warm_start  # the pipeline benchmark's workload, beside this script

from labrl.errors import ConfigError
from labrl.harness.config import RunConfig, build_run_config
from labrl.harness.metrics import percentile, read_jsonl
from labrl.harness.pipeline.traces import EPISODES_FILE, read_episode_traces
from labrl.harness.planning.calibrate import calibrate_run
from labrl.harness.planning.model import steady_state, sync_steps_per_s
from labrl.harness.planning.plan import kv_slots, layout_of
from labrl.harness.planning.simulate import simulate

RESULTS = Path(__file__).parent / "results"
PARTS = RESULTS / "planner"
METRICS_FILE = "metrics.jsonl"
WARMUP_FRACTION = 0.1  # as simulate's warm-up tenth
THROUGHPUT_GOAL = 0.15  # |predicted / measured - 1|
STALENESS_GOAL = 1.0  # |predicted - measured| of the p99, in steps

#: name -> the pipeline keys that differ from the quickstart's (mode pipeline, max_staleness 4,
#: max_concurrent_episodes 128, 8 groups of 8); in the order to run them
LAYOUTS: dict[str, dict[str, Any]] = {
    "reference": {"mode": "pipeline", "max_staleness": 4, "max_concurrent_episodes": 128},
    "s1_c64": {"mode": "pipeline", "max_staleness": 1, "max_concurrent_episodes": 64},
    "s2_c32": {"mode": "pipeline", "max_staleness": 2, "max_concurrent_episodes": 32},
    "sync": {"mode": "sync", "max_concurrent_episodes": 64},
    "s8_c256": {"mode": "pipeline", "max_staleness": 8, "max_concurrent_episodes": 256},
    "one_step_off": {"mode": "one_step_off", "max_concurrent_episodes": 64},
}
REFERENCE, ALT_REFERENCE = "reference", "s1_c64"


def calibration_source(name: str) -> str:
    """The layout whose run calibrates ``name``'s prediction: never its own."""
    return ALT_REFERENCE if name == REFERENCE else REFERENCE


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
    skip = min(int(len(records) * WARMUP_FRACTION), len(records) - 2)
    first, last = records[skip], records[-1]
    span = last["time_s"] - first["time_s"]
    busy_s = last["busy/learner"] * last["time_s"] - first["busy/learner"] * first["time_s"]
    staleness = sorted(
        r["version_at_train"] - r["token_versions"][0]
        for r in read_episode_traces(run_dir)
        if r["fate"] == "trained" and r["step"] > first["step"]
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
    slots = kv_slots(cfg, machines, episodes)
    lay = layout_of(
        cfg, machines, slots, staleness=p.effective_max_staleness, concurrency=p.max_concurrent_episodes
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
            "sampler_tokens_per_s": machines.sampler_tokens_per_s,
            "decode_tokens_per_s": episodes.decode_tokens_per_s,
            "kv_slots": slots,
            "keep_rate": workload.keep_rate,
            "env_s_per_episode": workload.env_s_per_episode,
            "tokens_per_episode": workload.tokens_per_episode,
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


def layout_config(name: str, args) -> dict[str, Any]:
    """The pipeline benchmark's config (``pipeline.config``) with layout ``name``'s keys, evaluation off."""
    data = config(LAYOUTS[name]["mode"], args)
    data["pipeline"].update(LAYOUTS[name], eval_every=0, episode_traces=True)
    return data


async def cached_warm_start(args) -> dict:
    path = PARTS / f"warm_start_seed{args.seed}.pt"
    if path.exists():
        return torch.load(path)
    state = await warm_start(args)
    torch.save(state, path)
    return state


async def run_layout(name: str, args) -> None:
    """Train layout ``name``; keep its metrics.jsonl and episodes.jsonl and write NAME.json (module docstring)."""
    init_state = await cached_warm_start(args)
    data = layout_config(name, args)
    run_dir = Path(tempfile.mkdtemp(prefix=f"labrl-planner-{name}-"))
    load_start = os.getloadavg()
    _, records, wall = await train(data, args.latency_p50, init_state, str(run_dir))
    load_end = os.getloadavg()
    keep = PARTS / name
    keep.mkdir(parents=True, exist_ok=True)
    (keep / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    shutil.copy(run_dir / EPISODES_FILE, keep / EPISODES_FILE)
    shutil.rmtree(run_dir, ignore_errors=True)
    part = {"layout": name, "config": data, "args": vars(args), "wall_s": wall,
            "load_start": load_start, "load_end": load_end, "steps": len(records)}  # fmt: skip
    (PARTS / f"{name}.json").write_text(json.dumps(part, indent=2))
    print(
        f"{name}: {len(records)} steps in {wall:.1f} s; load {load_start[0]:.2f} -> {load_end[0]:.2f}",
        flush=True,
    )


def merge(args) -> None:
    """Compare every layout run so far; print the table and write results/planner.json."""
    rows, missing = [], []
    for name in LAYOUTS:
        part_file, source = PARTS / f"{name}.json", calibration_source(name)
        if not part_file.exists() or not (PARTS / f"{source}.json").exists():
            missing.append(name)
            continue
        part = json.loads(part_file.read_text())
        cfg = build_run_config(part["config"])
        result = compare(cfg, PARTS / name, PARTS / source, sim_steps=args.sim_steps, seed=args.seed)
        # the same prediction calibrated from the run itself: what is left of the error is the model's,
        # the rest is the calibration's failure to transfer from the reference run
        own = predict(cfg, PARTS / name, sim_steps=args.sim_steps, seed=args.seed)
        rows.append({"layout": name, "calibrated_from": source, "pipeline": LAYOUTS[name], "wall_s": part["wall_s"],
                     "load_start": part["load_start"], "load_end": part["load_end"], **result,
                     "predicted_own_calibration": own,
                     "errors_own_calibration": errors(own, result["measured"])})  # fmt: skip
    print(format_table(rows))
    if missing:
        print(f"\nnot run yet: {', '.join(missing)} (benchmarks/planner.py --run NAME)")
    out = {"args": vars(args), "throughput_goal": THROUGHPUT_GOAL, "staleness_goal": STALENESS_GOAL,
           "layouts": rows, "missing": missing}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=2))


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
    what.add_argument("--run", choices=list(LAYOUTS), metavar="LAYOUT", help=f"one of {', '.join(LAYOUTS)}")
    what.add_argument("--merge", action="store_true", help="compare the layouts run so far")
    what.add_argument(
        "--project", action="store_true", help="the paper projection (planner_projection.py), on paper only"
    )
    ap.add_argument("--steps", type=int, default=30, help="learner steps per real run")
    ap.add_argument("--latency-p50", type=float, default=0.2)
    ap.add_argument("--max-staleness", type=int, default=4)  # pipeline.config's; each layout sets its own
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sim-steps", type=int, default=300, help="learner steps simulated per prediction")
    ap.add_argument("--out", default=str(RESULTS / "planner.json"))
    args = parse_with_threads(ap, default=1)
    if args.project:
        from planner_projection import project  # beside this script

        project(steps=args.sim_steps, seed=args.seed, out=RESULTS / "planner_projection.json")
        return
    PARTS.mkdir(parents=True, exist_ok=True)
    if args.run:
        await run_layout(args.run, args)
    else:
        merge(args)


if __name__ == "__main__":
    asyncio.run(main())
